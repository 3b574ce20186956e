"""The project's embedded default model: a tiny random-weight Llama with one KV head, written offline; and its MLA
sibling, a tiny random-weight DeepSeek-V2 (multi-head latent attention + mixture of experts).

`write_tiny_model(DIR)` (and `dcpserve tiny-model DIR`) writes a Hugging Face model directory that
transformers' AutoModelForCausalLM / AutoTokenizer load with local_files_only=True (`write_tiny_mla_model(DIR)`,
`dcpserve tiny-model --mla DIR`: the same with DeepseekV2ForCausalLM weights, every norm and bias random too):

- config.json, generation_config.json, model.safetensors: LlamaForCausalLM, fp32, random weights from `seed`;
  one KV head, so TP=2 x DCP=2 and TP=4 x DCP=4 are valid layouts (docs/dcp.md);
- tokenizer.json, tokenizer_config.json: a byte-level BPE tokenizer (any UTF-8 text round-trips) trained with
  the `tokenizers` library on a fixed list of this Python's standard-library sources (CORPUS_FILES, read from
  sysconfig's stdlib path), with a Llama-3 style chat template;
- dcpserve_tiny_model.json: the marker that lets a later run overwrite the directory without --force.

Nothing is downloaded. The output is byte-identical for the same seed, Python version (the training text) and
transformers / tokenizers / torch versions.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as BpeTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

if TYPE_CHECKING:
    import torch

MARKER_FILE = "dcpserve_tiny_model.json"

# Standard-library modules present in every supported Python (>= 3.11); mostly ASCII code and prose.
CORPUS_FILES = (
    "argparse.py",
    "bisect.py",
    "contextlib.py",
    "dataclasses.py",
    "functools.py",
    "heapq.py",
    "json/decoder.py",
    "json/encoder.py",
    "string.py",
    "textwrap.py",
)

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
END_OF_TURN_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, "<|start_header_id|>", "<|end_header_id|>", END_OF_TURN_TOKEN)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Files a Hugging Face loader could pick up: removed before writing, so no stale shard or tokenizer survives.
_LOADER_FILE_PATTERNS = (
    "config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
    "pytorch_model*.bin", "pytorch_model.bin.index.json", "tokenizer*.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json",
    "merges.txt", MARKER_FILE,
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model; the defaults are the project's default model."""

    vocab_size: int = 512  # BPE vocabulary including the special tokens
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    head_dim: int = 32
    max_position_embeddings: int = 8192
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(
                f"vocab_size={self.vocab_size} is too small: a byte-level BPE needs the 256 byte tokens and "
                f"{len(SPECIAL_TOKENS)} special tokens; use at least {256 + len(SPECIAL_TOKENS)}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )


@dataclass(frozen=True)
class TinyMlaSpec:
    """Shape of the tiny DeepSeek-V2 model; the defaults are `dcpserve tiny-model --mla`'s: one latent KV head of
    40 + 12 values (neither, nor their sum, a power of two), 4 heads (so TP=4 x DCP=4 is valid), a dense first
    layer, then MoE layers of 8 routed experts (2 per token) and a shared one, YaRN RoPE."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256  # the dense layers'
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    q_lora_rank: int | None = None  # None: one q_proj, as DeepSeek-V2-Lite
    kv_lora_rank: int = 40
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 12
    v_head_dim: int = 32
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 64
    first_k_dense_replace: int = 1
    topk_method: str = "greedy"  # or "group_limited_greedy" with n_group / topk_group
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    attention_bias: bool = False
    yarn_factor: float | None = 4.0  # None: plain RoPE
    yarn_original_max_position_embeddings: int = 2048
    yarn_mscale: float = 0.707
    yarn_mscale_all_dim: float = 0.707
    max_position_embeddings: int = 8192
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(
                f"vocab_size={self.vocab_size} is too small: a byte-level BPE needs the 256 byte tokens and "
                f"{len(SPECIAL_TOKENS)} special tokens; use at least {256 + len(SPECIAL_TOKENS)}"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")

    def rope_parameters(self) -> dict[str, object]:
        if self.yarn_factor is None:
            return {"rope_type": "default", "rope_theta": self.rope_theta}
        return {"rope_type": "yarn", "rope_theta": self.rope_theta, "factor": self.yarn_factor,
                "original_max_position_embeddings": self.yarn_original_max_position_embeddings,
                "beta_fast": 32, "beta_slow": 1, "mscale": self.yarn_mscale, "mscale_all_dim": self.yarn_mscale_all_dim}


def is_tiny_model_dir(directory: str | Path) -> bool:
    """True when `directory` was written by write_tiny_model (it holds the marker file)."""
    return (Path(directory) / MARKER_FILE).is_file()


def corpus_texts() -> Iterator[str]:
    """The tokenizer's training text: CORPUS_FILES from this interpreter's standard library, in order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in CORPUS_FILES:
        path = stdlib / name
        try:
            yield path.read_text(encoding="utf-8")
        except OSError as err:
            raise FileNotFoundError(
                f"cannot read {path} to train the tiny model's tokenizer ({err}); this Python installation "
                f"lacks standard-library sources: install its full stdlib (e.g. the python3.x package, not a "
                f"minimal one)"
            ) from err


def train_tokenizer(vocab_size: int = 512) -> BpeTokenizer:
    """A byte-level BPE tokenizer trained on corpus_texts(); encodings start with BOS."""
    tokenizer = BpeTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_texts(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tokenizer


def write_tiny_model(
    directory: str | Path,
    seed: int = 0,
    *,
    spec: TinyModelSpec | None = None,
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Writes the tiny model into `directory` (created if needed) and returns its resolved path.

    Refuses a non-empty directory that is not already a tiny model unless force=True; `log` receives progress lines.
    """
    spec = spec or TinyModelSpec()
    return _write(directory, seed, spec, force, log)


def write_tiny_mla_model(
    directory: str | Path,
    seed: int = 0,
    *,
    spec: TinyMlaSpec | None = None,
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Writes the tiny DeepSeek-V2 model (MLA + MoE, random weights from `seed`, the same tokenizer) into `directory`
    and returns its resolved path; the same directory rules as write_tiny_model."""
    spec = spec or TinyMlaSpec()
    return _write(directory, seed, spec, force, log)


def _token_id(tokenizer: BpeTokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"the trained tokenizer has no {token!r} token")
    return token_id


def _write(
    directory: str | Path,
    seed: int,
    spec: TinyModelSpec | TinyMlaSpec,
    force: bool,
    log: Callable[[str], None] | None,
) -> Path:
    say = log or (lambda line: None)
    out = Path(directory).expanduser().resolve()
    _prepare_directory(out, force)

    say(f"training tokenizer (byte-level BPE, vocab {spec.vocab_size}) on {len(CORPUS_FILES)} stdlib files...")
    tokenizer = train_tokenizer(spec.vocab_size)
    vocab_size = tokenizer.get_vocab_size()
    bos_id = _token_id(tokenizer, BOS_TOKEN)
    eos_ids = [_token_id(tokenizer, EOS_TOKEN), _token_id(tokenizer, END_OF_TURN_TOKEN)]
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    })

    mla = isinstance(spec, TinyMlaSpec)
    architecture = "DeepseekV2ForCausalLM" if mla else "LlamaForCausalLM"
    say(f"writing weights ({architecture}, seed {seed})...")
    if isinstance(spec, TinyMlaSpec):
        num_parameters = _write_mla_weights(out, spec, vocab_size, bos_id, eos_ids, seed)
    else:
        num_parameters = _write_weights(out, spec, vocab_size, bos_id, eos_ids, seed)
    _write_json(out / MARKER_FILE, {
        "generator": "dcpserve tiny-model" + (" --mla" if mla else ""),
        "seed": seed,
        "spec": asdict(spec),
        "tokenizer_corpus": [f"<stdlib>/{name}" for name in CORPUS_FILES],
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    })

    say(f"wrote {out}")
    if isinstance(spec, TinyMlaSpec):
        say(
            f"  DeepseekV2ForCausalLM: {num_parameters:,} parameters (float32), {spec.num_hidden_layers} layers, "
            f"hidden {spec.hidden_size}, {spec.num_attention_heads} heads, one latent KV head of {spec.kv_lora_rank} + "
            f"{spec.qk_rope_head_dim}, {spec.n_routed_experts} routed experts ({spec.num_experts_per_tok} per token) "
            f"from layer {spec.first_k_dense_replace}, max_position_embeddings {spec.max_position_embeddings}"
        )
    else:
        say(
            f"  LlamaForCausalLM: {num_parameters:,} parameters (float32), {spec.num_hidden_layers} layers, hidden "
            f"{spec.hidden_size}, {spec.num_attention_heads} heads, {spec.num_key_value_heads} KV head(s), head_dim "
            f"{spec.head_dim}, max_position_embeddings {spec.max_position_embeddings}"
        )
    say(f"  tokenizer: byte-level BPE, {vocab_size} tokens, bos {bos_id}, eos {eos_ids}, chat template")
    return out


def _prepare_directory(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} is a file; pass a directory path for the tiny model")
    if out.is_dir() and any(out.iterdir()):
        if not force and not is_tiny_model_dir(out):
            raise FileExistsError(
                f"{out} is not empty and is not a dcpserve tiny model; pass an empty or new directory, or "
                f"--force (force=True) to overwrite the model files in it"
            )
        for pattern in _LOADER_FILE_PATTERNS:
            for path in out.glob(pattern):
                if path.is_file():
                    path.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _write_weights(out: Path, spec: TinyModelSpec, vocab_size: int, bos_id: int, eos_ids: list[int], seed: int) -> int:
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_ids,
        dtype="float32",
    )
    # The generator is forked so the caller's global RNG state is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]  # transformers' @wraps'd PreTrainedModel.to: mypy binds no self
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    # safetensors directly (not save_pretrained): no progress bar, and metadata fixed to what loaders expect.
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors creates it owner-only; match the other files
    raw = json.loads(config.to_json_string(use_diff=True))
    raw["architectures"] = ["LlamaForCausalLM"]
    raw["torch_dtype"] = "float32"  # the pre-5.0 name of "dtype", for older readers
    _write_json(out / "config.json", raw)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_ids).to_json_file(str(out / "generation_config.json"))
    return sum(t.numel() for t in state.values())


