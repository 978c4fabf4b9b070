"""The manas checkpoint: one .safetensors file holding weights, config and tokenizer (format documented in FORMAT.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import tiktoken
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from .errors import CheckpointError, TokenizerError
from .files import atomic_write
from .model import GPT, GPTConfig, parameter_shapes
from .tokenizer import build_encoding, parse_spec, vocabulary_size

FORMAT = "manas-gpt"
FORMAT_VERSION = "1"
TIED = "lm_head.weight"  # tied to token_embedding.weight: never stored, tied again on load


@dataclass
class Checkpoint:
    model: GPT
    encoding: tiktoken.Encoding
    tokenizer_spec: dict
    path: Path | None = None


def save_checkpoint(
    path: str | Path, model: GPT, tokenizer_spec: dict, extra_metadata: dict[str, str] | None = None, *,
    overwrite: bool = True,
) -> None:
    """Validate that the tokenizer fits the model, then write the checkpoint atomically (see files.atomic_write)."""
    encoding = build_encoding(tokenizer_spec)
    _check_vocabulary(encoding, model.config, path)
    tensors = {
        name: tensor.detach().to("cpu").contiguous()
        for name, tensor in model.state_dict().items()
        if name != TIED
    }
    metadata = {
        **(extra_metadata or {}),
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "config": json.dumps(model.config.to_dict()),
        "tokenizer": json.dumps(tokenizer_spec),
    }
    # save() to bytes, not save_file(): the latter writes a temporary file of its own beside the target, which a
    # signal can orphan; ours is the only one, and atomic_write removes it.
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(save(tensors, metadata=metadata)), overwrite=overwrite)


# The dtypes a tensor may be stored in, as the safetensors header names them: one rule, in one place, for every
# format version (a quantized format extends this table rather than adding checks elsewhere).
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def expected_dtypes(name: str) -> tuple[str, ...]:
    """The header dtypes tensor `name` may have: every weight is a real floating-point tensor."""
    return FLOAT_DTYPES


@dataclass
class Header:
    """What a checkpoint claims, from its safetensors header alone: no tensor data read."""

    metadata: dict[str, str]
    config: GPTConfig
    tokenizer_spec: dict
    encoding: tiktoken.Encoding
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]


def read_metadata(path: str | Path) -> dict[str, str]:
    """The checkpoint's string metadata, after checking that it is a manas checkpoint of a version we read."""
    path = _existing_file(path)
    try:
        with safe_open(path, framework="pt") as f:
            return _checked_metadata(f, path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise _unreadable(path, exc) from exc


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Checkpoint:
    """Load, check every tensor against the config, tie lm_head, and return the model in eval mode.

    The header and the tensors are read from one open file (a checkpoint replaced meanwhile is not mixed with the
    old one), and every name, shape and dtype is checked against the config before any tensor data is read or the
    model is built: memory is bounded by the file, not by what its config claims."""
    path = _existing_file(path)
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            header = read_header(f, path)
            state = {name: _read_tensor(f, name, path) for name in sorted(header.shapes)}
    except (SafetensorError, OSError, ValueError) as exc:
        raise _unreadable(path, exc) from exc
    # A real (random) init, then overwritten: cheaper than building on the meta device, whose init imports
    # torch._dynamo (over a second of every command's start-up). Its size is now backed by the file's tensors.
    model = GPT(header.config)
    model.load_state_dict(state, strict=False, assign=True)
    model.lm_head.weight = model.token_embedding.weight  # assign=True replaced the tied parameter
    model = model.to(device=device, dtype=dtype).eval()
    return Checkpoint(model, header.encoding, header.tokenizer_spec, path)


def read_header(f, path: Path) -> Header:
    """Metadata, config, tokenizer and tensor shapes and dtypes from an open checkpoint, each checked (see
    FORMAT.md, Reading a checkpoint)."""
    metadata = _checked_metadata(f, path)
    try:
        config = GPTConfig.from_dict(json.loads(metadata["config"]))
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: invalid config: {exc}") from exc
    try:
        spec = parse_spec(metadata.get("tokenizer", "null"))
        encoding = build_encoding(spec)
    except TokenizerError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    _check_vocabulary(encoding, config, path)
    shapes, dtypes = {}, {}
    for name in f.keys():
        info = f.get_slice(name)
        shapes[name], dtypes[name] = tuple(info.get_shape()), info.get_dtype()
    check_tensors(shapes, dtypes, config, path)
    return Header(metadata, config, spec, encoding, shapes, dtypes)


def check_tensors(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str], config: GPTConfig, path: Path) -> None:
    """Every tensor the config needs, with its shape and an allowed dtype, and no other. Walks the config's tensors
    lazily, so a claim of more layers than the file holds stops at the first missing one."""
    seen = set()
    for name, shape in parameter_shapes(config):
        if name not in shapes:
            raise CheckpointError(f"{path}: missing tensor {name} (expected shape {list(shape)})")
        if shapes[name] != shape:
            raise CheckpointError(f"{path}: tensor {name} has shape {list(shapes[name])}, the config needs {list(shape)}")
        if dtypes[name] not in expected_dtypes(name):
            raise CheckpointError(
                f"{path}: tensor {name} is {dtypes[name]}; it must be one of {', '.join(expected_dtypes(name))}"
            )
        seen.add(name)
    if unexpected := sorted(set(shapes) - seen):
        raise CheckpointError(f"{path}: unexpected tensor {unexpected[0]} (not part of this config's model)")


def _read_tensor(f, name: str, path: Path) -> torch.Tensor:
    tensor = f.get_tensor(name)
    if not torch.isfinite(tensor).all():
        raise CheckpointError(f"{path}: tensor {name} holds NaN or infinite values: the weights are corrupt")
    return tensor


def _existing_file(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    return path


def _checked_metadata(f, path: Path) -> dict[str, str]:
    metadata = f.metadata() or {}
    if metadata.get("format") != FORMAT or "config" not in metadata:
        raise CheckpointError(
            f"{path}: not a manas checkpoint (no format/config metadata); "
            "`manas convert` imports nanoGPT and Hugging Face GPT-2 weights"
        )
    if metadata.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: unsupported format_version {metadata.get('format_version')!r} (this manas reads {FORMAT_VERSION})"
        )
    return metadata


def _unreadable(path: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt: {exc})")


def _check_vocabulary(encoding: tiktoken.Encoding, config: GPTConfig, path: str | Path) -> None:
    if vocabulary_size(encoding) > config.vocab_size:
        raise CheckpointError(
            f"{path}: the tokenizer has {vocabulary_size(encoding)} tokens but the model's vocab_size is {config.vocab_size}"
        )
