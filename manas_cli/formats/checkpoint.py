"""The manas checkpoint: one .safetensors file holding weights, config and tokenizer (format documented in FORMAT.md)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import tiktoken
import torch
from safetensors.torch import save

from ..engine.model import GPT, GPTConfig, parameter_shapes
from ..errors import CheckpointError, TokenizerError, first_line
from ..files import atomic_write
from ..engine.quantize import (
    INT4_GROUP_SIZE, QUANTIZATIONS, QuantizedLinear, dequantize_stored, load_quantized, quantizable, quantization,
    stored_names,
)
from .tokenizer import build_encoding, parse_spec, vocabulary_size

FORMAT = "manas-gpt"
FORMAT_VERSION = "1"
QUANTIZED_FORMAT_VERSION = "2"  # format 1 with quantized matrices (FORMAT.md, "Version 2: quantized weights")
TIED = "lm_head.weight"  # tied to token_embedding.weight: never stored, tied again on load


@dataclass
class Checkpoint:
    model: GPT
    encoding: tiktoken.Encoding
    tokenizer_spec: dict
    path: Path | None = None
    metadata: dict[str, str] | None = None  # the file's string metadata, read with its tensors


def save_checkpoint(
    path: str | Path, model: GPT, tokenizer_spec: dict, extra_metadata: dict[str, str] | None = None, *,
    overwrite: bool = True,
) -> None:
    """Validate that the tokenizer fits the model, then write the checkpoint atomically (see files.atomic_write)."""
    encoding = build_encoding(tokenizer_spec)
    _check_vocabulary(encoding, model.config, path)
    kind = quantization(model)
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in stored_state(model, kind).items()}
    check_finite_tensors(tensors, path)
    if kind:
        check_finite(model, path)
    metadata = {
        **(extra_metadata or {}),
        "format": FORMAT,
        "format_version": QUANTIZED_FORMAT_VERSION if kind else FORMAT_VERSION,
        **({"quantization": kind} if kind else {}),
        **({"group_size": str(model.lm_head.group_size)} if kind == "int4" else {}),
        "config": json.dumps(model.config.to_dict()),
        "tokenizer": json.dumps(tokenizer_spec),
    }
    # save() to bytes, not save_file(): the latter writes a temporary file of its own beside the target, which a
    # signal can orphan; ours is the only one, and atomic_write removes it.
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(save(tensors, metadata=metadata)), overwrite=overwrite)


def stored_state(model: GPT, kind: str | None) -> dict[str, torch.Tensor]:
    """The model's tensors by their stored names. Format 1 leaves out the tied lm_head; format 2 stores the
    quantized output layer in the token embedding's place (it is that matrix, quantized), and no float copy of it."""
    state = model.state_dict()
    if not kind:
        del state[TIED]
        return state
    del state["token_embedding.weight"]
    return {name.replace("lm_head.", "token_embedding.", 1): tensor for name, tensor in state.items()}


def companion_name(weight_name: str, suffix: str) -> str:
    """A stored quantized matrix's scales or zeros: `blocks.0.ffn.up.weight` → `blocks.0.ffn.up.scales`."""
    return weight_name.removesuffix("weight") + suffix


# The dtypes a tensor may be stored in, by the name the safetensors header gives them: one rule, in one place, for
# every format version.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
CODE_DTYPES = {"int8": ("I8",), "int4": ("U8",)}
TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
                "I8": torch.int8, "U8": torch.uint8}


