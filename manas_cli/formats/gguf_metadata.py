"""A GGUF file's metadata (its key-value pairs), read as plain Python values, every length checked against the bytes
the file has before it is read. The gguf package's reader builds numpy views of every item (10 s for Qwen2's
151,936 tokens); this reads a vocabulary in a fraction of a second, and needs no package."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import TokenizerError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # GGUF version 1 had 32-bit counts, and no file in use holds it any more
MAX_KEYS = 1 << 16
MAX_DEPTH = 2  # an array of arrays at most
SCALARS = {  # GGUF value type → struct format
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
STRING, ARRAY = 8, 9
LENGTH = struct.Struct("<Q")  # a string's length
DEFAULT_ALIGNMENT = 32
MAX_DIMENSIONS = 4
MIN_ENTRY_BYTES = 8 + 4 + 4 + 8  # a tensor entry's name length, dimension count, type and offset, at the least


class _Reader:
    """The file's bytes from an offset, each read refused past their end."""

    def __init__(self, data, path: Path) -> None:
        self.data, self.path, self.offset = data, path, 0

    def take(self, size: int) -> memoryview:
        if size < 0 or self.offset + size > len(self.data):
            raise self.truncated()
        view = memoryview(self.data)[self.offset : self.offset + size]
        self.offset += size
        return view

    def truncated(self) -> TokenizerError:
        return TokenizerError(f"{self.path} is not a GGUF file manas can read: it ends inside its metadata")

    def unpack(self, form: str):
        return struct.unpack(form, self.take(struct.calcsize(form)))[0]

    def string(self) -> str:
        raw = bytes(self.take(self.unpack("<Q")))  # a copy: an error's reference to a view would keep the map open
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise TokenizerError(f"{self.path}: a string of its GGUF metadata is not UTF-8") from None

    def strings(self, count: int) -> list[str]:
        """count strings at once, each a u64 length and its bytes: a vocabulary's tokens and merges, some 300,000
        strings, read in one loop rather than by take() and unpack() each (a third of a run's start-up)."""
        data, offset, end, strings = self.data, self.offset, len(self.data), []
        length_at = LENGTH.unpack_from
        try:
            for _ in range(count):
                (length,) = length_at(data, offset)
                offset += 8
                if offset + length > end:
                    raise struct.error("past the end")
                strings.append(str(data[offset : offset + length], "utf-8"))  # a copy, never a view of the map
                offset += length
        except struct.error:
            raise self.truncated() from None
        except UnicodeDecodeError:
            raise TokenizerError(f"{self.path}: a string of its GGUF metadata is not UTF-8") from None
        self.offset = offset
        return strings

    def value(self, kind: int, depth: int = 0):
        if kind in SCALARS:
            return self.unpack(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY and depth < MAX_DEPTH:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if count > len(self.data) - self.offset:  # every item takes a byte at least
                raise TokenizerError(f"{self.path} is not a GGUF file manas can read: an array longer than the file")
            if item in SCALARS:  # read at once: a vocabulary's scores and types
                form = SCALARS[item]
                return list(struct.unpack(f"<{count}{form[1]}", self.take(count * struct.calcsize(form))))
            if item == STRING:
                return self.strings(count)
            return [self.value(item, depth + 1) for _ in range(count)]
        raise TokenizerError(f"{self.path} is not a GGUF file manas can read: a value of unknown type {kind}")


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's entry in the file: its name, dimensions (innermost first, as GGUF lists them), ggml type, and
    offset from the start of the data section."""

    name: str
    dims: tuple[int, ...]
    kind: int
    offset: int


@dataclass(frozen=True)
class Layout:
    fields: dict[str, object]
    tensors: list[TensorInfo]
    data_start: int  # the data section's offset in the file: past the entries, aligned
    alignment: int  # of the data section and of every tensor's offset in it
    size: int  # the file's bytes
    metadata_end: int = 0  # where the key-value pairs end: the bytes before it are the file's whole metadata


def read_metadata(path: Path) -> dict[str, object]:
    """The file's metadata keys and values; one TokenizerError naming the file where it is not a GGUF."""
    return read_layout(path).fields


def read_layout(path: Path) -> Layout:
    """The file's metadata and its tensors' entries, every length checked against the file; one TokenizerError
    naming the file where it is not a GGUF."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return layout_of(data, path)
    except FileNotFoundError:
        raise TokenizerError(f"no GGUF file {path}: no such file") from None
    except TokenizerError:  # a ValueError too: said once, as it is
        raise
    except (OSError, ValueError) as exc:  # an empty file cannot be mapped
        raise TokenizerError(f"{path} is not a GGUF file manas can read: {exc}") from None


def layout_of(data, path: Path) -> Layout:
    """The layout of a GGUF file's bytes (a mapping, or the file read whole), every length checked against them."""
    return _layout(_Reader(data, path))


def _layout(reader: _Reader) -> Layout:
    if bytes(reader.take(4)) != MAGIC:
        raise TokenizerError(f"{reader.path} is not a GGUF file manas can read: it does not begin with GGUF")
    if (version := reader.unpack("<I")) not in VERSIONS:
        raise TokenizerError(f"{reader.path}: GGUF version {version} is not one manas reads (2, 3)")
    count = reader.unpack("<Q")  # the tensors' count: their entries follow the metadata
    keys = reader.unpack("<Q")
    if keys > MAX_KEYS:
        raise TokenizerError(f"{reader.path}: its GGUF metadata claims {keys:,} keys")
    values = {}
    for _ in range(keys):
        key = reader.string()
        values[key] = reader.value(reader.unpack("<I"))
    metadata_end = reader.offset
    if count > (len(reader.data) - reader.offset) // MIN_ENTRY_BYTES:
        raise TokenizerError(f"{reader.path} is not a GGUF file manas can read: {count:,} tensors in a smaller file")
    tensors = [_entry(reader) for _ in range(count)]
    alignment = values.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise TokenizerError(f"{reader.path}: its general.alignment {alignment!r} is not a power of two")
    start = -(-reader.offset // alignment) * alignment
    return Layout(values, tensors, start, alignment, len(reader.data), metadata_end)


def _entry(reader: _Reader) -> TensorInfo:
    name = reader.string()
    dimensions = reader.unpack("<I")
    if dimensions > MAX_DIMENSIONS:
        raise TokenizerError(f"{reader.path}: tensor {name} has {dimensions} dimensions (GGUF allows 4)")
    dims = tuple(reader.unpack("<Q") for _ in range(dimensions))
    return TensorInfo(name, dims, reader.unpack("<I"), reader.unpack("<Q"))
