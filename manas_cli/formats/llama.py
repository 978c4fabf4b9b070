"""Llama-family models as Hugging Face's LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
SmolLM3ForCausalLM and MistralForCausalLM, and back.

The four are one decoder (RMSNorm, rotary positions, grouped-query attention, a SwiGLU MLP) with different defaults:
Qwen2 has biases on q, k, v only; Qwen3 RMS-norms each query and key head before rope (qk_norm); Llama may have
biases on every attention projection (attention_bias) and on the MLP (mlp_bias), and Llama 3.1 and 3.2 scale their
rope's frequencies (rope_type "llama3", as rope_factors); SmolLM3 leaves rope out of some layers (no_rope_layers,
as nope_layers); Mistral may restrict attention to a sliding window, which
manas does not run. Each maps onto a manas config field by field (engine/config.py); the rotary layout is
rotary_layout.py's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.config import GPTConfig, as_float32
from ..errors import CheckpointError
from . import rotary_layout
from .importing import make_config, typed_field

if TYPE_CHECKING:
    import torch


ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
NAMES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "smollm3": "SmolLM3", "mistral": "Mistral"}
BLOCK_MODULES = {
    "ln_attention": "input_layernorm",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "attention.output": "self_attn.o_proj",
    "ln_ffn": "post_attention_layernorm",
    "ffn.gate": "mlp.gate_proj",
    "ffn.up": "mlp.up_proj",
    "ffn.down": "mlp.down_proj",
}
TOP_MODULES = {"token_embedding": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# The rope parameters that mean plain rotary positions (transformers 5 spells them rope_parameters).
PLAIN_ROPE = {"rope_type": "default"}
# Each rope scaling manas runs, by rope_type, with the parameters it reads beside rope_type (and rope_theta).
ROPE_SCALINGS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def config_from_hf(values: dict, source: Path) -> GPTConfig:
    """A Hugging Face Llama, Qwen2, Qwen3, SmolLM3 or Mistral config.json as a manas config, refusing by name every
    option whose computation manas does not run."""
    model_type = values["model_type"]
    if missing := [key for key in SHAPE_FIELDS if key not in values]:
        raise CheckpointError(f"{source}: the {NAMES[model_type]} config lacks {', '.join(missing)}")
    field = typed_field(values, source)
    if (activation := values.get("hidden_act", "silu")) != "silu":
        raise CheckpointError(f"{source}: hidden_act {activation!r} is not supported (only 'silu', SwiGLU's)")
    rope = values.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{source}: rope_parameters must be an object of rope_type and rope_theta, got {rope!r}")
    rope_field = typed_field(rope, source, "rope_parameters.")
    n_head, n_embd = field("num_attention_heads", int), field("hidden_size", int)
    head_dim = None if values.get("head_dim") is None else field("head_dim", int)
    kv_heads = None if values.get("num_key_value_heads") is None else field("num_key_value_heads", int)
    rope_base = rope_field("rope_theta", float, field("rope_theta", float, 10000.0))
    head_size = head_dim or n_embd // max(n_head, 1)
    config = make_config(
        source,
        position_encoding="rope",
        vocab_size=field("vocab_size", int),
        block_size=field("max_position_embeddings", int, 2048),
        n_layer=field("num_hidden_layers", int),
        n_head=n_head,
        n_kv_head=kv_heads,
        n_embd=n_embd,
        rope_base=rope_base,
        norm_eps=field("rms_norm_eps", float, 1e-6),
        dropout=field("attention_dropout", float, 0.0),
        norm="rmsnorm",
        mlp="swiglu",
        ffn_hidden=field("intermediate_size", int),
        # the usual head size is left implicit, as a config written by manas leaves it
        head_dim=None if n_head and head_dim == n_embd / n_head else head_dim,
        tie_embeddings=field("tie_word_embeddings", bool, model_type == "smollm3"),  # each class's default
        qk_norm=model_type == "qwen3",
        rope_factors=rope_factors(_rope_scaling(values, rope, source), head_size, rope_base, source),
        nope_layers=_nope_layers(values, field, source) if model_type == "smollm3" else None,
        **_biases(values, model_type, field, source),
    )
    _refuse_unsupported(values, rope, config, source)
    return config


def _rope_scaling(values: dict, rope: dict, source: Path) -> dict | None:
    """The config's rope scaling (transformers 4's rope_scaling, or 5's rope_parameters), None for plain rope."""
    scaling = values.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = rope
    return checked_scaling(scaling, source)


