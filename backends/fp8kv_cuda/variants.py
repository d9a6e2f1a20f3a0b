"""Kernel variants: which CUDA source, with which compile-time macros, and the NVRTC options.

One place decides how a launch maps onto a compiled variant, shared by the runtime
(:mod:`fp8kv_cuda.runtime`, CuPy on a GPU) and the CPU compile cells (:mod:`fp8kv_cuda.compile`,
NVRTC from PyPI): both compile exactly :func:`source` with :func:`options`.

Every format-specific number comes from :func:`fp8kv.codec.codec_constants` (none is typed in
the CUDA sources). No CUDA header is included: the sources need only NVRTC's built-ins, so the
CPU compile needs no toolkit headers.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from importlib import resources

from fp8kv.codec import codec_constants
from fp8kv.formats import FORMATS
from fp8kv.precision import FULL_P_KEYS

KERNELS = {"write": ("write.cu", ("fp8kv_write_kv",)),
           "attention": ("attention.cu", ("fp8kv_paged_attention", "fp8kv_merge")),
           "attention_mma": ("attention_mma.cu", ("fp8kv_paged_attention_mma", "fp8kv_merge")),
           "prefill_mma": ("prefill_mma.cu", ("fp8kv_prefill_mma", "fp8kv_prefill_mma_exact", "fp8kv_merge")),
           "prefill_wmma": ("prefill_wmma.cu", ("fp8kv_prefill_wmma", "fp8kv_prefill_wmma_exact", "fp8kv_merge")),
           "prefill_wgmma": ("prefill_wgmma.cu", ("fp8kv_prefill_wgmma", "fp8kv_wgmma16_layout_test")),
           "codec": ("codec_kernels.cu", ("fp8kv_encode", "fp8kv_decode", "fp8kv_widen_f16", "fp8kv_widen_native"))}
"""kernel family -> (source file in csrc/, entry points)."""

FORMAT_NAMES = ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz")
IO_KINDS = {"float32": 0, "float16": 1, "bfloat16": 2}

BASE_OPTIONS = ("-std=c++17", "-ftz=false", "-prec-div=true", "-prec-sqrt=true")
"""IEEE division (the write's ``x / scale`` and the token_head scale must be correctly rounded)
and denormals (the FP8 decoder multiplies float32 subnormals exactly) are required."""

ATTN_THREADS = 128
WRITE_THREADS = 128


@dataclass(frozen=True)
class Variant:
    """One compilation unit: a kernel family, its format and its macros."""

    kernel: str
    fmt: str
    macros: tuple[tuple[str, int], ...] = field(default_factory=tuple)

    @property
    def entry_points(self) -> tuple[str, ...]:
        return KERNELS[self.kernel][1]

    @property
    def label(self) -> str:
        m = " ".join(f"{k.removeprefix('FP8KV_').lower()}={v}" for k, v in self.macros)
        return f"{self.kernel} {self.fmt} {m}"

    def defines(self) -> tuple[str, ...]:
        """``-D`` options: the format's constants, then this variant's macros."""
        c = codec_constants(FORMATS[self.fmt])
        fmt = {"FP8KV_MANT": c.mant_bits, "FP8KV_BIAS": c.bias, "FP8KV_FNUZ": int(c.fnuz),
               "FP8KV_HASINF": int(c.has_inf), "FP8KV_MAXBITS": f"0x{c.max_f32_bits:08X}u",
               "FP8KV_MAXMAG": f"0x{c.max_mag:02X}u"}
        return tuple(f"-D{k}={v}" for k, v in (*fmt.items(), *self.macros))


def write_variant(fmt: str, io_dtype: str, token_scales: bool, d_pad: int, vec: bool, slot64: bool) -> Variant:
    """The write kernel for one format, input dtype (``"bfloat16"``...), granularity and alignment."""
    return Variant("write", fmt, (("FP8KV_IN", IO_KINDS[io_dtype]), ("FP8KV_TOKEN_SCALES", int(token_scales)),
                                  ("FP8KV_D_PAD", d_pad), ("FP8KV_VEC", int(vec)), ("FP8KV_SLOT64", int(slot64))))


def attention_variant(fmt: str, io_dtype: str, token_scales: bool, d_pad: int, gpad: int, block_n: int,
                      vec: int) -> Variant:
    """The attention kernels (decode + merge) for one format, query dtype, granularity and tile."""
    return Variant("attention", fmt, (("FP8KV_QT", IO_KINDS[io_dtype]), ("FP8KV_TOKEN_SCALES", int(token_scales)),
                                      ("FP8KV_D_PAD", d_pad), ("FP8KV_GPAD", gpad), ("FP8KV_BLOCK_N", block_n),
                                      ("FP8KV_VEC", vec)))


MMA_TILES = {64: (3, 12, 12), 128: (2, 12, 8), 256: (3, 8, 4)}
"""Tensor-core kernel per head size: (cp.async ring stages on sm80+ (:func:`mma_stages`), warps per
SM its registers are budgeted for with the sm89+ conversion of the OCP formats, the same with the
bit-level conversion (sm75/80/86, fnuz formats), which needs more registers). Shared memory per CTA
is ``fp8kv_cuda.attention.mma_smem_bytes``."""
MMA_WARPS = (4, 6, 8)
"""Warps per CTA the tensor-core kernel is compiled for (the plan picks one per step)."""
MMA_WAVE_TILES = {128: {2: (4, 2, 1), 3: (3, 2, 1), 4: (2, 3, 1)}}
"""sm90, per head size: the tensor-core decode's (warps, ring stages, 16-key sub-tiles a warp step) for
grids of more CTAs than SMs, by the CTAs an SM must hold for one wave, ceil(CTAs / SMs);
``fp8kv_cuda.attention.mma_wave_config``. About eight warps an SM in one wave, each on 16-key steps.
Medians of five alternated rounds on the H100, GQA 32/8, against other tiles: 256 CTAs (B=32 L=4096) 97.6 us at
4 x 2 x 1 against 100.1 at 4 x 3 x 2 (6 x 2 x 2: 103.8 in another run); 384 (B=48 L=2048) 76.4 at
3 x 2 x 1 against 78.3 at 2 x 3 x 2; 512 (B=64 L=2048) 98.4 at 2 x 3 x 1 against 99.9 at 2 x 3 x 2
(6 x 2 x 2: 105.7); the FP8 mode alike. Grids that need more than four CTAs an SM keep the default
6 x 2 x 2: at 1024 CTAs (B=128) 3 x 2 x 1 was 1.6% faster at L=1k in alternated rounds, but 3-4.6%
slower at L >= 4k (and in 5 of 6 L=1k cells) between two decode sweeps on two machines. With at most
one CTA an SM, 6 x 2 x 2 stays best (B=8, B=1, B=16 L=8192; 16-key steps lose there). Not measured
elsewhere: other head sizes and GPUs keep their tiles."""
MMA_MIN_SM = 75
"""The tensor-core kernels run from Turing on (mma.sync m16n8k8 with float16 operands, movmatrix)."""
BF16_MMA_MIN_SM = 80
"""bfloat16 operands (so bfloat16 queries on tensor cores) and cp.async need sm80+ (Ampere)."""
TURING_SM_WARPS = 8
"""Warps per SM the tensor-core decode's registers are budgeted for on sm75: two CTAs of 4 warps,
as many as Turing's 64 KiB of shared memory hold (:func:`mma_stages`; ``MMA_TILES``'s 12 would cost
spills at D=64 there)."""


def _mma_query_ok(sm: int, io_dtype: str) -> bool:
    return io_dtype == "float16" or (io_dtype == "bfloat16" and sm >= BF16_MMA_MIN_SM)


def mma_arch_serves(sm: int, fmt: str, head_size: int, io_dtype: str) -> bool:
    """Whether the tensor-core decode kernel serves a format, head size and query dtype
    (``"float16"``...) on GPU architecture ``sm`` (75 for sm75): float16 queries from sm75 on,
    bfloat16 from sm80 on (:data:`BF16_MMA_MIN_SM`); head sizes 64 and 128; head size 256 only
    where FP8 converts natively (sm89+, OCP formats): the bit-level conversion does not fit its
    registers there."""
    if sm < MMA_MIN_SM or head_size not in MMA_TILES or not _mma_query_ok(sm, io_dtype):
        return False
    return head_size != 256 or (sm >= 89 and "fnuz" not in fmt)


def mma_stages(sm: int, head_size: int) -> int:
    """Ring depth of the tensor-core decode: :data:`MMA_TILES`'s on sm80+; 1 below (no cp.async:
    copies complete when issued, so a deeper ring overlaps nothing and only takes the shared memory
    that more warps per SM could use; Turing has 64 KiB per SM)."""
    return MMA_TILES[head_size][0] if sm >= BF16_MMA_MIN_SM else 1


def attention_mma_variant(fmt: str, io_dtype: str, head_size: int, warps: int = 4,
                          token_scales: bool = False, sm: int = BF16_MMA_MIN_SM, fp8_attention: bool = False,
                          stages: int | None = None, nsub: int | None = None) -> Variant:
    """The tensor-core attention kernels (decode + merge) for one format, float16/bfloat16 queries,
    a head size of 64, 128 or 256, ``warps`` warps per CTA, static or per-token-head scales, and
    the ring depth of architecture ``sm`` (:func:`mma_stages`; every sm80+ shares one variant).
    ``fp8_attention``: the FP8 attention mode's decode (``FP8KV_FP8_MODE``: an e4m3 cache with static
    scales, sm89+; :data:`FP8_MODE_MIN_SM`). ``stages``: a ring depth other than :func:`mma_stages`'s;
    ``nsub``: 16-key sub-tiles a warp step other than the kernel's (2, 1 at head size 256)."""
    _, sm_warps_native, sm_warps_bits = MMA_TILES[head_size]
    if sm < BF16_MMA_MIN_SM:  # Turing's 64 KiB of shared memory hold two 4-warp CTAs: a larger register budget
        sm_warps_native, sm_warps_bits = min(sm_warps_native, TURING_SM_WARPS), min(sm_warps_bits, TURING_SM_WARPS)
    return Variant("attention_mma", fmt, (("FP8KV_QT", IO_KINDS[io_dtype]), ("FP8KV_TOKEN_SCALES", int(token_scales)),
                                          ("FP8KV_D", head_size), ("FP8KV_STAGES", stages or mma_stages(sm, head_size)),
                                          ("FP8KV_MMA_WARPS", warps), ("FP8KV_SM_WARPS_NATIVE", sm_warps_native),
                                          ("FP8KV_SM_WARPS_BITS", sm_warps_bits), ("FP8KV_FULL_P_KEYS", FULL_P_KEYS),
                                          *((("FP8KV_FP8_MODE", 1),) if fp8_attention else ()),
                                          *((("FP8KV_NSUB", nsub),) if nsub else ())))


