"""Rotary manas models as Hugging Face's Starcoder2, and back: the same computation under other names and layouts.

Starcoder2ForCausalLM is, layer for layer, manas' rope GPT: pre-LayerNorm with biases, q/k/v/o projections with
biases, grouped-query heads, a c_fc → GELU(tanh) → c_proj MLP, rotary positions, tied embeddings. The layouts that
differ (fused q|k|v, interleaved rotary pairs) are rotary_layout.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.config import GPTConfig
from ..errors import CheckpointError
from . import rotary_layout
from .importing import make_config, typed_field, with_zero_biases

if TYPE_CHECKING:
    import torch


ARCHITECTURE = "Starcoder2ForCausalLM"
MODEL_TYPE = "starcoder2"
# Inside model.layers.N: manas' module names inside blocks.N and Starcoder2's (attention.qkv is split, see below).
BLOCK_MODULES = {
    "ln_attention": "input_layernorm",
    "attention.output": "self_attn.o_proj",
    "ln_ffn": "post_attention_layernorm",
    "ffn.up": "mlp.c_fc",
    "ffn.down": "mlp.c_proj",
}
TOP_MODULES = {"token_embedding": "model.embed_tokens", "final_norm": "model.norm"}
# Hugging Face's hidden_act values that manas computes exactly, as F.gelu's `approximate`.
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


# --- export ----------------------------------------------------------------------------------------------------------


def check_exportable(config: GPTConfig, source: Path) -> None:
    if config.gelu_approximate != "tanh":
        raise CheckpointError(
            f"{source}: the model uses the exact GELU (gelu_approximate={config.gelu_approximate!r}), but Starcoder2's "
            "MLP computes GELU's tanh approximation in vLLM, TGI and llama.cpp, so a rope model exports only with "
            "gelu_approximate='tanh'"
        )


def hf_config(config: GPTConfig, dtype: torch.dtype, end_of_text: int | None) -> dict:
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.block_size,
        "hidden_size": config.n_embd,
        "intermediate_size": 4 * config.n_embd,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "hidden_act": "gelu_pytorch_tanh",
        "norm_epsilon": config.norm_eps,
        # rope_theta is what transformers 4.x, vLLM, TGI and llama.cpp's converter read; rope_parameters is
        # transformers 5's spelling of the same.
        "rope_theta": config.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_base},
        "sliding_window": None,
        "use_bias": True,
        "tie_word_embeddings": True,
        "attention_dropout": config.dropout,
        "residual_dropout": config.dropout,
        "embedding_dropout": config.dropout,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": end_of_text,
        "eos_token_id": end_of_text,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def hf_tensors(config: GPTConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Starcoder2ForCausalLM's tensors, lm_head left out as it is tied; a bias=False model gets zero biases (adding
    zero changes nothing, and llama.cpp's starcoder2 requires every bias)."""
    return rotary_layout.hf_tensors(config, with_zero_biases(config, state), BLOCK_MODULES, TOP_MODULES)


# --- convert ---------------------------------------------------------------------------------------------------------


def state_to_manas(state: dict[str, torch.Tensor], config: GPTConfig, source: Path) -> dict[str, torch.Tensor]:
    """Starcoder2's tensors (without lm_head) under manas' names."""
    return rotary_layout.state_to_manas(state, config, source, BLOCK_MODULES, TOP_MODULES, "Starcoder2")


STARCODER2_SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def config_from_hf(values: dict, source: Path) -> GPTConfig:
    """A Hugging Face Starcoder2 config.json (starcoder2.py maps its tensors), refusing every option whose
    computation differs from manas'."""
    activation = values.get("hidden_act", "gelu_pytorch_tanh")
    if activation not in ACTIVATIONS:
        raise CheckpointError(f"{source}: hidden_act {activation!r} is not supported (only {', '.join(ACTIVATIONS)})")
    # The shape has no sensible default: one missing would be blamed on a field checked against it.
    if missing := [key for key in STARCODER2_SHAPE_FIELDS if key not in values]:
        raise CheckpointError(f"{source}: the Starcoder2 config lacks {', '.join(missing)}")
    rope = values.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{source}: rope_parameters must be an object of rope_type and rope_theta, got {rope!r}")
    field, rope_field = typed_field(values, source), typed_field(rope, source, "rope_parameters.")
    config = make_config(
        source,
        position_encoding="rope",
        vocab_size=field("vocab_size", int, 49152),
        block_size=field("max_position_embeddings", int, 4096),
        n_layer=field("num_hidden_layers", int, 30),
        n_head=field("num_attention_heads", int, 24),
        n_kv_head=field("num_key_value_heads", int, 2),
        n_embd=field("hidden_size", int, 3072),
        # transformers 5 spells it rope_parameters.rope_theta, 4.x (and vLLM, TGI) rope_theta
        rope_base=rope_field("rope_theta", float, field("rope_theta", float, 10000.0)),
        norm_eps=field("norm_epsilon", float, 1e-5),
        dropout=field("residual_dropout", float, 0.0),
        gelu_approximate=ACTIVATIONS[activation],
    )
    window = values.get("sliding_window")
    unsupported = {
        "intermediate_size": values.get("intermediate_size", 12288) != 4 * config.n_embd,
        "use_bias": values.get("use_bias", True) is not True,
        "tie_word_embeddings": values.get("tie_word_embeddings", True) is not True,
        # a window as long as the context masks nothing
        "sliding_window": window is not None and not (type(window) is int and window >= config.block_size),
        "head_dim": values.get("head_dim") not in (None, config.head_size),
        "rope_scaling": values.get("rope_scaling") is not None,
        "rope_parameters": rope.get("rope_type", "default") != "default"
        or not set(rope) <= {"rope_type", "rope_theta"},
    }
    if changed := [name for name, differs in unsupported.items() if differs]:
        name = changed[0]
        shown = f"{name}={values[name]!r}" if name in values else f"{name} (Starcoder2's default)"
        raise CheckpointError(f"{source}: {shown} has no manas equivalent")
    return config
