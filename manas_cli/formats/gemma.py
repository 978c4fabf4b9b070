"""Gemma 3 (text: Hugging Face's Gemma3ForCausalLM, model_type "gemma3_text", Gemma 3 270M and 1B) as a manas
model, and back.

Gemma 3 is a Llama-family decoder with five ideas more, each a manas config field (engine/config.py): GeGLU
(`mlp: "geglu"`, GELU's tanh approximation), the token embedding scaled by √n_embd (`embedding_scale`), a norm on the
attention's and the MLP's outputs (`post_norms`), Qwen3's query and key norms (`qk_norm`), and local layers that
attend over a sliding window with a rope of their own (`sliding_window`, `window_layers`, `local_rope_base`): five
of every six, a window of 512 and a base of 10,000 beside the global layers' 1,000,000. Its RMSNorms scale by
1 + w; manas stores 1 + w, as llama.cpp's converter does, so the engines' RMSNorm runs it unchanged."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.config import GPTConfig, as_float32
from ..errors import CheckpointError
from . import rotary_layout
from .importing import make_config, typed_field
from .llama import SHAPE_FIELDS, TOP_MODULES

if TYPE_CHECKING:
    import torch


MODEL_TYPE = "gemma3_text"
ARCHITECTURE = "Gemma3ForCausalLM"
BLOCK_MODULES = {
    "ln_attention": "input_layernorm",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "attention.output": "self_attn.o_proj",
    "ln_attention_out": "post_attention_layernorm",
    "ln_ffn": "pre_feedforward_layernorm",
    "ffn.gate": "mlp.gate_proj",
    "ffn.up": "mlp.up_proj",
    "ffn.down": "mlp.down_proj",
    "ln_ffn_out": "post_feedforward_layernorm",
}
SLIDING, FULL = "sliding_attention", "full_attention"
WINDOW_PATTERN = 6  # transformers' default _sliding_window_pattern: every sixth layer global
# Options Gemma 3 270M and 1B leave off, whose computation manas does not run
UNSUPPORTED = ("attn_logit_softcapping", "final_logit_softcapping")


def is_gemma(config: GPTConfig) -> bool:
    """Whether the config is Gemma's block (its GeGLU MLP marks it)."""
    return config.mlp == "geglu"


def config_from_hf(values: dict, source: Path) -> GPTConfig:
    """A Hugging Face Gemma 3 text config.json (transformers 4's rope_theta and rope_local_base_freq, or 5's
    rope_parameters per layer type) as a manas config, refusing by name what manas does not run."""
    if missing := [key for key in SHAPE_FIELDS if key not in values]:
        raise CheckpointError(f"{source}: the Gemma 3 config lacks {', '.join(missing)}")
    field = typed_field(values, source)
    if (activation := values.get("hidden_activation", "gelu_pytorch_tanh")) != "gelu_pytorch_tanh":
        raise CheckpointError(f"{source}: hidden_activation {activation!r} is not supported (only 'gelu_pytorch_tanh')")
    for name in UNSUPPORTED:
        if values.get(name) is not None:
            raise CheckpointError(f"{source}: {name}={values[name]!r} has no manas equivalent")
    if values.get("use_bidirectional_attention") or field("attention_bias", bool, False):
        name = "use_bidirectional_attention" if values.get("use_bidirectional_attention") else "attention_bias"
        raise CheckpointError(f"{source}: {name}=true has no manas equivalent")
    n_layer, n_embd, head_dim = field("num_hidden_layers", int), field("hidden_size", int), field("head_dim", int, 256)
    if (scalar := field("query_pre_attn_scalar", float, head_dim)) != head_dim:
        raise CheckpointError(
            f"{source}: query_pre_attn_scalar {scalar!r} differs from head_dim {head_dim}: manas scales attention "
            "by 1/√head_dim (as Gemma 3 270M, 1B and 4B do)"
        )
    block_size = field("max_position_embeddings", int, 32768)
    window_layers = _window_layers(values, n_layer, source)
    window = field("sliding_window", int, 4096) if window_layers else None
    if window is not None and not 0 < window <= block_size:
        raise CheckpointError(f"{source}: sliding_window {window} is not from 1 to the context ({block_size})")
    rope_base, local_base = _rope_bases(values, field, source)
    return make_config(
        source,
        position_encoding="rope",
        vocab_size=field("vocab_size", int),
        block_size=block_size,
        n_layer=n_layer,
        n_head=field("num_attention_heads", int),
        n_kv_head=None if values.get("num_key_value_heads") is None else field("num_key_value_heads", int),
        n_embd=n_embd,
        head_dim=head_dim,
        rope_base=rope_base,
        norm_eps=field("rms_norm_eps", float, 1e-6),
        dropout=field("attention_dropout", float, 0.0),
        bias=False,
        norm="rmsnorm",
        mlp="geglu",
        ffn_hidden=field("intermediate_size", int),
        tie_embeddings=field("tie_word_embeddings", bool, True),
        qk_norm=True,
        embedding_scale=as_float32(math.sqrt(n_embd)) if n_embd > 0 else None,  # a float32, as transformers' buffer
        post_norms=True,
        sliding_window=window if window_layers else None,
        window_layers=window_layers or None,
        local_rope_base=local_base if window_layers else None,
    )


