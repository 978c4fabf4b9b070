"""Phi-3 and Phi-4-mini (Hugging Face's Phi3ForCausalLM, model_type "phi3") as a manas model, and back.

Phi-3 is a Llama-family decoder whose projections are fused: qkv_proj holds q, k and v, gate_up_proj the gate and
the up projection, split here into manas' names. Phi-4-mini turns only the first three quarters of each head
(`partial_rotary`), and both scale their rope by LongRoPE: each pair's frequency divided by its short factor
(`rope_factors`), and cos and sin multiplied by the attention factor √(1 + ln(s) / ln(original)) (`rope_scale`).

A LongRoPE model runs within its original context (Phi-4-mini's 4,096 of 131,072), where transformers, vLLM and
llama.cpp (at its default context) all turn by the short factors; past it each switches to the long factors in its
own way (transformers for the whole text once it is longer, vLLM per position, llama.cpp by the context asked for),
none of which a cache that equals crop-and-recompute can follow. Phi-3-mini-4k attends over a sliding window in
every layer."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.config import GPTConfig, as_float32
from ..errors import CheckpointError
from . import llama, rotary_layout
from .importing import make_config, typed_field

if TYPE_CHECKING:
    import torch


MODEL_TYPE = "phi3"
ARCHITECTURE = "Phi3ForCausalLM"
ROPE_TYPES = ("default", "longrope", "su")  # "su": LongRoPE's earlier name


def config_from_hf(values: dict, source: Path) -> GPTConfig:
    """A Hugging Face Phi-3 config.json (transformers 4's rope_scaling and partial_rotary_factor, or 5's
    rope_parameters) as a manas config, refusing by name what manas does not run."""
    if missing := [key for key in llama.SHAPE_FIELDS if key not in values]:
        raise CheckpointError(f"{source}: the Phi-3 config lacks {', '.join(missing)}")
    field = typed_field(values, source)
    if (activation := values.get("hidden_act", "silu")) != "silu":
        raise CheckpointError(f"{source}: hidden_act {activation!r} is not supported (only 'silu', SwiGLU's)")
    rope = values.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{source}: rope_parameters must be an object, got {rope!r}")
    scaling = values.get("rope_scaling") or rope
    rope_field = typed_field(rope, source, "rope_parameters.")
    n_head, n_embd = field("num_attention_heads", int), field("hidden_size", int)
    head_size = n_embd // max(n_head, 1)
    partial = rope_field("partial_rotary_factor", float, field("partial_rotary_factor", float, 1.0))
    block_size = field("max_position_embeddings", int, 4096)
    original = field("original_max_position_embeddings", int, block_size)
    factors, scale = _longrope(scaling, int(head_size * partial), block_size, original, source)
    if factors is not None:
        block_size = min(block_size, original)  # LongRoPE's short factors hold within the original context
    window = values.get("sliding_window")
    windowed = window is not None and field("sliding_window", int) < block_size  # a longer one masks nothing
    return make_config(
        source,
        position_encoding="rope",
        vocab_size=field("vocab_size", int),
        block_size=block_size,
        n_layer=field("num_hidden_layers", int),
        n_head=n_head,
        n_kv_head=None if values.get("num_key_value_heads") is None else field("num_key_value_heads", int),
        n_embd=n_embd,
        rope_base=rope_field("rope_theta", float, field("rope_theta", float, 10000.0)),
        norm_eps=field("rms_norm_eps", float, 1e-5),
        dropout=field("attention_dropout", float, 0.0),
        bias=False,
        norm="rmsnorm",
        mlp="swiglu",
        ffn_hidden=field("intermediate_size", int),
        tie_embeddings=field("tie_word_embeddings", bool, False),
        partial_rotary=partial if partial != 1.0 else None,
        rope_factors=factors,
        rope_scale=scale,
        sliding_window=window if windowed else None,
        window_layers=list(range(field("num_hidden_layers", int))) if windowed else None,
    )


def _longrope(scaling: dict, rotary: int, block_size: int, original: int, source: Path):
    """(rope_factors, rope_scale) of a LongRoPE scaling: the short factors and the attention factor, computed from
    the whole context as transformers computes it; (None, None) for plain rope."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise CheckpointError(f"{source}: a rope scaling of type {kind!r} has no manas equivalent for Phi-3")
    if kind == "default":
        return None, None
    factors, pairs = scaling.get("short_factor"), rotary // 2
    if not isinstance(factors, list) or len(factors) != pairs:
        raise CheckpointError(f"{source}: rope_scaling.short_factor must hold {pairs} factors (one per rope pair)")
    field = typed_field({key: value for key, value in scaling.items() if value is not None}, source, "rope_scaling.")
    ratio = field("factor", float, block_size / original)
    attention = field(
        "attention_factor", float, 1.0 if ratio <= 1 else math.sqrt(1 + math.log(ratio) / math.log(original))
    )
    return [as_float32(factor) if isinstance(factor, (int, float)) else factor for factor in factors], attention


