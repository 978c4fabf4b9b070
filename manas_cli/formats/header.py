"""Reading a manas checkpoint without torch: its safetensors header, checked against FORMAT.md, and the file
mapped in memory, so that either engine takes its tensors from the page cache without a copy (a second process
running the same model shares those pages)."""

from __future__ import annotations

import json
import math
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import tiktoken

from ..engine.config import INT4_GROUP_SIZE, QUANTIZATIONS, GPTConfig, parameter_shapes, stored_names
from ..errors import CheckpointError, TokenizerError, first_line
from .tokenizer import build_encoding, parse_spec, vocabulary_size

FORMAT = "manas-gpt"
FORMAT_VERSION = "1"
QUANTIZED_FORMAT_VERSION = "2"  # format 1 with quantized matrices (FORMAT.md, "Version 2: quantized weights")
FAMILY_FORMAT_VERSION = "3"  # Llama-family configs, float or quantized (FORMAT.md, "Version 3")
VERSIONS = (FORMAT_VERSION, QUANTIZED_FORMAT_VERSION, FAMILY_FORMAT_VERSION)
TIED = "lm_head.weight"  # tied to token_embedding.weight: never stored, tied again on load


def companion_name(weight_name: str, suffix: str) -> str:
    """A stored quantized matrix's scales or zeros: `blocks.0.ffn.up.weight` → `blocks.0.ffn.up.scales`."""
    return weight_name.removesuffix("weight") + suffix


# The dtypes a tensor may be stored in, by the name the safetensors header gives them: one rule, in one place, for
# every format version.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
CODE_DTYPES = {"int8": ("I8",), "int4": ("U8",)}
ITEMSIZES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1}


def format_version(config: GPTConfig, kind: str | None) -> str:
    """The earliest version that describes such a file: GPT-2's block keeps versions 1 and 2, which older readers
    read; a Llama-family field needs 3."""
    if not config.is_gpt2_family:
        return FAMILY_FORMAT_VERSION
    return QUANTIZED_FORMAT_VERSION if kind else FORMAT_VERSION


def quantized_matrix(config: GPTConfig, name: str, shape: tuple[int, ...]) -> bool:
    """Whether a quantized file stores this tensor quantized: every matrix the model multiplies by, so every 2-D
    tensor but the position table and an untied token embedding (looked up, never multiplied)."""
    looked_up = name == "position_embedding.weight" or (name == "token_embedding.weight" and not config.tie_embeddings)
    return len(shape) == 2 and not looked_up


def stored_tensors(
    config: GPTConfig, kind: str | None = None, group_size: int = INT4_GROUP_SIZE
) -> Iterator[tuple[str, tuple[int, ...], tuple[str, ...]]]:
    """Name, shape and allowed dtypes of every tensor a checkpoint of this config holds, lazily. Format 2 stores
    each matrix the model multiplies by (quantized_matrix) quantized: int8 (rows, cols)
    and one scale per row, or int4 codes two to a byte (rows, cols/2) and a scale and a zero per group."""
    for name, shape in parameter_shapes(config):
        if kind is None or not quantized_matrix(config, name, shape):
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

    @property
    def nbytes(self) -> int:
        """The bytes its shape and dtype imply (read_safetensors_header admits only dtypes in ITEMSIZES' terms
        through check_tensors)."""
        return math.prod(self.shape) * ITEMSIZES[self.dtype]


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
        """ "int8" or "int4" for a quantized file (version 2, or 3 with a quantization), else None."""
        version = self.metadata["format_version"]
        return self.metadata.get("quantization") if version != FORMAT_VERSION else None

    @property
    def group_size(self) -> int:
        return int(self.metadata.get("group_size", INT4_GROUP_SIZE))


def read_metadata(path: str | Path) -> dict[str, str]:
    """The checkpoint's string metadata, after checking that it is a manas checkpoint of a version we read."""
    path = _existing_file(path)
    with _open(path) as f:
        return _checked_metadata(read_safetensors_header(f, path)[0], path)


def read_checkpoint_header(path: str | Path) -> Header:
    """A checkpoint's header, every part checked, without mapping its data."""
    path = _existing_file(path)
    with _open(path) as f:
        return read_header(f, path)