def checked_scaling(
    scaling: object, source: Path, name: str = "rope_scaling", kinds: tuple[str, ...] = tuple(ROPE_SCALINGS)
) -> dict | None:
    """A rope scaling of one of `kinds`, every parameter one manas reads; None for plain rope."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise CheckpointError(f"{source}: {name} must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return None
    if kind not in kinds:
        raise CheckpointError(
            f"{source}: {name} of rope_type {kind!r} has no manas equivalent (manas runs {', '.join(kinds)})"
        )
    known = {"rope_type", "type", "rope_theta", *ROPE_SCALINGS[kind]}
    if unknown := sorted(set(scaling) - known):
        raise CheckpointError(f"{source}: {name}.{unknown[0]} has no manas equivalent for rope_type {kind!r}")
    return scaling


def rope_factors(scaling: dict | None, head_size: int, base: float, source: Path) -> list[float] | None:
    """Each rope pair's frequency divisor, float32 as llama.cpp's rope_freqs holds them: "linear" divides every
    frequency by `factor`; "llama3" (Llama 3.1, 3.2) the low frequencies by `factor`, the high ones by 1, and blends
    the two between, as transformers' _compute_llama3_parameters and llama.cpp's converter do."""
    if scaling is None or not 0 < base < math.inf:  # a rope_base out of range: the config names it
        return None
    kind, field = scaling.get("rope_type", scaling.get("type")), typed_field(scaling, source, "rope_scaling.")
    factor = field("factor", float)
    if not 0 < factor < math.inf:
        raise CheckpointError(f"{source}: rope_scaling.factor must be positive, got {factor!r}")
    if kind == "linear":
        return [as_float32(factor)] * (head_size // 2)
    low, high = field("low_freq_factor", float), field("high_freq_factor", float)
    original = field("original_max_position_embeddings", int)
    if not (0 < low < high < math.inf and original > 0):
        raise CheckpointError(
            f"{source}: rope_scaling needs 0 < low_freq_factor < high_freq_factor and a positive "
            f"original_max_position_embeddings, got {low!r}, {high!r}, {original!r}"
        )
    factors = []
    for i in range(0, head_size, 2):
        wavelength = 2 * math.pi * base ** (i / head_size)  # of frequency base^(−i/head_size)
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(as_float32(factor))
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(as_float32(1 / ((1 - smooth) / factor + smooth)))
    return factors


def _nope_layers(values: dict, field, source: Path) -> list[int] | None:
    """SmolLM3's layers without rope: where no_rope_layers holds 0 (one 0 or 1 per layer), or, without that list,
    every no_rope_layer_interval-th layer (the 4th, 8th, ...), as transformers' SmolLM3Config derives it."""
    layers = field("num_hidden_layers", int)
    flags = values.get("no_rope_layers")
    if flags is None:
        interval = field("no_rope_layer_interval", int, 4)
        if interval < 1:
            raise CheckpointError(f"{source}: no_rope_layer_interval must be a positive integer, got {interval!r}")
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) != layers or any(flag not in (0, 1) or isinstance(flag, bool)
                                                                  for flag in flags):  # fmt: skip
        raise CheckpointError(
            f"{source}: no_rope_layers must hold one 0 (no rope) or 1 (rope) per layer, {layers}, got {flags!r}"[:300]
        )
    return [i for i, flag in enumerate(flags) if flag == 0] or None


def _biases(values: dict, model_type: str, field, source: Path) -> dict[str, bool]:
    """manas' bias fields: Qwen2's q, k, v biases; Llama's attention_bias (q, k, v and o) with mlp_bias."""
    if model_type == "qwen2":
        return {"bias": False, "qkv_bias": True}
    attention, mlp = field("attention_bias", bool, False), field("mlp_bias", bool, False)
    if attention != mlp:
        raise CheckpointError(
            f"{source}: attention_bias={attention} with mlp_bias={mlp} has no manas equivalent (manas puts biases on "
            "q, k, v only, or on every projection)"
        )
    return {"bias": attention, "qkv_bias": None}


def _refuse_unsupported(values: dict, rope: dict, config: GPTConfig, source: Path) -> None:
    window = values.get("sliding_window")
    sliding = values.get("use_sliding_window", values["model_type"] == "mistral")
    unsupported = {
        # a window as long as the context masks nothing
        "sliding_window": sliding and window is not None and not (type(window) is int and window >= config.block_size),
        "rope_parameters": rope.get("rope_type", "default") == "default"
        and not set(rope) <= {"rope_type", "rope_theta"},
        "pretraining_tp": values.get("pretraining_tp", 1) != 1,
        # transformers 5 names each layer's attention; a sliding one masks what manas' full attention sees
        "layer_types": any(kind != "full_attention" for kind in values.get("layer_types") or ()),
    }
    if changed := [name for name, differs in unsupported.items() if differs]:
        name = changed[0]
        raise CheckpointError(f"{source}: {name}={values.get(name, rope)!r} has no manas equivalent")