def stored_tensors(config: GPTConfig, kind: str | None = None,
                   group_size: int = INT4_GROUP_SIZE) -> Iterator[tuple[str, tuple[int, ...], tuple[str, ...]]]:
    """Name, shape and allowed dtypes of every tensor a checkpoint of this config holds, lazily. Format 2 stores
    each matrix the model multiplies by (every 2-D tensor but the position table) quantized: int8 (rows, cols)
    and one scale per row, or int4 codes two to a byte (rows, cols/2) and a scale and a zero per group."""
    for name, shape in parameter_shapes(config):
        if kind is None or len(shape) != 2 or name == "position_embedding.weight":
            yield name, shape, FLOAT_DTYPES
        elif kind == "int8":
            yield name, shape, CODE_DTYPES[kind]
            yield companion_name(name, "scales"), shape[:1], FLOAT_DTYPES
        else:
            rows, columns = shape
            yield name, (rows, columns // 2), CODE_DTYPES[kind]
            for suffix in stored_names(kind)[1:]:
                yield companion_name(name, suffix), (rows, columns // group_size), FLOAT_DTYPES


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header: its dtype name, shape and absolute byte range in the file."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass
class Header:
    """What a checkpoint claims, from its safetensors header alone: no tensor data read."""

    metadata: dict[str, str]
    config: GPTConfig
    tokenizer_spec: dict
    encoding: tiktoken.Encoding
    tensors: dict[str, TensorEntry]

    @property
    def quantization(self) -> str | None:
        """"int8" or "int4" for a version-2 file, else None."""
        return self.metadata["quantization"] if self.metadata["format_version"] == QUANTIZED_FORMAT_VERSION else None

    @property
    def group_size(self) -> int:
        return int(self.metadata.get("group_size", INT4_GROUP_SIZE))


def read_metadata(path: str | Path) -> dict[str, str]:
    """The checkpoint's string metadata, after checking that it is a manas checkpoint of a version we read."""
    path = _existing_file(path)
    with _open(path) as f:
        return _checked_metadata(read_safetensors_header(f, path)[0], path)


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Checkpoint:
    """Load, check every tensor against the config, tie lm_head, and return the model in eval mode.

    The header and the tensors are read from one open file (a checkpoint replaced meanwhile is never mixed with the
    old one), and every name, shape and dtype is checked against the config before any tensor data is read or the
    model is built: memory is bounded by the file, not by what its config claims."""
    path = _existing_file(path)
    with _open(path) as f:
        header = read_header(f, path)
        state = {name: _read_tensor(f, name, entry, path) for name, entry in sorted(header.tensors.items())}
    # A real (random) init, then overwritten: cheaper than building on the meta device, whose init imports
    # torch._dynamo (over a second of every command's start-up). Its size is now backed by the file's tensors.
    model = GPT(header.config)
    quantized = _split_quantized(state, header.quantization) if header.quantization else {}
    model.load_state_dict(state, strict=False, assign=True)
    model.lm_head.weight = model.token_embedding.weight  # assign=True replaced the tied parameter
    model = model.to(device=device, dtype=dtype).eval()
    if quantized:  # after the cast: it would cast the scales too
        load_quantized(model, quantized, header.quantization)
    check_finite(model, path)
    return Checkpoint(model, header.encoding, header.tokenizer_spec, path, header.metadata)


def _split_quantized(state: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """Take a version-2 file's quantized matrices and their scales (and zeros) out of `state`, by module name (the
    stored token embedding is the output layer), and leave the token embedding as its dequantized rows."""
    quantized = {}
    for name in [name for name, tensor in state.items() if tensor.dtype in (torch.int8, torch.uint8)]:
        module = "lm_head." if name == "token_embedding.weight" else name.removesuffix("weight")
        for suffix in stored_names(kind):
            quantized[module + suffix] = state.pop(companion_name(name, suffix))
    state["token_embedding.weight"] = dequantize_stored(quantized, "lm_head", kind)
    return quantized


def read_header(f: BinaryIO, path: Path) -> Header:
    """Metadata, config, tokenizer and tensor entries of an open checkpoint, each checked (see FORMAT.md, Reading a
    checkpoint)."""
    metadata, tensors = read_safetensors_header(f, path)
    metadata = _checked_metadata(metadata, path)
    try:
        config = GPTConfig.from_dict(json.loads(metadata["config"]))
    except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep to parse
        raise CheckpointError(f"{path}: invalid config: {first_line(exc)}") from None
    if metadata["format_version"] == QUANTIZED_FORMAT_VERSION and metadata["quantization"] == "int4":
        _check_group_size(metadata.get("group_size"), config.n_embd, path)
    try:
        spec = parse_spec(metadata.get("tokenizer", "null"))
        encoding = build_encoding(spec)
    except TokenizerError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    _check_vocabulary(encoding, config, path)
    header = Header(metadata, config, spec, encoding, tensors)
    check_tensors(tensors, stored_tensors(config, header.quantization, header.group_size), path)
    return header


def read_safetensors_header(f: BinaryIO, path: Path) -> tuple[dict[str, str], dict[str, TensorEntry]]:
    """The string metadata and the tensor entries of an open safetensors file (an 8-byte little-endian length, a
    JSON header, the data), every byte range checked to lie inside the file."""
    size = os.fstat(f.fileno()).st_size
    prefix = f.read(8)
    length = int.from_bytes(prefix, "little")
    if is_pytorch_file(prefix):
        raise CheckpointError(f"{path}: this is a PyTorch checkpoint, not a manas one: convert it first with "
                              f"manas convert {path} --out model.safetensors")
    if len(prefix) < 8 or length > size - 8:
        raise _unreadable(path, f"the header length {length} exceeds the file's {size} bytes")
    try:
        header = json.loads(f.read(length))
    except (ValueError, RecursionError) as exc:  # not UTF-8 or JSON, too deep, or an integer of 5,000 digits
        raise _unreadable(path, f"the header is not JSON that can be read: {first_line(exc)}") from None
    metadata = header.pop("__metadata__", None) if isinstance(header, dict) else None
    if not isinstance(header, dict) or not isinstance(metadata or {}, dict):
        raise _unreadable(path, "the header is not a JSON object of tensors")
    for key, value in (metadata or {}).items():
        if not isinstance(value, str):
            raise _unreadable(path, f"the metadata entry {key!r} is a {type(value).__name__}, not a string")
    data_start, tensors = 8 + length, {}
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            valid = isinstance(dtype, str) and all(_is_count(n) for n in (*shape, begin, end)) and begin <= end <= size - data_start
        except (TypeError, KeyError, ValueError):
            valid = False
        if not valid:
            raise _unreadable(path, f"the header entry of tensor {name} is malformed or lies outside the file")
        tensors[name] = TensorEntry(dtype, shape, data_start + begin, data_start + end)
    _refuse_overlaps(tensors, path)
    return metadata or {}, tensors


def _refuse_overlaps(tensors: dict[str, TensorEntry], path: Path) -> None:
    """Each byte of data belongs to one tensor at most: two ranges that overlap would read one's bytes as the other."""
    filled = sorted((entry.start, entry.end, name) for name, entry in tensors.items() if entry.end > entry.start)
    for (_, end, name), (start, _, next_name) in zip(filled, filled[1:]):
        if start < end:
            raise _unreadable(path, f"the data of tensors {name} and {next_name} overlap")


def check_tensors(tensors: dict[str, TensorEntry], expected: Iterator[tuple[str, tuple[int, ...], tuple[str, ...]]],
                  path: Path) -> None:
    """Every expected tensor (stored_tensors), with its shape and an allowed dtype, and no other. Walks the expected
    tensors lazily, so a config's claim of more layers than the file holds stops at the first missing one."""
    seen = set()
    for name, shape, allowed in expected:
        if name not in tensors:
            raise CheckpointError(f"{path}: missing tensor {name} (expected shape {list(shape)})")
        entry = tensors[name]
        if entry.shape != shape:
            raise CheckpointError(f"{path}: tensor {name} has shape {list(entry.shape)}, the config needs {list(shape)}")
        if entry.dtype not in allowed:
            raise CheckpointError(f"{path}: tensor {name} is {entry.dtype}; it must be {_dtype_rule(allowed)}")
        seen.add(name)
    if unexpected := sorted(set(tensors) - seen):
        raise CheckpointError(f"{path}: unexpected tensor {unexpected[0]} (not part of this config's model)")


def _read_tensor(f: BinaryIO, name: str, entry: TensorEntry, path: Path) -> torch.Tensor:
    """A checked entry's data (little-endian, as safetensors stores it), which must be finite."""
    dtype = TORCH_DTYPES[entry.dtype]
    nbytes = math.prod(entry.shape) * dtype.itemsize
    if entry.end - entry.start != nbytes:
        raise _unreadable(path, f"tensor {name} has {entry.end - entry.start} bytes of data, its shape needs {nbytes}")
    data = bytearray(nbytes)
    f.seek(entry.start)
    if f.readinto(data) != nbytes:
        raise _unreadable(path, f"tensor {name}'s data ends early")
    return torch.frombuffer(data, dtype=dtype).reshape(entry.shape) if nbytes else torch.empty(entry.shape, dtype=dtype)


def check_finite(model: GPT, path: Path | str) -> None:
    """Every weight finite as the model will compute with it, checked after the cast to the run's dtype (1e300 is
    finite in a float64 file and infinite as float32) and dequantized (an int8 row's largest code times its scale)."""
    # A quantized file's embedding is its output layer's rows dequantized: name the stored tensor at fault first.
    for name, tensor in sorted(model.state_dict().items(), key=lambda item: item[0] == "token_embedding.weight"):
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise _not_finite(path, name.replace("lm_head.", "token_embedding.", 1), tensor.dtype)
    for name in quantizable(model):
        layer = model.get_submodule(name)
        if isinstance(layer, QuantizedLinear) and (overflowing := layer.overflowing_tensor()):
            stored = "token_embedding" if name == "lm_head" else name  # format 2 stores the output layer there
            raise _not_finite(path, f"{stored}.{overflowing}", torch.float32)


def check_finite_tensors(tensors: dict[str, torch.Tensor], path: Path | str) -> None:
    """What a writer checks before writing, so that what the loader refuses is never written: every floating-point
    tensor finite as stored, and as the float32 that readers compute in (1e300 in float64 is not)."""
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            continue
        for dtype in dict.fromkeys((tensor.dtype, torch.float32)):  # once for a float32 tensor
            if not torch.isfinite(tensor.to(dtype)).all():
                raise _not_finite(path, name, dtype)


def _not_finite(path: Path | str, name: str, dtype: torch.dtype) -> CheckpointError:
    return CheckpointError(
        f"{path}: tensor {name} holds NaN or infinite values as {str(dtype).removeprefix('torch.')} (a value beyond "
        "that type's range becomes infinite): the weights are corrupt"
    )


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@contextmanager
def _open(path: Path) -> Iterator[BinaryIO]:
    try:
        with open(path, "rb") as f:
            yield f
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it ({exc.strerror})") from None


def _existing_file(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    return path


def _checked_metadata(metadata: dict, path: Path) -> dict[str, str]:
    if metadata.get("format") != FORMAT or "config" not in metadata:
        raise CheckpointError(
            f"{path}: not a manas checkpoint (no format/config metadata); "
            "`manas convert` imports nanoGPT and Hugging Face GPT-2 weights"
        )
    version = metadata.get("format_version")
    if version not in (FORMAT_VERSION, QUANTIZED_FORMAT_VERSION):
        raise CheckpointError(
            f"{path}: unsupported format_version {version!r} "
            f"(this manas reads {FORMAT_VERSION}, and {QUANTIZED_FORMAT_VERSION} with int8 or int4 weights)"
        )
    if version == QUANTIZED_FORMAT_VERSION and metadata.get("quantization") not in QUANTIZATIONS:
        raise CheckpointError(
            f"{path}: format_version {version} with quantization {metadata.get('quantization')!r}: "
            f"this manas reads {' or '.join(map(repr, QUANTIZATIONS))}"
        )
    return metadata


def _check_group_size(value: str | None, n_embd: int, path: Path) -> None:
    """An int4 file's group_size: an even count (two codes a byte) that divides every row (n_embd or 4 n_embd long)."""
    if not (isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 9 and int(value) > 0
            and n_embd % int(value) == 0 and int(value) % 2 == 0):
        raise CheckpointError(
            f"{path}: int4 group_size {value!r} must be an even count that divides the rows (n_embd {n_embd})"
        )



def _dtype_rule(allowed: tuple[str, ...]) -> str:
    for kind, codes in CODE_DTYPES.items():
        if allowed == codes:
            return f"{kind} codes ({codes[0]}) in an {kind} checkpoint"
    return f"floating point ({', '.join(allowed)})"


def is_pytorch_file(prefix: bytes) -> bool:
    """Whether a file's first bytes are torch.save's: a zip archive (since torch 1.6), or a pickle (protocol 2 to 5,
    the legacy format). A safetensors header length never starts so: it would be petabytes."""
    return prefix.startswith(b"PK\x03\x04") or (len(prefix) >= 2 and prefix[0] == 0x80 and 2 <= prefix[1] <= 5)


def _unreadable(path: Path, reason: str) -> CheckpointError:
    return CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt: {reason})")


def _check_vocabulary(encoding: tiktoken.Encoding, config: GPTConfig, path: str | Path) -> None:
    if vocabulary_size(encoding) > config.vocab_size:
        raise CheckpointError(
            f"{path}: the tokenizer has {vocabulary_size(encoding)} tokens but the model's vocab_size is {config.vocab_size}"
        )
