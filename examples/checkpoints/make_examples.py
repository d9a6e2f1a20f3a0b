"""Write the tiny example checkpoints used by docs/checkpoints.md (deterministic).

Both follow the Llama-3.1-8B geometry (32 layers, 8 KV heads, head_dim 128) and
carry no weights: ``llama-w4a16`` is a config only (compressed-tensors W4A16,
weight-only, no ``kv_cache_scheme``); ``llama-fp8-kv`` is a compressed-tensors
FP8 W8A8 config with ``kv_cache_scheme`` plus a ``model.safetensors`` holding just
its per-layer ``self_attn.k_scale`` / ``v_scale`` (bf16, shape ``[]``).

    python examples/checkpoints/make_examples.py
    fp8kv plan examples/checkpoints/llama-w4a16 --kv-cache-dtype fp8_e5m2 --simulate sm80
    fp8kv plan examples/checkpoints/llama-fp8-kv --kv-cache-dtype fp8_e5m2 --simulate sm80
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "torch_dtype": "bfloat16",
}


def _group(weights: dict, inputs: dict | None) -> dict:
    return {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                        "output_activations": None}}


W4A16 = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": _group({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                             "group_size": 128, "dynamic": False}, None),
    "ignore": ["lm_head"], "kv_cache_scheme": None,
}
FP8_KV = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "config_groups": _group({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                             "dynamic": False},
                            {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                             "dynamic": True}),
    "ignore": ["lm_head"],
    "kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                        "dynamic": False},
}


def write(name: str, quant: dict, scales: dict[str, torch.Tensor] | None = None) -> None:
    d = HERE / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**LLAMA, "quantization_config": quant}, indent=2) + "\n")
    if scales is not None:
        save_file(scales, str(d / "model.safetensors"), metadata={"format": "pt"})


def main() -> None:
    write("llama-w4a16", W4A16)
    g = torch.Generator().manual_seed(0)
    scales = {}
    for layer in range(LLAMA["num_hidden_layers"]):
        k, v = (0.02 + 0.2 * torch.rand(2, generator=g)).tolist()
        scales[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k, dtype=torch.bfloat16)
        scales[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v, dtype=torch.bfloat16)
    write("llama-fp8-kv", FP8_KV, scales)


if __name__ == "__main__":
    main()