def read_header(f: BinaryIO, path: Path) -> Header:
    """Metadata, config, tokenizer and tensor entries of an open checkpoint, each checked (see FORMAT.md, Reading a
    checkpoint)."""
    metadata, tensors = read_safetensors_header(f, path)
    metadata = _checked_metadata(metadata, path)
    try:
        config = GPTConfig.from_dict(json.loads(metadata["config"]))
    except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep to parse
        raise CheckpointError(f"{path}: invalid config: {first_line(exc)}") from None
    if (metadata["format_version"] == FAMILY_FORMAT_VERSION) == config.is_gpt2_family:
        raise CheckpointError(
            f"{path}: format_version {metadata['format_version']} with "
            + (
                "a GPT-2 block's config: version 3 is for Llama-family configs"
                if config.is_gpt2_family
                else "Llama-family config fields (norm, mlp, ffn_hidden, head_dim, tie_embeddings, qkv_bias) needs "
                "format_version 3"
            )
        )
    if metadata["format_version"] != FORMAT_VERSION and metadata.get("quantization") == "int4":
        _check_group_size(metadata.get("group_size"), config, path)
    try:
        spec = parse_spec(metadata.get("tokenizer", "null"))
        encoding = build_encoding(spec)
    except TokenizerError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    check_vocabulary(encoding, config, path)
    header = Header(metadata, config, spec, encoding, tensors)
    check_tensors(tensors, stored_tensors(config, header.quantization, header.group_size), path)
    return header


def read_safetensors_header(f: BinaryIO, path: Path) -> tuple[dict[str, str], dict[str, TensorEntry]]:
    """The string metadata and the tensor entries of an open safetensors file (an 8-byte little-endian length, a
    JSON header, the data), every byte range checked to lie inside the file."""
    size = os.fstat(f.fileno()).st_size
    prefix = f.read(8)
    length = int.from_bytes(prefix, "little")
    if is_pytorch_file(prefix) and f.read(1) != b"{":  # a header of 640 bytes starts 80 02 too, then its JSON
        raise CheckpointError(
            f"{path}: this is a PyTorch checkpoint, not a manas one: convert it first with "
            f"manas convert {path} --out model.safetensors"
        )
    if len(prefix) < 8 or length > size - 8:
        raise _unreadable(path, f"the header length {length} exceeds the file's {size} bytes")
    f.seek(8)
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
            valid = (
                isinstance(dtype, str)
                and all(_is_count(n) for n in (*shape, begin, end))
                and begin <= end <= size - data_start
            )
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


def check_tensors(
    tensors: dict[str, TensorEntry], expected: Iterator[tuple[str, tuple[int, ...], tuple[str, ...]]], path: Path
) -> None:
    """Every expected tensor (stored_tensors), with its shape and an allowed dtype, and no other. Walks the expected
    tensors lazily, so a config's claim of more layers than the file holds stops at the first missing one."""
    seen = set()
    for name, shape, allowed in expected:
        if name not in tensors:
            raise CheckpointError(f"{path}: missing tensor {name} (expected shape {list(shape)})")
        entry = tensors[name]
        if entry.shape != shape:
            raise CheckpointError(
                f"{path}: tensor {name} has shape {list(entry.shape)}, the config needs {list(shape)}"
            )
        if entry.dtype not in allowed:
            raise CheckpointError(f"{path}: tensor {name} is {entry.dtype}; it must be {_dtype_rule(allowed)}")
        if entry.end - entry.start != (nbytes := entry.nbytes):
            raise _unreadable(
                path, f"tensor {name} has {entry.end - entry.start} bytes of data, its shape needs {nbytes}"
            )
        seen.add(name)
    if unexpected := sorted(set(tensors) - seen):
        raise CheckpointError(f"{path}: unexpected tensor {unexpected[0]} (not part of this config's model)")


