"""A tiny DeepSeek-V3-shaped checkpoint in DeepSeek's FP8 block-quantized format, and its dequantized twin (also a
tiny Llama in the same format, `write_tiny_fp8_llama_model`).

`write_tiny_fp8_model(FP8_DIR, TWIN_DIR)` writes the tiny MLA model (dcpserve/cluster/tiny_model.py,
`write_tiny_mla_model`) with V3's shape: a q_lora_rank latent, sigmoid routing with noaux_tc (a random
`e_score_correction_bias` per MoE layer, groups of experts, renormalized weights) and architecture
DeepseekV3ForCausalLM; then quantizes it as DeepSeek-V3 ships:

- every linear weight of the decoder layers (attention projections, dense and shared MLPs, every routed expert) as
  float8_e4m3fn `X.weight` with a float32 `X.weight_scale_inv` per [block_n, block_k] block (amax / 448 of the
  block, partial blocks at the ends); the router (`mlp.gate`), norms, embedding and LM head stay as they are;
- config.json gains quantization_config {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [block_n, block_k]}.

The twin holds the same weights after the round trip (fp8 value * scale, in float32) and no quantization_config: an
engine that loads FP8 correctly produces the twin's logits. The default block is [16, 16]: the shrunk model's TP
shards at tp = 4 (e.g. 16 intermediate rows of an expert per rank) fall on 16-blocks, not on DeepSeek's 128 ones,
and its kv_a_proj_with_mqa (56 rows) and latent inputs (24, 40 columns) end in partial blocks.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dcpserve.cluster.tiny_model import TinyMlaSpec, TinyModelSpec, write_tiny_mla_model, write_tiny_model
from dcpserve.kernels import dequantize_fp8_block

FP8_MAX = 448.0  # the largest float8_e4m3fn value
FP8_BLOCK = (16, 16)
# The decoder's linear weights (DeepSeek-V3 quantizes every nn.Linear of its layers; mlp.gate is the router).
QUANTIZED_WEIGHT = re.compile(
    r"^model\.layers\.\d+\.(self_attn|mlp)\..*\b(q_proj|k_proj|v_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|"
    r"o_proj|gate_proj|up_proj|down_proj)\.weight$"
)
# V3-shaped, shrunk: every TP shard at tp <= 4 on a 16-block (heads * 48 query rows, 64 kv_b rows per head,
# 64 / 256 intermediate), partial blocks where the latents cut them.
TINY_V3_SPEC = TinyMlaSpec(
    hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4, q_lora_rank=24,
    kv_lora_rank=40, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8,
    num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64, first_k_dense_replace=1,
    topk_method="noaux_tc", n_group=4, topk_group=2, routed_scaling_factor=2.5, initializer_range=0.1,
)


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [N, K], float32 weight_scale_inv [ceil(N / bn), ceil(K / bk)]): each block scaled so its
    largest magnitude is 448, as DeepSeek's quantization does (an all-zero block gets scale 1)."""
    n, k = weight.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32)
    padded[:n, :k] = weight.to(torch.float32)
    blocks = padded.view(rows, bn, cols, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(rows * bn, cols * bk)
    return quantized[:n, :k].to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def quantize_state(state: dict[str, torch.Tensor], block: tuple[int, int]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint's tensors as DeepSeek ships them quantized (every QUANTIZED_WEIGHT as float8_e4m3fn `X.weight`
    plus `X.weight_scale_inv`, the rest as they are), and the same after the round trip (fp8 value * block scale, in
    float32): what an engine that loads FP8 correctly computes with."""
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if QUANTIZED_WEIGHT.match(name):
            weight, scale = quantize_fp8_block(tensor, block)
            quantized[name], quantized[name + "_scale_inv"] = weight, scale
            dequantized[name] = dequantize_fp8_block(weight, scale, block, torch.float32)
        else:
            quantized[name] = dequantized[name] = tensor
    return quantized, dequantized


def write_tiny_fp8_model(
    directory: str | Path,
    twin_directory: str | Path,
    seed: int = 0,
    *,
    spec: TinyMlaSpec = TINY_V3_SPEC,
    block: tuple[int, int] = FP8_BLOCK,
    log: Callable[[str], None] | None = None,
) -> tuple[Path, Path]:
    """Writes the FP8 checkpoint into `directory` and its dequantized twin into `twin_directory` (both new or
    empty, or earlier tiny models); returns both resolved paths. spec.topk_method "noaux_tc" makes it V3."""
    out = write_tiny_mla_model(directory, seed, spec=spec, force=False, log=log)
    raw = json.loads((out / "config.json").read_text())
    state = load_file(str(out / "model.safetensors"))
    if spec.topk_method == "noaux_tc":
        raw, state = _as_v3(raw, state, spec, seed)
    return out, _quantize(out, Path(twin_directory), raw, state, block, log)


def write_tiny_fp8_llama_model(
    directory: str | Path,
    twin_directory: str | Path,
    seed: int = 0,
    *,
    spec: TinyModelSpec | None = None,
    block: tuple[int, int] = FP8_BLOCK,
    log: Callable[[str], None] | None = None,
) -> tuple[Path, Path]:
    """The tiny Llama (write_tiny_model) in the same FP8 format (q / k / v / o and the MLP's projections quantized,
    as Qwen3's FP8 checkpoints are), and its dequantized twin."""
    out = write_tiny_model(directory, seed, spec=spec, force=False, log=log)
    raw = json.loads((out / "config.json").read_text())
    return out, _quantize(out, Path(twin_directory), raw, load_file(str(out / "model.safetensors")), block, log)


def _quantize(out: Path, twin_directory: Path, raw: dict[str, object], state: dict[str, torch.Tensor],
              block: tuple[int, int], log: Callable[[str], None] | None) -> Path:
    """Rewrites `out` in the FP8 format and writes its dequantized twin beside it; returns the twin's path."""
    twin = twin_directory.expanduser().resolve()
    if twin.exists() and any(twin.iterdir()) and not (twin / "dcpserve_tiny_model.json").is_file():
        raise FileExistsError(f"{twin} is not empty and is not a dcpserve tiny model; pass an empty or new directory")
    shutil.copytree(out, twin, dirs_exist_ok=True)
    quantized, dequantized = quantize_state(state, block)
    for path, tensors in ((out, quantized), (twin, dequantized)):
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "model.safetensors").chmod(0o644)
    _write_config(twin, raw)
    _write_config(out, {**raw, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
    }})
    if log is not None:
        count = sum(1 for name in state if QUANTIZED_WEIGHT.match(name))
        log(f"quantized {count} weights to float8_e4m3fn in blocks of {list(block)}; dequantized twin at {twin}")
    return twin


def _as_v3(raw: dict[str, object], state: dict[str, torch.Tensor], spec: TinyMlaSpec, seed: int
           ) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """DeepSeek-V3's routing on the V2 weights: sigmoid scores, noaux_tc with a random correction bias per MoE
    layer, renormalized top-k weights; architecture DeepseekV3ForCausalLM."""
    raw = {**raw, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "scoring_func": "sigmoid",
           "topk_method": "noaux_tc", "norm_topk_prob": True, "rope_interleave": True}
    generator = torch.Generator().manual_seed(seed + 1)
    state = dict(state)
    for name in [n for n in state if n.endswith(".mlp.gate.weight")]:
        bias = 0.1 * torch.randn(spec.n_routed_experts, generator=generator)
        state[name.removesuffix("weight") + "e_score_correction_bias"] = bias
    return raw, state


def _write_config(directory: Path, raw: dict[str, object]) -> None:
    (directory / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n", encoding="utf-8")
