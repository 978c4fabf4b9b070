"""The tensors of a file convert reads, one at a time: `names`, `shape(name)` and `read(name)`. Each read is a plain
read of that tensor's bytes into memory of its own, never a mapping of the file, so that a converter holds what it
is working on and nothing more (a mapping's pages stay counted in its memory until it is closed). Every extent is
checked against the file before anything is read, and torch is imported only to read: a refusal comes first.
A `Source` is a model to convert (or export) in groups of those tensors, a layer at a time."""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointError, first_line
from .gguf_config import tensor_extent
from .gguf_metadata import Layout, TensorInfo
from .gguf_vocab import import_gguf
from .header import read_safetensors_header

if TYPE_CHECKING:
    import torch

    from ..engine.config import GPTConfig

# safetensors' dtypes convert reads, as (torch's name, bytes): a tensor of another (a complex number) is refused
SAFETENSORS_DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}  # fmt: skip
DEQUANTIZED_ROWS_BYTES = 64 << 20  # a GGUF tensor is dequantized this many bytes of float32 rows at a time


def read_bytes(path: Path, start: int, size: int) -> bytearray:
    """size bytes of the file from start, read into a buffer of their own."""
    data = bytearray(size)
    with open(path, "rb") as f:
        f.seek(start)
        if f.readinto(data) != size:
            raise CheckpointError(f"{path}: the file changed while it was read (it ends before tensor data)")
    return data


class SafetensorsTensors:
    """The tensors of one safetensors file, or of a sharded model's files, by name."""

    def __init__(self, files: Iterable[Path]) -> None:
        self.entries = {}
        for path in files:
            try:
                with open(path, "rb") as f:
                    _, tensors = read_safetensors_header(f, path)
            except OSError as exc:
                raise CheckpointError(f"{path}: not a readable safetensors file ({first_line(exc)})") from None
            for name, entry in tensors.items():
                if entry.dtype not in SAFETENSORS_DTYPES:
                    raise CheckpointError(f"{path}: tensor {name} is {entry.dtype}, not a dtype of weights")
                itemsize = SAFETENSORS_DTYPES[entry.dtype][1]
                if entry.end - entry.start != math.prod(entry.shape) * itemsize:
                    raise CheckpointError(f"{path}: tensor {name}'s bytes do not match its shape {list(entry.shape)}")
                if name in self.entries:  # read as either, it would be whichever came last
                    raise CheckpointError(f"{path}: holds {name}, which {self.entries[name][0].name} holds too")
                self.entries[name] = (path, entry)
        self.names = list(self.entries)

    @classmethod
    def sharded(cls, index: Path) -> SafetensorsTensors:
        """Every shard the index's weight_map names (plain file names in its folder), each holding exactly the
        tensors the index places in it."""
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (OSError, ValueError, RecursionError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a readable JSON index ({first_line(exc)})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must be an object from tensor names to shard file names")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if shard in ("", ".", "..") or Path(shard).name != shard or "\\" in shard:
                raise CheckpointError(f"{index}: weight_map names {shard!r}, which is not a file in {index.parent}")
            if not (index.parent / shard).is_file():
                raise CheckpointError(f"{index}: weight_map names {shard}, which is missing from {index.parent}")
        tensors = cls(index.parent / shard for shard in shards)
        for name, (path, _) in tensors.entries.items():
            if weight_map.get(name) != path.name:
                raise CheckpointError(f"{path}: holds {name}, which weight_map does not place there")
        if missing := sorted(set(weight_map) - set(tensors.entries)):
            raise CheckpointError(
                f"{index}: {missing[0]} is placed in {weight_map[missing[0]]}, which does not hold it"
            )
        return tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1].shape

    def read(self, name: str) -> torch.Tensor:
        import torch

        path, entry = self.entries[name]
        dtype = getattr(torch, SAFETENSORS_DTYPES[entry.dtype][0])
        if not entry.end - entry.start:
            return torch.empty(entry.shape, dtype=dtype)
        return torch.frombuffer(read_bytes(path, entry.start, entry.end - entry.start), dtype=dtype).reshape(
            entry.shape
        )


