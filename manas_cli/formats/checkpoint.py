"""The manas checkpoint: one .safetensors file holding weights, config and tokenizer (its format: FORMAT.md)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save

from ..engine.config import INT4_GROUP_SIZE, GPTConfig, stored_names
from ..files import atomic_write
from ..torch_engine.model import GPT
from ..torch_engine.quantize import QuantizedLinear, dequantize_stored, load_quantized, quantizable, quantization
from .header import (
    FORMAT,
    TIED,
    Checkpoint,
    MappedCheckpoint,
    check_vocabulary,
    companion_name,
    format_version,
    not_finite,
    open_checkpoint,
)
from .tokenizer import build_encoding

TORCH_DTYPES = {
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
}


def save_checkpoint(
    path: str | Path,
    model: GPT,
    tokenizer_spec: dict,
    extra_metadata: dict[str, str] | None = None,
    *,
    overwrite: bool = True,
) -> None:
    """Validate that the tokenizer fits the model, then write the checkpoint atomically (see files.atomic_write)."""
    encoding = build_encoding(tokenizer_spec)
    check_vocabulary(encoding, model.config, path)
    kind = quantization(model)
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in stored_state(model, kind).items()}
    check_finite_tensors(tensors, path)
    if kind:
        check_finite(model, path)
    group_size = model.lm_head.group_size if kind == "int4" else INT4_GROUP_SIZE
    metadata = checkpoint_metadata(model.config, tokenizer_spec, kind, extra_metadata or {}, group_size)
    # save() to bytes, not save_file(): the latter writes a temporary file of its own beside the target, which a
    # signal can orphan; ours is the only one, and atomic_write removes it.
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(save(tensors, metadata=metadata)), overwrite=overwrite)


def checkpoint_metadata(
    config: GPTConfig, tokenizer_spec: dict, kind: str | None, extra: dict[str, str], group_size: int = INT4_GROUP_SIZE
) -> dict:
    """The string metadata of a checkpoint of this config (FORMAT.md), after the caller's own entries; an int4
    file's group size."""
    return {
        **extra,
        "format": FORMAT,
        "format_version": format_version(config, kind),
        **({"quantization": kind} if kind else {}),
        **({"group_size": str(group_size)} if kind == "int4" else {}),
        "config": json.dumps(config.to_dict()),
        "tokenizer": json.dumps(tokenizer_spec),
    }


def stored_state(model: GPT, kind: str | None) -> dict[str, torch.Tensor]:
    """The model's tensors by their stored names. A tied lm_head is left out of a float file; a quantized one stores
    it in the token embedding's place (it is that matrix, quantized), and no float copy of it. An untied output
    layer is stored under its own name."""
    state = model.state_dict()
    if not model.config.tie_embeddings:
        return state
    if not kind:
        del state[TIED]
        return state
    del state["token_embedding.weight"]
    return {name.replace("lm_head.", "token_embedding.", 1): tensor for name, tensor in state.items()}


def load_checkpoint(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> Checkpoint:
    """Load, check every tensor against the config, tie lm_head, and return the model in eval mode.

    The tensors are the mapped file's bytes (header.open_checkpoint: checked before any is touched, so memory is
    bounded by the file, not by what its config claims), copied only by a cast to another dtype or device."""
    mapped = open_checkpoint(path)
    path, header = mapped.path, mapped.header
    state = {name: mapped_tensor(mapped, name) for name in sorted(header.tensors)}
    # A real (random) init, then overwritten: cheaper than building on the meta device, whose init imports
    # torch._dynamo (over a second of every command's start-up). Its size is now backed by the file's tensors.
    model = GPT(header.config)
    tied = header.config.tie_embeddings
    quantized = _split_quantized(state, header.quantization, tied) if header.quantization else {}
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.token_embedding.weight  # assign=True replaced the tied parameter
    model = model.to(device=device, dtype=dtype).eval()
    if quantized:  # after the cast: it would cast the scales too
        load_quantized(model, quantized, header.quantization)
    check_finite(model, path)
    return Checkpoint(model, header.encoding, header.tokenizer_spec, path, header.metadata)


def _split_quantized(state: dict[str, torch.Tensor], kind: str, tied: bool) -> dict[str, torch.Tensor]:
    """Take a quantized file's matrices and their scales (and zeros) out of `state`, by module name (a tied model's
    stored token embedding is the output layer), and leave the tied token embedding as its dequantized rows."""
    quantized = {}
    for name in [name for name, tensor in state.items() if tensor.dtype in (torch.int8, torch.uint8)]:
        module = "lm_head." if name == "token_embedding.weight" else name.removesuffix("weight")
        for suffix in stored_names(kind):
            quantized[module + suffix] = state.pop(companion_name(name, suffix))
    if tied:
        state["token_embedding.weight"] = dequantize_stored(quantized, "lm_head", kind)
    return quantized


def mapped_tensor(mapped: MappedCheckpoint, name: str) -> torch.Tensor:
    """A tensor over the mapped file's bytes (little-endian, as safetensors stores them); copied when they are not
    aligned to the dtype, as torch's kernels assume."""
    entry, data = mapped.header.tensors[name], mapped.data(name)
    dtype = TORCH_DTYPES[entry.dtype]
    if not data.nbytes:
        return torch.empty(entry.shape, dtype=dtype)
    return torch.frombuffer(data if mapped.aligned(name) else bytearray(data), dtype=dtype).reshape(entry.shape)


def check_finite(model: GPT, path: Path | str) -> None:
    """Every weight finite as the model will compute with it, checked after the cast to the run's dtype (1e300 is
    finite in a float64 file and infinite as float32) and dequantized (an int8 row's largest code times its scale)."""
    # A quantized file's embedding is its output layer's rows dequantized: name the stored tensor at fault first.
    tied = model.config.tie_embeddings
    for name, tensor in sorted(model.state_dict().items(), key=lambda item: item[0] == "token_embedding.weight"):
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            stored = name.replace("lm_head.", "token_embedding.", 1) if tied else name
            raise not_finite(path, stored, dtype_name(tensor.dtype))
    for name in quantizable(model):
        layer = model.get_submodule(name)
        if isinstance(layer, QuantizedLinear) and (overflowing := layer.overflowing_tensor()):
            stored = "token_embedding" if name == "lm_head" and model.config.tie_embeddings else name
            raise not_finite(path, f"{stored}.{overflowing}", "float32")


def check_finite_tensors(tensors: dict[str, torch.Tensor], path: Path | str) -> None:
    """What a writer checks before writing, so that what the loader refuses is never written: every floating-point
    tensor finite as stored, and as the float32 that readers compute in (1e300 in float64 is not)."""
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            continue
        for dtype in dict.fromkeys((tensor.dtype, torch.float32)):  # once for a float32 tensor
            if not torch.isfinite(tensor.to(dtype)).all():
                raise not_finite(path, name, dtype_name(dtype))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