def not_finite(path: Path | str, name: str, dtype: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: tensor {name} holds NaN or infinite values as {dtype} (a value beyond "
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
    if version not in VERSIONS:
        raise CheckpointError(
            f"{path}: unsupported format_version {version!r} (this manas reads {FORMAT_VERSION}, "
            f"{QUANTIZED_FORMAT_VERSION} with int8 or int4 weights, and {FAMILY_FORMAT_VERSION} for Llama-family "
            "models)"
        )
    quantization = metadata.get("quantization")
    if version == FAMILY_FORMAT_VERSION and quantization is not None and quantization not in QUANTIZATIONS:
        raise CheckpointError(
            f"{path}: format_version {version} with quantization {quantization!r}: "
            f"this manas reads {' or '.join(map(repr, QUANTIZATIONS))}, or no quantization key for float weights"
        )
    if version == QUANTIZED_FORMAT_VERSION and quantization not in QUANTIZATIONS:
        raise CheckpointError(
            f"{path}: format_version {version} with quantization {metadata.get('quantization')!r}: "
            f"this manas reads {' or '.join(map(repr, QUANTIZATIONS))}"
        )
    return metadata


def _check_group_size(value: str | None, config: GPTConfig, path: Path) -> None:
    """An int4 file's group_size: an even count (two codes a byte) that divides every row (n_embd, the MLP's and
    the heads' widths long)."""
    widths = tuple(config.row_widths.values())
    if not (
        isinstance(value, str)
        and value.isascii()
        and value.isdigit()
        and len(value) <= 9
        and int(value) > 0
        and all(width % int(value) == 0 for width in widths)
        and int(value) % 2 == 0
    ):
        raise CheckpointError(
            f"{path}: int4 group_size {value!r} must be an even count that divides the rows "
            f"({', '.join(map(str, sorted(set(widths))))} values)"
        )


def _dtype_rule(allowed: tuple[str, ...]) -> str:
    for kind, codes in CODE_DTYPES.items():
        if allowed == codes:
            return f"{kind} codes ({codes[0]}) in an {kind} checkpoint"
    return f"floating point ({', '.join(allowed)})"


def is_pytorch_file(prefix: bytes) -> bool:
    """Whether a file's first bytes are torch.save's: a zip archive (since torch 1.6), or a pickle (protocol 2 to 5,
    the legacy format). A safetensors file's little-endian header length may start so (640 bytes is 80 02), but its
    JSON header then follows at byte 8."""
    return prefix.startswith(b"PK\x03\x04") or (len(prefix) >= 2 and prefix[0] == 0x80 and 2 <= prefix[1] <= 5)


def _unreadable(path: Path, reason: str) -> CheckpointError:
    return CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt: {reason})")


def check_vocabulary(encoding: tiktoken.Encoding, config: GPTConfig, path: str | Path) -> None:
    if vocabulary_size(encoding) > config.vocab_size:
        raise CheckpointError(
            (
                f"{path}: the tokenizer has {vocabulary_size(encoding)} tokens but the model's vocab_size is "
                f"{config.vocab_size}"
            )
        )


@dataclass
class Checkpoint:
    model: object  # a torch GPT, or the native engine's NativeGPT
    encoding: tiktoken.Encoding
    tokenizer_spec: dict
    path: Path | None = None
    metadata: dict[str, str] | None = None  # the file's string metadata, read with its tensors


class MappedCheckpoint:
    """A checked header and its file's bytes: mapped copy-on-write, each tensor's bytes in place (a process that
    writes to them, as training does, changes only its own copy of those pages, never the file), or, for a file of
    up to READ_WHOLE_BYTES, read into memory."""

    def __init__(self, path: Path, header: Header, mapping: mmap.mmap) -> None:
        if len(mapping) < max((entry.end for entry in header.tensors.values()), default=0):
            raise CheckpointError(f"{path}: the file changed while it was read (it is shorter than its header says)")
        self.path, self.header, self.mapping = path, header, mapping

    def data(self, name: str) -> memoryview:
        """The bytes of tensor `name`: as many as its shape and dtype need (check_tensors saw to it)."""
        entry = self.header.tensors[name]
        return memoryview(self.mapping)[entry.start : entry.end]

    def aligned(self, name: str) -> bool:
        """Whether the tensor's data starts on a multiple of its item size, as typed loads need (safetensors'
        own writer aligns them; another may not)."""
        entry = self.header.tensors[name]
        return entry.start % ITEMSIZES[entry.dtype] == 0


def open_checkpoint(path: str | Path) -> MappedCheckpoint:
    """Read and check a checkpoint's header, then map the file: every name, shape and dtype is checked against the
    config before any tensor data is touched, and the header and the data come from one open file (a checkpoint
    replaced meanwhile is never mixed with the old one)."""
    path = _existing_file(path)
    with _open(path) as f:
        header = read_header(f, path)
        mapping = map_whole(f, os.fstat(f.fileno()).st_size, path)
    return MappedCheckpoint(path, header, mapping)


def map_whole(f: BinaryIO, size: int, path: Path) -> mmap.mmap | bytearray:
    """An open file's bytes, mapped copy-on-write, or read into memory up to READ_WHOLE_BYTES (see there)."""
    try:
        return (
            _read_whole(f, size, path)
            if size <= READ_WHOLE_BYTES
            else mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        )
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot map it into memory ({first_line(exc)})") from None


# A file up to this size is read into memory rather than mapped: a mapped file that another program truncates or
# rewrites in place (`cp` over it) kills the process that maps it with SIGBUS at the next page it touches, while a
# read costs a few milliseconds at this size. Larger files stay mapped (FORMAT.md, "Reading a checkpoint").
READ_WHOLE_BYTES = 256 << 20


def _read_whole(f: BinaryIO, size: int, path: Path) -> bytearray:
    data = bytearray(size)
    with memoryview(data) as view:
        done = 0
        while done < size and (count := os.preadv(f.fileno(), [view[done:]], done)):
            done += count
    if done != size:
        raise CheckpointError(f"{path}: the file changed while it was read (it is shorter than it was)")
    return data