FP8_MODE_MIN_SM = 89
"""The FP8 attention mode's decode (``attention_mma_variant(fp8_attention=True)``) rounds the query and the
probabilities to e4m3 with ``cvt.rn.satfinite.e4m3x2.f32`` and widens them with ``cvt.rn.f16x2.e4m3x2``
(sm89+)."""


PREFILL_HEAD_SIZES = (128,)
"""Head sizes of the tensor-core prefill kernel (``csrc/prefill_mma.cu``)."""
PREFILL_STAGES = 4
"""cp.async ring depth of the tensor-core prefill kernel on sm80+ (K and V tiles of 32 keys; three in
flight); :func:`prefill_stages`."""


def prefill_stages(sm: int) -> int:
    """Ring depth of the tensor-core prefill: :data:`PREFILL_STAGES` on sm80+; 2 below, its least
    (the step being read and the one being filled; copies complete when issued), which fits
    Turing's 64 KiB of shared memory."""
    return PREFILL_STAGES if sm >= BF16_MMA_MIN_SM else 2


WMMA_MIN_SM = 70
"""Volta: the tensor-core prefill through PTX wmma (``csrc/prefill_wmma.cu``; mma.sync m8n8k4 there, whose
fragments ``csrc/prefill_mma.cu``'s m16n8k16 layout does not fit), float16 queries."""
WMMA_THREADS = 256
"""Threads per CTA of ``csrc/prefill_wmma.cu`` (8 warps of 16 query rows)."""