class GGUFTensors:
    """The tensors of a GGUF file by name, each dequantized to float32 by the gguf package (every type it reads:
    F32, F16, BF16, Q8_0, Q4_0…Q5_1, the K-quants, IQ4_NL…) in the shape PyTorch gives it, each value finite."""

    def __init__(self, path: Path, layout: Layout) -> None:
        gguf = import_gguf("reading a GGUF file's tensors")
        self.path, self.gguf = path, gguf
        self.tensors: dict[str, TensorInfo] = {}
        extents = {}
        for tensor in layout.tensors:
            if tensor.kind not in gguf.GGML_QUANT_SIZES:
                raise CheckpointError(f"{path}: tensor {tensor.name} has an unknown ggml type {tensor.kind}")
            block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(tensor.kind)]
            extents[tensor.name] = tensor_extent(tensor, layout, block, path)
            self.tensors[tensor.name] = tensor
        self.extents = extents
        self.names = list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(reversed(self.tensors[name].dims))

    def read(self, name: str) -> torch.Tensor:
        """The tensor's values as float32, dequantized a slice of rows at a time (the package's temporaries are
        several times the values they make); a value that is not finite (a scale of NaN or infinity) is refused
        here, naming the file and the tensor. The package's numpy warnings about such values stay off the user's
        terminal: the error says it."""
        import numpy as np
        import torch

        tensor, (start, size) = self.tensors[name], self.extents[name]
        kind = self.gguf.GGMLQuantizationType(tensor.kind)
        shape = self.shape(name)
        columns, rows = shape[-1], math.prod(shape[:-1])
        blocks = np.frombuffer(read_bytes(self.path, start, size), dtype=np.uint8).reshape(rows, size // rows)
        values = np.empty((rows, columns), dtype=np.float32)
        step = max(1, DEQUANTIZED_ROWS_BYTES // (4 * columns))
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                for row in range(0, rows, step):
                    part = self.gguf.quants.dequantize(blocks[row : row + step], kind)
                    values[row : row + step] = part.reshape(-1, columns)
        except Exception as exc:  # a type the package cannot dequantize
            raise CheckpointError(
                f"{self.path}: tensor {name} ({kind.name}) cannot be read: {first_line(exc)}"
            ) from None
        if not np.isfinite(values).all():
            raise CheckpointError(
                f"{self.path}: tensor {name} ({kind.name}) holds a value that is not finite (NaN or infinity): the "
                "file is damaged"
            )
        return torch.from_numpy(values.reshape(shape))


class LoadedTensors:
    """Tensors already in memory (a pickle is read whole), under the same three calls."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors, self.names = tensors, list(tensors)

    @classmethod
    def of(cls, loaded: object, source: Path) -> LoadedTensors:
        """A pickle's state dict, refused unless it is one: names to tensors."""
        import torch

        if not isinstance(loaded, dict) or not all(isinstance(t, torch.Tensor) for t in loaded.values()):
            raise CheckpointError(f"{source}: not a state dict of tensors")
        return cls(loaded)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str) -> torch.Tensor:
        return self.tensors.pop(name)  # handed over: the converter's copy is the only one left


class RenamedTensors:
    """Some of another file's tensors under other names (a multimodal checkpoint's language model)."""

    def __init__(self, tensors: SafetensorsTensors, renamed: dict[str, str]) -> None:
        self.tensors, self.renamed, self.names = tensors, renamed, list(renamed)  # renamed: {name here: the file's}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors.shape(self.renamed[name])

    def read(self, name: str) -> torch.Tensor:
        return self.tensors.read(self.renamed[name])


TensorFile = SafetensorsTensors | GGUFTensors | LoadedTensors | RenamedTensors


# A source tensor's layer: Hugging Face's model.layers.N. and transformer.h.N., llama.cpp's blk.N.
LAYER = re.compile(r"(?:^|\.)(?:layers|h|blk)\.(\d+)\.")


def by_layer(names: Iterable[str], layer: re.Pattern, top_together: bool = False) -> list[list[str]]:
    """names in groups: those outside the layers first (each alone, or all together), then each layer's, in layer
    order; `layer` finds a name's layer index."""
    top: list[str] = []
    layers: dict[int, list[str]] = {}
    for name in names:
        match = layer.search(name)
        (layers.setdefault(int(match[1]), []) if match else top).append(name)
    top_groups = [top] if top_together and top else [[name] for name in top]
    return [*top_groups, *(layers[index] for index in sorted(layers))]


@dataclass
class Source:
    """A model to convert, tensor by tensor: its kind, its config, its file's tensors, and how some of them (a
    layer's, or those outside the layers) become manas' tensors and the config they belong to."""

    kind: str
    config: GPTConfig
    tensors: TensorFile
    to_manas: Callable[[dict[str, torch.Tensor], GPTConfig], tuple[GPTConfig, dict[str, torch.Tensor]]]

    def groups(self, meta: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """The tensors outside the layers first (whatever they decide of the config comes before the header is
        written), then each layer's: one group in memory at a time. Those outside the layers come one by one,
        except in a tied model, whose repeated output layer is compared with the token embedding. meta: float32
        tensors of their shapes on the meta device, nothing read."""
        import torch

        def read(name: str) -> torch.Tensor:
            return torch.empty(self.tensors.shape(name), device="meta") if meta else self.tensors.read(name)

        for names in by_layer(self.tensors.names, LAYER, top_together=self.config.tie_embeddings):
            yield {name: read(name) for name in names}