def is_fused(state: dict) -> bool:
    """Whether a folder's tensors are Phi-3's, its projections fused."""
    return any(name.endswith(".self_attn.qkv_proj.weight") for name in state)


def state_to_manas(state: dict[str, torch.Tensor], config: GPTConfig, source: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors under manas' names: qkv_proj split into q, k and v, gate_up_proj into gate and up."""
    kv_width = config.n_kv_head * config.head_size
    split: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(".self_attn.qkv_proj.weight"):
            widths = (config.attention_width, kv_width, kv_width)
            parts = _split(tensor, widths, name, source)
            for part, piece in zip(rotary_layout.QKV, parts):
                split[name.replace("qkv_proj", part)] = piece
        elif name.endswith(".mlp.gate_up_proj.weight"):
            gate, up = _split(tensor, (config.ffn_width, config.ffn_width), name, source)
            split[name.replace("gate_up_proj", "gate_proj")], split[name.replace("gate_up_proj", "up_proj")] = gate, up
        else:
            split[name] = tensor
    return llama.state_to_manas(split, config, source)


def _split(tensor: torch.Tensor, widths: tuple[int, ...], name: str, source: Path) -> tuple[torch.Tensor, ...]:
    if tensor.dim() != 2 or tensor.size(0) != sum(widths):
        raise CheckpointError(f"{source}: tensor {name} has shape {list(tensor.shape)}, the config needs "
                              f"{sum(widths)} rows")  # fmt: skip
    return tensor.split(widths)


# --- export ----------------------------------------------------------------------------------------------------------


def is_phi3(config: GPTConfig) -> bool:
    """Whether the config is one only Phi-3's Hugging Face class computes: a partial rotary or LongRoPE's scale."""
    return config.partial_rotary is not None or config.rope_scale is not None


def check_exportable(config: GPTConfig, source: Path) -> None:
    phi3 = {"norm": "rmsnorm", "mlp": "swiglu", "bias": False, "qk_norm": False, "post_norms": False,
            "nope_layers": None, "embedding_scale": None, "local_rope_base": None}  # fmt: skip
    if differs := [name for name, value in phi3.items() if getattr(config, name) != value]:
        raise CheckpointError(f"{source}: a partial rotary or rope_scale with {differs[0]}="
                              f"{getattr(config, differs[0])!r} is not Phi-3's block")  # fmt: skip
    if config.window_layers not in (None, list(range(config.n_layer))):
        raise CheckpointError(
            f"{source}: Phi-3's sliding window is in every layer, not in layers {config.window_layers}"
        )


def hf_config(config: GPTConfig, dtype: torch.dtype, end_of_text: int | None) -> dict:
    """Phi3ForCausalLM's config: LongRoPE's short factors as both of its lists, within a context that is its
    original one, so that the long ones never apply (manas keeps only the short ones)."""
    rope = {
        "rope_type": "default",
        "rope_theta": config.rope_base,
        "partial_rotary_factor": config.partial_rotary or 1.0,
    }
    if config.rope_factors is not None:
        factors = list(config.rope_factors)
        rope |= {
            "rope_type": "longrope",
            "short_factor": factors,
            "long_factor": factors,
            "attention_factor": config.rope_scale or 1.0,
            "original_max_position_embeddings": config.block_size,
        }
    shape = rotary_layout.hf_shape(config, dtype, end_of_text)
    del shape["head_dim"]  # Phi-3 derives it: hidden_size / heads
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        **shape,
        "original_max_position_embeddings": config.block_size,
        "hidden_act": "silu",
        "rope_parameters": rope,
        "sliding_window": config.sliding_window,
        "pad_token_id": None,
    }


def hf_tensors(config: GPTConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Phi3ForCausalLM's tensors: q, k, v fused as qkv_proj (in the rotate-half layout), gate and up as
    gate_up_proj."""
    import torch

    tensors = llama.hf_tensors(config, state)
    for name in [name for name in tensors if name.endswith(".self_attn.q_proj.weight")]:
        parts = [tensors.pop(name.replace("q_proj", part)) for part in rotary_layout.QKV]
        tensors[name.replace("q_proj", "qkv_proj")] = torch.cat(parts)
    for name in [name for name in tensors if name.endswith(".mlp.gate_proj.weight")]:
        gate, up = tensors.pop(name), tensors.pop(name.replace("gate_proj", "up_proj"))
        tensors[name.replace("gate_proj", "gate_up_proj")] = torch.cat((gate, up))
    return tensors
