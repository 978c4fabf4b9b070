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
from .llama import SHAPE_FIELDS, TOP_MODULES, checked_scaling, rope_factors

if TYPE_CHECKING:
    import torch


MODEL_TYPE = "gemma3_text"
ARCHITECTURE = "Gemma3ForCausalLM"
# Gemma 3 4B and up are published as Gemma3ForConditionalGeneration: the language model (text_config) beside a
# vision tower, which manas leaves unread. A saved text_config may list only what differs from transformers'
# Gemma3TextConfig defaults (the published 4B's does), so those fill the rest.
MULTIMODAL_TYPE = "gemma3"
GEMMA3_27B_LAYERS = 62
TEXT_DEFAULTS = {
    "model_type": MODEL_TYPE, "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "max_position_embeddings": 131072, "query_pre_attn_scalar": 256,
}  # fmt: skip
# The language model's tensors in a multimodal checkpoint (transformers 4.50's names, which 5 saves too, and
# 4.52's), under Gemma3ForCausalLM's names; the vision tower's and the projector's are left out.
LANGUAGE_MODEL = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
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


def llama_cpp_scalar(config: GPTConfig) -> float:
    """What llama.cpp scales a model's attention by 1/√ of: its head size, but in a gemma3 file of 62 layers
    (Gemma 3 27B, known to it by its layer count) n_embd / n_head, in integers (models/gemma3.cpp)."""
    return (
        config.n_embd // config.n_head if is_gemma(config) and config.n_layer == GEMMA3_27B_LAYERS else config.head_size
    )


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
    scalar = field("query_pre_attn_scalar", float, head_dim)  # 27B's 168 beside heads of 128; the others' head_dim
    block_size = field("max_position_embeddings", int, 32768)
    window_layers = _window_layers(values, n_layer, source)
    window = field("sliding_window", int, 4096) if window_layers else None
    if window is not None and not 0 < window <= block_size:
        raise CheckpointError(f"{source}: sliding_window {window} is not from 1 to the context ({block_size})")
    rope_base, local_base, scaling = _ropes(values, field, source)
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
        rope_factors=rope_factors(scaling, head_dim, rope_base, source),  # the global layers' (has_local_rope)
        attention_scalar=None if scalar == head_dim else float(scalar),
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


def config_from_multimodal(values: dict, source: Path) -> GPTConfig:
    """A Gemma3ForConditionalGeneration config.json's language model (its text_config over the defaults)."""
    if not isinstance(text := values.get("text_config"), dict):
        raise CheckpointError(f"{source}: a Gemma 3 config (model_type {MULTIMODAL_TYPE!r}) needs a text_config object")
    if text.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise CheckpointError(f"{source}: text_config.model_type is {text['model_type']!r}, not {MODEL_TYPE!r}")
    return config_from_hf(TEXT_DEFAULTS | text, source)


def language_model_names(names: list[str], source: Path) -> dict[str, str]:
    """A multimodal checkpoint's tensor names that the language model holds, by the names Gemma3ForCausalLM gives
    them: {new name: the file's}. Others stay as they are, for the importer to name as unexpected."""
    renamed: dict[str, str] = {}
    for name in names:
        if name.startswith(VISION):
            continue
        prefix = next((prefix for prefix in LANGUAGE_MODEL if name.startswith(prefix)), None)
        new = LANGUAGE_MODEL[prefix] + name[len(prefix) :] if prefix else name
        if new in renamed:  # read as either, it would be whichever came last
            raise CheckpointError(f"{source}: holds {renamed[new]} and {name}, both the language model's {new}")
        renamed[new] = name
    return renamed


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


def _ropes(values: dict, field, source: Path) -> tuple[float, float, dict | None]:
    """(the global layers' rope base, the local ones', the global layers' rope scaling or None): transformers 5's
    rope_parameters by layer type, or 4's rope_theta, rope_local_base_freq and rope_scaling (a GGUF's too). The
    global layers' rope may be scaled linearly (Gemma 3 4B and up: a factor of 8); the local layers' never is, in
    transformers and llama.cpp alike."""
    parameters = values.get("rope_parameters")
    if isinstance(parameters, dict) and {SLIDING, FULL} <= set(parameters):
        full, local = parameters[FULL], parameters[SLIDING]
        scaling = checked_scaling(full, source, f"rope_parameters.{FULL}", ("linear",))
        if not isinstance(local, dict) or local.get("rope_type", "default") != "default":
            raise CheckpointError(f"{source}: rope_parameters.{SLIDING} {local!r} has no manas equivalent (a local "
                                  "layer's rope runs unscaled)")  # fmt: skip
        bases = [typed_field(rope, source, f"rope_parameters.{kind}.")("rope_theta", float)
                 for kind, rope in ((FULL, full), (SLIDING, local))]  # fmt: skip
        return bases[0], bases[1], scaling
    if parameters is not None:
        raise CheckpointError(f"{source}: rope_parameters {parameters!r} has no manas equivalent for Gemma 3 (it "
                              f"names the {FULL!r} and {SLIDING!r} layers' ropes)")  # fmt: skip
    scaling = checked_scaling(values.get("rope_scaling"), source, kinds=("linear",))
    return field("rope_theta", float, 1_000_000.0), field("rope_local_base_freq", float, 10_000.0), scaling


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
    if config.embedding_scale != as_float32(math.sqrt(config.n_embd)) or config.nope_layers:
        raise CheckpointError(f"{source}: Gemma 3 scales its embedding by √n_embd, and has rope in every layer")
    if config.rope_factors is not None and len(set(config.rope_factors)) != 1:
        raise CheckpointError(f"{source}: Gemma 3's global layers' rope scales linearly (one factor for every pair), "
                              "not by rope_factors that differ")  # fmt: skip


def hf_config(config: GPTConfig, dtype: torch.dtype, end_of_text: int | None) -> dict:
    windows = set(config.window_layers or ())
    local = config.local_rope_base or config.rope_base
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        **rotary_layout.hf_shape(config, dtype, end_of_text),
        "query_pre_attn_scalar": _whole(config.attention_scalar or config.head_size),  # transformers 5 wants an int
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": config.rope_base,  # transformers 4's names, and 5's rope_parameters
        "rope_local_base_freq": local,
        "rope_parameters": {
            FULL: {"rope_type": "default", "rope_theta": config.rope_base} | _linear_scaling(config),
            SLIDING: {"rope_type": "default", "rope_theta": local},
        },
        **({"rope_scaling": _linear_scaling(config)} if config.rope_factors else {}),  # transformers 4's
        "sliding_window": config.sliding_window or config.block_size,
        "layer_types": [SLIDING if i in windows else FULL for i in range(config.n_layer)],
        "attention_bias": False,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "pad_token_id": None,
    }


def _whole(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def _linear_scaling(config: GPTConfig) -> dict:
    """The global layers' linear rope scaling, as transformers names it; {} for a plain rope."""
    return {"rope_type": "linear", "factor": config.rope_factors[0]} if config.rope_factors else {}


def hf_tensors(config: GPTConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face's Gemma 3 tensors: q, k, v split in the rotate-half layout, each norm's w back from 1 + w."""
    tensors = rotary_layout.hf_tensors(config, state, BLOCK_MODULES, TOP_MODULES)
    return {name: tensor - 1 if _is_norm(name) else tensor for name, tensor in tensors.items()}
