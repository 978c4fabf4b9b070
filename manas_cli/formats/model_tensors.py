"""A model's tensors under manas' names, a layer at a time: what export writes from, so that it never holds more of
a model than one layer (or one tensor outside the layers). `groups()` gives them as float tensors, `groups(meta=True)`
the same names, shapes and dtypes on the meta device, for a writer to plan its file before reading anything."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import tiktoken
import torch

from ..engine.config import GPTConfig, parameter_shapes, stored_names
from ..torch_engine.quantize import dequantize_stored
from .checkpoint import TORCH_DTYPES, stored_state
from .header import Checkpoint, quantized_matrix, read_checkpoint_header
from .tensor_files import SafetensorsTensors
from .tokenizer import build_encoding

if TYPE_CHECKING:
    from .gguf_model import GGUFImport

BLOCK = re.compile(r"^blocks\.(\d+)\.")
TIED_BY_COMPARISON = ("gpt2", "starcoder2")  # llama.cpp architectures whose output layer may repeat the embedding


def by_layer(names: Iterable[str]) -> list[list[str]]:
    """manas names in groups: each one outside the blocks alone, then each block's together, in block order."""
    top, layers = [], {}
    for name in names:
        match = BLOCK.match(name)
        if match:
            layers.setdefault(int(match[1]), []).append(name)
        else:
            top.append([name])
    return [*top, *(layers[index] for index in sorted(layers))]


class CheckpointTensors:
    """A manas checkpoint's float model (parameter_shapes' tensors), read by plain reads from the file, its quantized
    matrices dequantized to float32 as the loader dequantizes them."""

    def __init__(self, path: Path) -> None:
        header = read_checkpoint_header(path)
        self.config: GPTConfig = header.config
        self.encoding: tiktoken.Encoding = header.encoding
        self.metadata: dict[str, str] = header.metadata
        self.kind, self.entries, self.stored = header.quantization, header.tensors, SafetensorsTensors([path])
        self.shapes = dict(parameter_shapes(self.config))
        self.dtype = self._dtype("token_embedding.weight")

    def groups(self, meta: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        for names in by_layer(self.shapes):
            yield {name: self._tensor(name, meta) for name in names}

    def _dequantized(self, name: str) -> bool:
        return bool(self.kind) and quantized_matrix(self.config, name, self.shapes[name])

    def _dtype(self, name: str) -> torch.dtype:
        return torch.float32 if self._dequantized(name) else TORCH_DTYPES[self.entries[name].dtype]

    def _tensor(self, name: str, meta: bool) -> torch.Tensor:
        if meta:
            return torch.empty(self.shapes[name], dtype=self._dtype(name), device="meta")
        if not self._dequantized(name):
            return self.stored.read(name)
        module = name.removesuffix(".weight")
        stored = {f"{module}.{suffix}": self.stored.read(f"{module}.{suffix}") for suffix in stored_names(self.kind)}
        return dequantize_stored(stored, module, self.kind)


class LoadedTensors:
    """A float model read whole (a gpt2 or starcoder2 GGUF file, whose repeated output layer decides the config
    only once compared with the embedding), under the same calls."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        model = checkpoint.model
        self.config, self.encoding, self.metadata = model.config, checkpoint.encoding, checkpoint.metadata or {}
        self.state, self.dtype = stored_state(model, None), model.token_embedding.weight.dtype

    def groups(self, meta: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        for names in by_layer(self.state):
            yield {name: self.state[name].to("meta") if meta else self.state[name].detach() for name in names}


class ImportedTensors:
    """A GGUF file's model, a layer at a time: each group of its tensors dequantized and renamed as convert does."""

    def __init__(self, imported: GGUFImport) -> None:
        from .convert import gguf_source

        self.source, self.config, self.dtype = gguf_source(imported), imported.config, torch.float32
        self.encoding = build_encoding(imported.tokenizer_spec)
        self.metadata = {"chat_template": imported.chat_template} if imported.chat_template else {}

    def groups(self, meta: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        for group in self.source.groups(meta):
            yield self.source.to_manas(group, self.config)[1]


def model_tensors(path: Path) -> CheckpointTensors | ImportedTensors | LoadedTensors:
    """The tensors export writes: a checkpoint's, or a GGUF file's (a gpt2 or starcoder2 one read whole)."""
    if path.suffix != ".gguf":
        return CheckpointTensors(path)
    from .gguf_model import load_gguf_checkpoint, read_gguf_import

    imported = read_gguf_import(path)
    if imported.architecture in TIED_BY_COMPARISON:
        return LoadedTensors(load_gguf_checkpoint(path))
    return ImportedTensors(imported)