def _window_layers(values: dict, n_layer: int, source: Path) -> list[int]:
    """The layers whose attention slides: layer_types' "sliding_attention" entries, or without it all but every
    _sliding_window_pattern-th layer, as transformers derives them."""
    kinds = values.get("layer_types")
    if kinds is None:
        pattern = values.get("_sliding_window_pattern", values.get("sliding_window_pattern", WINDOW_PATTERN))
        if type(pattern) is not int or pattern < 1:
            raise CheckpointError(f"{source}: _sliding_window_pattern must be a positive integer, got {pattern!r}")
        kinds = [SLIDING if (i + 1) % pattern else FULL for i in range(n_layer)]
    if not isinstance(kinds, list) or len(kinds) != n_layer or any(kind not in (SLIDING, FULL) for kind in kinds):
        raise CheckpointError(
            f"{source}: layer_types must name each of the {n_layer} layers {SLIDING!r} or {FULL!r}, got {kinds!r}"[:300]
        )
    return [i for i, kind in enumerate(kinds) if kind == SLIDING]


def _rope_bases(values: dict, field, source: Path) -> tuple[float, float]:
    """(the global layers' rope base, the local ones'): transformers 5's rope_parameters by layer type, or 4's
    rope_theta and rope_local_base_freq; a scaled rope is refused."""
    parameters = values.get("rope_parameters")
    if isinstance(parameters, dict) and {SLIDING, FULL} <= set(parameters):
        bases = []
        for kind in (FULL, SLIDING):
            rope = parameters[kind]
            if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
                raise CheckpointError(f"{source}: rope_parameters.{kind} {rope!r} has no manas equivalent")
            bases.append(typed_field(rope, source, f"rope_parameters.{kind}.")("rope_theta", float))
        return bases[0], bases[1]
    if parameters is not None or values.get("rope_scaling") is not None:
        raise CheckpointError(f"{source}: rope_scaling {values.get('rope_scaling', parameters)!r} has no manas "
                              "equivalent for Gemma 3 (manas runs its unscaled rope)")  # fmt: skip
    return field("rope_theta", float, 1_000_000.0), field("rope_local_base_freq", float, 10_000.0)


def state_to_manas(state: dict[str, torch.Tensor], config: GPTConfig, source: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors under manas' names, each norm's weight w stored as the 1 + w it scales by."""
    state = {name: tensor + 1 if _is_norm(name) else tensor for name, tensor in state.items()}
    return rotary_layout.state_to_manas(
        {name: t for name, t in state.items() if not (config.tie_embeddings and name == "lm_head.weight")},
        config, source, BLOCK_MODULES, TOP_MODULES, "Gemma 3",
    )  # fmt: skip


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


# --- export ----------------------------------------------------------------------------------------------------------


def check_exportable(config: GPTConfig, source: Path) -> None:
    """Refuse a geglu model that is not Gemma 3's block, which transformers and llama.cpp would compute otherwise."""
    gemma = dict(norm="rmsnorm", position_encoding="rope", qk_norm=True, post_norms=True, bias=False, qkv_bias=None)
    if differs := [name for name, value in gemma.items() if getattr(config, name) != value]:
        raise CheckpointError(f"{source}: a GeGLU model with {differs[0]}={getattr(config, differs[0])!r} is not "
                              "Gemma 3's block, the one GeGLU model manas exports")  # fmt: skip
    if config.embedding_scale != as_float32(math.sqrt(config.n_embd)) or config.nope_layers or config.rope_factors:
        raise CheckpointError(f"{source}: Gemma 3 scales its embedding by √n_embd, and has every layer's rope unscaled")


def hf_config(config: GPTConfig, dtype: torch.dtype, end_of_text: int | None) -> dict:
    windows = set(config.window_layers or ())
    local = config.local_rope_base or config.rope_base
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        **rotary_layout.hf_shape(config, dtype, end_of_text),
        "query_pre_attn_scalar": config.head_size,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": config.rope_base,  # transformers 4's names, and 5's rope_parameters
        "rope_local_base_freq": local,
        "rope_parameters": {
            FULL: {"rope_type": "default", "rope_theta": config.rope_base},
            SLIDING: {"rope_type": "default", "rope_theta": local},
        },
        "sliding_window": config.sliding_window or config.block_size,
        "layer_types": [SLIDING if i in windows else FULL for i in range(config.n_layer)],
        "attention_bias": False,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "pad_token_id": None,
    }


def hf_tensors(config: GPTConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face's Gemma 3 tensors: q, k, v split in the rotate-half layout, each norm's w back from 1 + w."""
    tensors = rotary_layout.hf_tensors(config, state, BLOCK_MODULES, TOP_MODULES)
    return {name: tensor - 1 if _is_norm(name) else tensor for name, tensor in tensors.items()}
