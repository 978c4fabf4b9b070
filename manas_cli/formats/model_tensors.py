"""A model's tensors under manas' names, a layer at a time: what export writes from, so that it never holds more of
a model than one layer (or one tensor outside the layers). `groups()` gives them as float tensors, `groups(meta=True)`
the same names, shapes and dtypes on the meta device, for a writer to plan its file before reading anything."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import tiktoken
import torch

from ..engine.config import GPTConfig, parameter_shapes, stored_names
from ..torch_engine.quantize import dequantize_stored
from .checkpoint import TORCH_DTYPES
from .header import quantized_matrix, read_checkpoint_header
from .tensor_files import SafetensorsTensors, by_layer
from .tokenizer import build_encoding

if TYPE_CHECKING:
    from .gguf_model import GGUFImport

BLOCK = re.compile(r"^blocks\.(\d+)\.")
TIED_BY_COMPARISON = ("gpt2", "starcoder2")  # llama.cpp architectures whose output layer may repeat the embedding


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
        for names in by_layer(self.shapes, BLOCK):
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


class ImportedTensors:
    """A GGUF file's model, a layer at a time: each group of its tensors dequantized and renamed as convert does."""

    def __init__(self, imported: GGUFImport) -> None:
        source, config = imported.source(), imported.config
        if imported.architecture in TIED_BY_COMPARISON:  # the output layer unties the model only if it differs
            config = imported.to_manas(next(source.groups(), {}), config)[0]
        self.source, self.config, self.dtype = replace(source, config=config), config, torch.float32
        self.encoding = build_encoding(imported.tokenizer_spec)
        self.metadata = {"chat_template": imported.chat_template} if imported.chat_template else {}

    def groups(self, meta: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        for group in self.source.groups(meta):
            yield self.source.to_manas(group, self.config)[1]


def model_tensors(path: Path) -> CheckpointTensors | ImportedTensors:
    """The tensors export writes: a checkpoint's, or a GGUF file's."""
    if path.suffix != ".gguf":
        return CheckpointTensors(path)
    from .gguf_model import read_gguf_import

    return ImportedTensors(read_gguf_import(path))