def prefill_arch_serves(sm: int, fmt: str, head_size: int, io_dtype: str) -> bool:
    """Whether a tensor-core prefill kernel serves a format, head size and query dtype on ``sm``:
    float16 queries from sm70 on (Volta: :func:`prefill_wmma_variant`), bfloat16 from sm80 on; head
    size 128; every format."""
    return sm >= WMMA_MIN_SM and head_size in PREFILL_HEAD_SIZES and _mma_query_ok(sm, io_dtype)


def wmma_smem_bytes(head_size: int = 128) -> int:
    """``sizeof(WmmaShared)`` of ``csrc/prefill_wmma.cu`` rounded up to 128 bytes (a ``static_assert``
    there checks it is enough): Q, the step's K and V in float16 (rows padded by 16 bytes), the 8
    warps' S tiles (16 rows of 44 floats), the step's V codes, the per-warp words and the key
    addressing."""
    ldh = head_size + 8
    size = 2 * ldh * (128 + 2 * 32) + 8 * 16 * 44 * 4 + 32 * head_size + 3 * 8 * 4 + 80
    return -(-size // 128) * 128


def prefill_wmma_variant(fmt: str, head_size: int = 128) -> Variant:
    """Volta's tensor-core chunked-prefill kernel (+ the split merge) for one format: float16 queries,
    static (tensor or head) scales, head size 128."""
    return Variant("prefill_wmma", fmt, (("FP8KV_QT", IO_KINDS["float16"]), ("FP8KV_TOKEN_SCALES", 0),
                                         ("FP8KV_D", head_size), ("FP8KV_FULL_P_KEYS", FULL_P_KEYS),
                                         ("FP8KV_SMEM_BYTES", wmma_smem_bytes(head_size))))


def prefill_variant(fmt: str, io_dtype: str, head_size: int, sm: int) -> Variant:
    """The tensor-core prefill kernel architecture ``sm`` runs: Volta's wmma one below sm75, else
    ``csrc/prefill_mma.cu`` (sm90 adds ``csrc/prefill_wgmma.cu`` where it serves)."""
    if sm < MMA_MIN_SM:
        return prefill_wmma_variant(fmt, head_size)
    return prefill_mma_variant(fmt, io_dtype, head_size, sm=sm)


def prefill_mma_variant(fmt: str, io_dtype: str, head_size: int = 128, warps: int = 4,
                        sm: int = BF16_MMA_MIN_SM) -> Variant:
    """The tensor-core chunked-prefill kernel (+ the split merge) for one format, float16/bfloat16
    queries, static (tensor or head) scales, head size 128, and the ring depth of ``sm``."""
    return Variant("prefill_mma", fmt, (("FP8KV_QT", IO_KINDS[io_dtype]), ("FP8KV_TOKEN_SCALES", 0),
                                        ("FP8KV_D", head_size), ("FP8KV_STAGES", prefill_stages(sm)),
                                        ("FP8KV_PREFILL_WARPS", warps), ("FP8KV_FULL_P_KEYS", FULL_P_KEYS)))


WGMMA_PREFILL_FORMATS = ("fp8_e4m3",)
"""Cache formats of the sm90 prefill kernel (``csrc/prefill_wgmma.cu``)."""
WGMMA_STAGES = 3
WGMMA_BLOCK_N = 64
"""Keys per tile of the sm90 prefill kernel."""
WGMMA_THREADS = 384
SM90A_KERNELS = ("prefill_wgmma",)
"""Kernel families built for ``sm_90a`` (wgmma and setmaxnreg need the architecture-specific target)."""


def arch_target(kernel: str, sm: int) -> str:
    """The ``--gpu-architecture`` of kernel family ``kernel`` on architecture ``sm``: ``sm_XY``, or
    ``sm_90a`` for the sm90-only wgmma kernels."""
    return f"sm_{sm}a" if kernel in SM90A_KERNELS else f"sm_{sm}"


def prefill_wgmma_variant(io_dtype: str, pingpong: bool = True, tma: bool = True) -> Variant:
    """The sm90 (wgmma) chunked-prefill kernel: e4m3 cache, static scales, head size 128, float16 or
    bfloat16 queries; ``pingpong``: its two consumer warpgroups issue their products in turn; ``tma``:
    K and V tiles loaded by TMA (:mod:`fp8kv_cuda.tma`), else by cp.async (caches TMA cannot describe)."""
    return Variant("prefill_wgmma", "fp8_e4m3", (("FP8KV_QT", IO_KINDS[io_dtype]), ("FP8KV_TOKEN_SCALES", 0),
                                                 ("FP8KV_FULL_P_KEYS", FULL_P_KEYS), ("FP8KV_STAGES", WGMMA_STAGES),
                                                 ("FP8KV_PINGPONG", int(pingpong)), ("FP8KV_TMA", int(tma))))


def codec_variant(fmt: str) -> Variant:
    """The elementwise codec kernels of one format (GPU proofs of the software codec)."""
    return Variant("codec", fmt)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def write_d_pad(head_size: int) -> int:
    """The write kernel's padded head size: a power of two >= 32 (one warp per row)."""
    return max(32, next_pow2(head_size))


def attention_tile(head_size: int, group: int) -> tuple[int, int, int]:
    """``(D_PAD, GPAD, BLOCK_N)`` of the attention kernel: head size padded to a power of two
    >= 16, up to 16 query heads per CTA (more are split into head chunks), keys per tile as many as
    the 48 KiB of a static shared allocation allow: 128 for head sizes up to 128 with up to 4 query
    heads per CTA (more loads in flight per round trip), 64 with more heads, 32 above 128."""
    d_pad = max(16, next_pow2(head_size))
    gpad = min(16, next_pow2(group))
    block_n = 32 if d_pad > 128 else (128 if gpad <= 4 else 64)
    return d_pad, gpad, block_n


@functools.cache
def _read(name: str) -> str:
    return resources.files("fp8kv_cuda").joinpath("csrc", name).read_text()


@functools.cache
def source(kernel: str) -> str:
    """The kernel family's CUDA source with every ``#include "x.cuh"`` of ``csrc/`` inlined, each
    header once (so that a compile cache keyed on the source text sees every change)."""
    text = _read(KERNELS[kernel][0])
    if _INCLUDE.search(text) is None:
        raise RuntimeError(f"{KERNELS[kernel][0]}: expected an #include of codec.cuh")
    return inline_headers(text)


def inline_headers(text: str) -> str:
    """``text`` (CUDA source) with every ``#include "x.cuh"`` of this backend's ``csrc/`` inlined, each
    header once. Public: another in-tree backend's kernel includes ``wgmma_common.cuh`` this way."""
    seen: set[str] = set()

    def inline(text: str) -> str:
        lines = []
        for line in text.splitlines():
            m = _INCLUDE.fullmatch(line.strip())
            if m is None:
                lines.append(line)
            elif m.group(1) not in seen:
                seen.add(m.group(1))
                lines.append(inline(_read(m.group(1))))
        return "\n".join(lines)

    return inline(text) + "\n"


_INCLUDE = re.compile(r'#include "([\w.]+\.cuh)"')


def options(variant: Variant) -> tuple[str, ...]:
    """NVRTC options (without the architecture, which the caller adds)."""
    return (*BASE_OPTIONS, *variant.defines())