def _write_mla_weights(
    out: Path, spec: TinyMlaSpec, vocab_size: int, bos_id: int, eos_ids: list[int], seed: int
) -> int:
    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, GenerationConfig

    config = DeepseekV2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim,
        n_routed_experts=spec.n_routed_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        n_shared_experts=spec.n_shared_experts,
        moe_intermediate_size=spec.moe_intermediate_size,
        first_k_dense_replace=spec.first_k_dense_replace,
        topk_method=spec.topk_method,
        n_group=spec.n_group,
        topk_group=spec.topk_group,
        routed_scaling_factor=spec.routed_scaling_factor,
        attention_bias=spec.attention_bias,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        initializer_range=spec.initializer_range,
        rope_parameters=spec.rope_parameters(),
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_ids,
        pad_token_id=None,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DeepseekV2ForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]  # transformers' @wraps'd PreTrainedModel.to: mypy binds no self
        with torch.no_grad():  # norms and biases random too, so a load that swaps or drops one shows
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.copy_(1.0 + 0.2 * torch.randn_like(param))
                elif name.endswith("bias"):
                    param.copy_(0.2 * torch.randn_like(param))
    state = _per_expert_tensors({name: t.detach().contiguous() for name, t in model.state_dict().items()})
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    # Every field written (not a diff against transformers' defaults): readers need not know those defaults.
    raw = json.loads(config.to_json_string(use_diff=False))
    raw["architectures"] = ["DeepseekV2ForCausalLM"]
    raw["torch_dtype"] = "float32"
    raw.pop("transformers_version", None)
    _write_json(out / "config.json", raw)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_ids).to_json_file(str(out / "generation_config.json"))
    return sum(t.numel() for t in state.values())


def _per_expert_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers keeps a MoE layer's experts stacked (experts.gate_up_proj [E, 2I, H], gate rows first, and
    experts.down_proj [E, H, I]); checkpoints, DeepSeek's included, hold one tensor per expert and projection."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            for expert, (gate, up) in enumerate(t.chunk(2, dim=0) for t in tensor):
                out[f"{prefix}.{expert}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{expert}.up_proj.weight"] = up.contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for expert, down in enumerate(tensor):
                out[f"{prefix}.{expert}.down_proj.weight"] = down.contiguous()
        else:
            out[name] = tensor
    return out


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