def state_to_manas(state: dict[str, torch.Tensor], config: GPTConfig, source: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors under manas' names; a tied model's lm_head, where the file repeats it, must equal the
    token embedding and is dropped."""
    import torch

    head = state.get("lm_head.weight") if config.tie_embeddings else None
    weights = {name: t for name, t in state.items() if not (config.tie_embeddings and name == "lm_head.weight")}
    renamed = rotary_layout.state_to_manas(weights, config, source, BLOCK_MODULES, TOP_MODULES, "Llama-family")
    embedding = renamed.get("token_embedding.weight")
    if head is not None and embedding is not None and not torch.equal(head, embedding):
        raise CheckpointError(
            f"{source}: tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight"
        )
    return renamed


# --- export ----------------------------------------------------------------------------------------------------------


def model_type_of(config: GPTConfig) -> str:
    """Qwen3 for per-head query and key norms, SmolLM3 for layers without rope, Qwen2 for q, k, v biases alone, else
    Llama (whose attention_bias and mlp_bias cover manas' `bias`)."""
    if config.qk_norm:
        return "qwen3"
    if config.nope_layers:
        return "smollm3"
    return "qwen2" if config.has_qkv_bias and not config.bias else "llama"


def check_exportable(config: GPTConfig, source: Path, hf: bool = True) -> None:
    """Refuse what the Hugging Face model (hf) or llama.cpp's twin of it would compute differently."""
    if config.norm != "rmsnorm" or config.mlp != "swiglu" or config.position_encoding != "rope":
        raise CheckpointError(
            f"{source}: a model with norm={config.norm!r}, mlp={config.mlp!r} and {config.position_encoding} "
            "positions is not a Llama-family model; it exports as GPT-2 or Starcoder2 only when it has their block"
        )
    if config.bias and not config.has_qkv_bias:
        raise CheckpointError(f"{source}: biases on the projections but not on q, k, v have no Hugging Face model")
    others = {"post_norms": config.post_norms, "embedding_scale": config.embedding_scale,
              "sliding_window": config.sliding_window, "partial_rotary": config.partial_rotary,
              "rope_scale": config.rope_scale}  # fmt: skip
    if given := [name for name, value in others.items() if value]:
        raise CheckpointError(f"{source}: {given[0]} with a SwiGLU MLP has no Hugging Face or llama.cpp model")
    if config.qk_norm and config.has_qkv_bias:
        raise CheckpointError(f"{source}: query and key norms with biases have no Hugging Face model (Qwen3 has none)")
    if config.nope_layers and (config.qk_norm or config.rope_factors is not None):
        raise CheckpointError(
            f"{source}: layers without rope beside query and key norms or scaled rope have no Hugging Face model "
            "(SmolLM3 has neither)"
        )
    if config.nope_layers and config.has_qkv_bias != config.bias:
        raise CheckpointError(f"{source}: layers without rope with q, k, v biases alone have no Hugging Face model")
    if hf and config.rope_factors is not None and hf_rope_scaling(config) is None:
        raise CheckpointError(
            f"{source}: its rope_factors are not a rope_scaling Hugging Face names (linear, or Llama 3's with "
            "low_freq_factor 1, high_freq_factor 4 and 8,192 positions); `--format gguf` writes them as they are"
        )


# Llama 3.1's and 3.2's rope_scaling, but for its factor (8 and 32)
LLAMA3_SCALING = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}  # fmt: skip


def hf_rope_scaling(config: GPTConfig) -> dict | None:
    """The Hugging Face rope_scaling whose factors are exactly the config's rope_factors: linear's (every factor
    the same) or Llama 3's published parameters, each checked by computing its factors; None if neither is."""
    factors = config.rope_factors
    if factors is None:
        return None
    candidates = [{"rope_type": "linear", "factor": factors[0]}, LLAMA3_SCALING | {"factor": max(factors)}]
    for scaling in candidates:
        if rope_factors(scaling, config.head_size, config.rope_base, Path("export")) == factors:
            return scaling
    return None


def hf_config(config: GPTConfig, dtype: torch.dtype, end_of_text: int | None) -> dict:
    model_type = model_type_of(config)
    values = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        **rotary_layout.hf_shape(config, dtype, end_of_text),
        "hidden_act": "silu",
        "rope_theta": config.rope_base,
        "rope_parameters": (hf_rope_scaling(config) or {"rope_type": "default"}) | {"rope_theta": config.rope_base},
        "rope_scaling": hf_rope_scaling(config),
    }
    if model_type == "llama":
        values |= {"attention_bias": config.bias, "mlp_bias": config.bias, "pretraining_tp": 1}
    elif model_type != "smollm3":
        values |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": config.n_layer}
    if model_type == "qwen3":
        values |= {"attention_bias": False}
    if model_type == "smollm3":
        nope = set(config.nope_layers)
        values |= {
            "attention_bias": config.bias,
            "mlp_bias": config.bias,
            "no_rope_layers": [int(i not in nope) for i in range(config.n_layer)],
            "no_rope_layer_interval": 4,  # read only without the list
            "pad_token_id": None,  # its class's default is an id of SmolLM3's own vocabulary
        }
    return values


def hf_tensors(config: GPTConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Hugging Face model's tensors: q, k, v split in the rotate-half layout, lm_head only when untied."""
    return rotary_layout.hf_tensors(config, state, BLOCK_MODULES, TOP_MODULES)
