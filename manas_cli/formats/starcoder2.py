"""Rotary manas models as Hugging Face's Starcoder2, and back: the same computation under other names and layouts.

Starcoder2ForCausalLM is, layer for layer, manas' rope GPT: pre-LayerNorm with biases, q/k/v/o projections with
biases, grouped-query heads, a c_fc → GELU(tanh) → c_proj MLP, rotary positions, tied embeddings. Two layouts differ:
manas fuses q|k|v into one projection, and it rotates each head's interleaved pairs (2i, 2i+1) where Hugging Face
(and llama.cpp's starcoder2, a NEOX rope) rotates the halves (i, i + head_size/2). Permuting the rows of each query
and key head maps one onto the other; attention scores are sums over a head's dimensions, so they are unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..torch_engine.model import GPT, GPTConfig
from .importing import make_config, typed_field

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
QKV = ("q_proj", "k_proj", "v_proj")
QKV_MODULES = {f"self_attn.{name}": name for name in QKV}
# Hugging Face's hidden_act values that manas computes exactly, as F.gelu's `approximate`.
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


# --- the rotary layout ---------------------------------------------------------------------------------------------


def to_rotate_half(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows (or bias entries) from pairs (2i, 2i+1) to halves (i, i + head_size/2): row i of a
    head becomes its old row 2i, row head_size/2 + i its old row 2i+1 (LLaMA's Meta → Hugging Face permutation)."""
    head_size = rows.size(0) // n_heads
    return rows.reshape(n_heads, head_size // 2, 2, -1).transpose(1, 2).reshape(rows.shape)


def from_rotate_half(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of to_rotate_half."""
    head_size = rows.size(0) // n_heads
    return rows.reshape(n_heads, 2, head_size // 2, -1).transpose(1, 2).reshape(rows.shape)


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


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Starcoder2ForCausalLM's tensors, lm_head left out as it is tied; a bias=False model gets zero biases (adding
    zero changes nothing, and llama.cpp's starcoder2 requires every bias)."""
    config = model.config
    state = model.state_dict()
    dtype = model.token_embedding.weight.dtype

    def own_or_zeros(name: str, rows: int) -> torch.Tensor:
        return state[name] if name in state else torch.zeros(rows, dtype=dtype)

    tensors = {f"{TOP_MODULES['token_embedding']}.weight": state["token_embedding.weight"]}
    for kind in ("weight", "bias"):
        tensors[f"{TOP_MODULES['final_norm']}.{kind}"] = own_or_zeros(f"final_norm.{kind}", config.n_embd)
    kv_width = config.n_kv_head * config.head_size
    for i in range(config.n_layer):
        block, layer = f"blocks.{i}", f"model.layers.{i}"
        for module, target in BLOCK_MODULES.items():
            rows = 4 * config.n_embd if module == "ffn.up" else config.n_embd
            tensors[f"{layer}.{target}.weight"] = state[f"{block}.{module}.weight"]
            tensors[f"{layer}.{target}.bias"] = own_or_zeros(f"{block}.{module}.bias", rows)
        for kind in ("weight", "bias"):
            fused = own_or_zeros(f"{block}.attention.qkv.{kind}", config.n_embd + 2 * kv_width)
            q, k, v = fused.split((config.n_embd, kv_width, kv_width))
            parts = (to_rotate_half(q, config.n_head), to_rotate_half(k, config.n_kv_head), v)
            for name, part in zip(QKV, parts):
                tensors[f"{layer}.self_attn.{name}.{kind}"] = part
    return {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}


# --- convert ---------------------------------------------------------------------------------------------------------


def state_to_manas(state: dict[str, torch.Tensor], config: GPTConfig, source: Path) -> dict[str, torch.Tensor]:
    """Starcoder2's tensors (without lm_head) under manas' names, q|k|v fused back in manas' rotary layout. Tensors
    that are missing, extra or misshapen otherwise are left for convert.build_model to name."""
    inverse = {target: module for module, target in BLOCK_MODULES.items()}
    kv_width = config.n_kv_head * config.head_size
    rows = {"q_proj": config.n_embd, "k_proj": kv_width, "v_proj": kv_width}
    renamed: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        module, _, kind = name.rpartition(".")
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module)
        if module in TOP_MODULES.values():
            renamed[f"{_key_of(TOP_MODULES, module)}.{kind}"] = tensor
        elif layer and layer[2] in QKV_MODULES:
            part = QKV_MODULES[layer[2]]
            if tensor.dim() == 0 or tensor.size(0) != rows[part]:
                raise CheckpointError(
                    f"{source}: tensor {name} has shape {list(tensor.shape)}, the config needs {rows[part]} rows"
                )
            if not tensor.is_floating_point():  # fusing would promote bool or int to float without a word
                raise CheckpointError(f"{source}: tensor {name} is {tensor.dtype}, not a real floating-point tensor")
            qkv.setdefault((layer[1], kind), {})[part] = tensor
        elif layer and layer[2] in inverse:
            renamed[f"blocks.{layer[1]}.{inverse[layer[2]]}.{kind}"] = tensor
        else:
            raise CheckpointError(f"{source}: unexpected tensor {name}: not part of a Starcoder2 model")
    for (index, kind), parts in qkv.items():
        if missing := [name for name in QKV if name not in parts]:
            raise CheckpointError(f"{source}: missing tensor model.layers.{index}.self_attn.{missing[0]}.{kind}")
        q, k = from_rotate_half(parts["q_proj"], config.n_head), from_rotate_half(parts["k_proj"], config.n_kv_head)
        try:
            renamed[f"blocks.{index}.attention.qkv.{kind}"] = torch.cat((q, k, parts["v_proj"]))
        except RuntimeError:
            raise CheckpointError(
                f"{source}: q_proj, k_proj and v_proj.{kind} of layer {index} differ in shape"
            ) from None
    return renamed


def _key_of(mapping: dict[str, str], value: str) -> str:
    return next(key for key, item in mapping.items() if item == value)


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
