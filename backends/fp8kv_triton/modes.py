"""Codec mode numbers shared by the kernels and the policy (no Triton import here).

Encoders (float32 -> FP8 byte): :data:`ENC_INTEGER` (integer bit operations, exact
everywhere) and :data:`ENC_NATIVE` (Triton's cast, only where proven exact).

Decoders (FP8 byte -> exact float16/bfloat16/float32), see :mod:`fp8kv_triton.codec`:
:data:`DEC_NATIVE`, :data:`DEC_E5M2`, :data:`DEC_E4M3`, :data:`DEC_GENERIC`.
"""

ENC_INTEGER = 0
ENC_NATIVE = 1

DEC_NATIVE = 0
DEC_E5M2 = 1
DEC_E4M3 = 2
DEC_GENERIC = 3


def integer_decoder(fmt_name: str) -> int:
    """The cheapest exact integer decoder for a format (by canonical name)."""
    if fmt_name == "fp8_e5m2":
        return DEC_E5M2
    if fmt_name in ("fp8_e4m3", "fp8_e4m3fnuz"):
        return DEC_E4M3
    return DEC_GENERIC
