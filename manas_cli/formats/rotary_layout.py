"""What every rotary model from Hugging Face shares with manas' (Starcoder2, Llama, Qwen2, Mistral): the same
attention under other names and layouts. manas fuses q|k|v into one projection, and it rotates each head's
interleaved pairs (2i, 2i+1) where Hugging Face (and llama.cpp's NEOX rope) rotates the halves (i, i + head_size/2).
Permuting the rows of each query and key head maps one onto the other; attention scores are sums over a head's
dimensions, so they are unchanged."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.config import GPTConfig
from ..errors import CheckpointError

if TYPE_CHECKING:
    import torch


QKV = ("q_proj", "k_proj", "v_proj")
QKV_MODULES = {f"self_attn.{name}": name for name in QKV}  # inside model.layers.N
# manas' per-head query and key norms (Qwen3): one weight per head dimension, laid out as the heads it scales
HEAD_NORMS = ("attention.q_norm", "attention.k_norm")
# The Hugging Face tensors a converter permutes between rotate-half and interleaved rope pairs
QUERY_KEY_TENSORS = ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")


def to_rotate_half(rows: torch.Tensor, n_heads: int, rotary: int | None = None) -> torch.Tensor:
    """Reorder each head's first `rotary` rows (or bias entries; all of them by default) from pairs (2i, 2i+1) to
    halves (i, i + rotary/2): row i of a head becomes its old row 2i, row rotary/2 + i its old row 2i+1 (LLaMA's
    Meta → Hugging Face permutation); the rows past `rotary` (a partial rotary's, Phi-3's) stay."""
    return _permuted(rows, n_heads, rotary, lambda turned, n, half: turned.reshape(n, half, 2, -1).transpose(1, 2))


def from_rotate_half(rows: torch.Tensor, n_heads: int, rotary: int | None = None) -> torch.Tensor:
    """The inverse of to_rotate_half."""
    return _permuted(rows, n_heads, rotary, lambda turned, n, half: turned.reshape(n, 2, half, -1).transpose(1, 2))


def _permuted(rows: torch.Tensor, n_heads: int, rotary: int | None, permute) -> torch.Tensor:
    import torch

    head_size = rows.size(0) // n_heads
    rotary = rotary or head_size
    heads = rows.reshape(n_heads, head_size, -1)
    turned = permute(heads[:, :rotary], n_heads, rotary // 2).reshape(n_heads, rotary, -1)
    return torch.cat((turned, heads[:, rotary:]), 1).reshape(rows.shape)


def split_qkv(fused: torch.Tensor, config: GPTConfig) -> dict[str, torch.Tensor]:
    """manas' fused q|k|v weight (or bias) as Hugging Face's q_proj, k_proj, v_proj, in its rotate-half layout."""
    kv_width = config.n_kv_head * config.head_size
    q, k, v = fused.split((config.attention_width, kv_width, kv_width))
    rotary = config.rotary_dims
    return dict(zip(QKV, (to_rotate_half(q, config.n_head, rotary), to_rotate_half(k, config.n_kv_head, rotary), v)))


def state_to_manas(
    state: dict[str, torch.Tensor],
    config: GPTConfig,
    source: Path,
    block_modules: dict[str, str],
    top_modules: dict[str, str],
    architecture: str,
) -> dict[str, torch.Tensor]:
    """A Hugging Face rotary model's tensors under manas' names, q|k|v fused back in manas' rotary layout.
    block_modules: manas' module names inside blocks.N → theirs inside model.layers.N; top_modules: the rest.
    Tensors that are missing, extra or misshapen otherwise are left for importing.build_model to name."""
    import torch

    inverse = {target: module for module, target in block_modules.items()}
    kv_width = config.n_kv_head * config.head_size
    rows = {"q_proj": config.attention_width, "k_proj": kv_width, "v_proj": kv_width}
    renamed: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        module, _, kind = name.rpartition(".")
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module)
        if module in top_modules.values():
            renamed[f"{_key_of(top_modules, module)}.{kind}"] = tensor
        elif layer and layer[2] in QKV_MODULES:
            part = QKV_MODULES[layer[2]]
            if tensor.dim() == 0 or tensor.size(0) != rows[part]:
                raise CheckpointError(
                    f"{source}: tensor {name} has shape {list(tensor.shape)}, the config needs {rows[part]} rows"
                )
            if not tensor.is_floating_point():  # fusing would promote bool or int to float without a word
                raise CheckpointError(f"{source}: tensor {name} is {tensor.dtype}, not a real floating-point tensor")
            qkv.setdefault((layer[1], kind), {})[part] = tensor
        elif layer and layer[2] in inverse and inverse[layer[2]] in HEAD_NORMS:
            renamed[f"blocks.{layer[1]}.{inverse[layer[2]]}.{kind}"] = from_rotate_half(tensor, 1, config.rotary_dims)
        elif layer and layer[2] in inverse:
            renamed[f"blocks.{layer[1]}.{inverse[layer[2]]}.{kind}"] = tensor
        else:
            raise CheckpointError(f"{source}: unexpected tensor {name}: not part of a {architecture} model")
    for (index, kind), parts in qkv.items():
        if missing := [name for name in QKV if name not in parts]:
            raise CheckpointError(f"{source}: missing tensor model.layers.{index}.self_attn.{missing[0]}.{kind}")
        q = from_rotate_half(parts["q_proj"], config.n_head, config.rotary_dims)
        k = from_rotate_half(parts["k_proj"], config.n_kv_head, config.rotary_dims)
        try:
            renamed[f"blocks.{index}.attention.qkv.{kind}"] = torch.cat((q, k, parts["v_proj"]))
        except RuntimeError:
            raise CheckpointError(
                f"{source}: q_proj, k_proj and v_proj.{kind} of layer {index} differ in shape"
            ) from None
    return renamed


def hf_tensors(
    config: GPTConfig, state: dict[str, torch.Tensor], block_modules: dict[str, str], top_modules: dict[str, str]
) -> dict[str, torch.Tensor]:
    """Some of a rotary model's tensors (a layer's, or some of those outside the layers) under Hugging Face's names
    (state_to_manas' inverse): q, k, v split in the rotate-half layout, the head norms too, lm_head only when
    untied. Shapes alone on the meta device, as export plans its file."""
    tensors = {}
    for name, tensor in state.items():
        module, _, kind = name.rpartition(".")
        parts = module.split(".", 2)
        if module == "lm_head" and config.tie_embeddings:
            continue
        if module in top_modules:
            tensors[f"{top_modules[module]}.{kind}"] = tensor
        elif parts[2] == "attention.qkv":
            for part, split in split_qkv(tensor, config).items():
                tensors[f"model.layers.{parts[1]}.self_attn.{part}.{kind}"] = split
        else:
            tensor = to_rotate_half(tensor, 1, config.rotary_dims) if parts[2] in HEAD_NORMS else tensor  # as a head
            tensors[f"model.layers.{parts[1]}.{block_modules[parts[2]]}.{kind}"] = tensor
    return {name: t.detach().contiguous() for name, t in tensors.items()}


def hf_shape(config: GPTConfig, dtype: torch.dtype, end_of_text: int | None) -> dict:
    """The config.json fields every rotary Hugging Face model of manas' heads shares: its shape, dtype and ids."""
    return {
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.block_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.ffn_width,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_size,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": config.dropout,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": end_of_text,
        "eos_token_id": end_of_text,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _key_of(mapping: dict[str, str], value: str) -> str:
    return next(key for key, item in mapping.items() if item == value)
