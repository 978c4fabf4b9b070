"""A manas checkpoint written tensor by tensor, so that converting a model never holds more than the tensors in hand:
the safetensors header first (every name, shape, dtype and offset follows from the config and the quantization),
then each tensor at its place as it comes, checked as save_checkpoint checks a whole model's. The file is a
temporary one (files.atomic_write publishes it), complete only when every tensor the config names is in it."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import torch

from ..engine.config import GPTConfig, parameter_shapes
from ..errors import CheckpointError
from ..torch_engine.quantize import (
    COMPUTE_DTYPE,
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    quantize_groups,
    quantize_rows,
)
from .checkpoint import dtype_name
from .header import FLOAT_DTYPES, ITEMSIZES, not_finite, quantized_matrix, stored_tensors

SAFETENSORS_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                     torch.int8: "I8", torch.uint8: "U8"}  # fmt: skip
FLOAT_ROWS_BYTES = 16 << 20  # a float tensor is cast and written this many bytes of float32 rows at a time


class SafetensorsWriter:
    """A safetensors file written into `file` (opened for writing, empty) a tensor, or a slice of rows of one, at a
    time: the header first, from every tensor's (name, shape, dtype name), then each one's bytes at its place. The
    data is contiguous, the widest items first, so that each tensor starts aligned to its item size."""

    def __init__(self, file: BinaryIO, entries: list[tuple[str, tuple[int, ...], str]], metadata: dict) -> None:
        self.file = file
        entries = sorted(entries, key=lambda entry: -ITEMSIZES[entry[2]])  # stable: the caller's order otherwise
        header, self.places, offset = {"__metadata__": metadata}, {}, 0
        for name, shape, dtype in entries:
            size = math.prod(shape) * ITEMSIZES[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.places[name] = (offset, dtype)
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors' own padding: the data starts 8-byte aligned
        file.write(len(text).to_bytes(8, "little") + text)
        self.data_start = 8 + len(text)
        file.truncate(self.data_start + offset)

    def write(self, name: str, values: torch.Tensor, at: int = 0) -> None:
        """values (contiguous, of the planned dtype) as tensor `name`'s bytes from byte `at` of it."""
        offset, planned = self.places[name]
        if SAFETENSORS_NAMES[values.dtype] != planned:  # the plan and the tensors disagree: a bug, not a bad file
            raise AssertionError(f"{name} is {values.dtype}, planned as {planned}")
        self.file.seek(self.data_start + offset + at)
        self.file.write(values.reshape(-1).view(torch.uint8).numpy().data)  # as they are: numpy has no bfloat16


class CheckpointWriter:
    """Writes the checkpoint of `config` into `file` (opened for writing, empty): `add` each model tensor under its
    manas name, in any order, then `finish`. Errors name `source`, the file the tensors come from."""

    def __init__(self, file: BinaryIO, config: GPTConfig, metadata: dict, kind: str | None, source: Path) -> None:
        self.file, self.config, self.kind, self.source = file, config, kind, source
        self.shapes = dict(parameter_shapes(config))  # the model's tensors, float, as a converter hands them
        self.written: set[str] = set()
        entries = [(name, shape, self._dtype(name, allowed)) for name, shape, allowed in stored_tensors(config, kind)]
        self.out = SafetensorsWriter(file, entries, metadata)

    @staticmethod
    def _dtype(name: str, allowed: tuple[str, ...]) -> str:
        if allowed != FLOAT_DTYPES:
            return allowed[0]  # a quantized matrix's codes
        companion = name.rpartition(".")[2] in ("scales", "zeros")
        return SAFETENSORS_NAMES[COMPUTE_DTYPE] if companion else "F32"

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """One model tensor (any floating dtype), checked against the config, stored as float32 or quantized."""
        self._check(name, tensor)
        if self.kind and quantized_matrix(self.config, name, tuple(tensor.shape)):
            self._add_quantized(name, tensor)
        else:
            self._add_float(name, tensor)
        self.written.add(name)

    def finish(self) -> None:
        """Refuse a checkpoint that lacks a tensor the config names, then flush it to the file."""
        for name, shape in self.shapes.items():
            if name not in self.written:
                raise CheckpointError(f"{self.source}: missing tensor for {name} (shape {list(shape)})")
        self.file.flush()

    def _check(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.shapes:
            raise CheckpointError(
                f"{self.source}: tensor for {name} does not fit this config (bias={self.config.bias})"
            )
        if name in self.written:
            raise CheckpointError(f"{self.source}: two tensors are {name}")
        if tuple(tensor.shape) != self.shapes[name]:
            raise CheckpointError(
                f"{self.source}: tensor for {name} has shape {list(tensor.shape)}, the config needs "
                f"{list(self.shapes[name])}"
            )
        if not tensor.is_floating_point():  # complex too: copying it into float32 drops the imaginary part
            raise CheckpointError(
                f"{self.source}: tensor for {name} is {tensor.dtype}, not a real floating-point tensor"
            )

    def _add_float(self, name: str, tensor: torch.Tensor) -> None:
        """Cast to float32 and written a slice of rows at a time (a bfloat16 model's largest tensor is never whole
        in float32 beside itself), each value finite as stored and as float32 (1e300 in float64 is not)."""
        at = 0
        for part in row_slices(tensor):
            values = part.to(torch.float32).contiguous()
            check_finite(name, part, values, self.source)
            self.out.write(name, values, at)
            at += values.numel() * 4

    def _add_quantized(self, name: str, tensor: torch.Tensor) -> None:
        """A matrix as int8 or int4 (torch_engine/quantize.py's rounding), its scales checked as the loader checks
        them: a code times its scale must be finite."""
        for part in row_slices(tensor):  # a NaN weight is named as itself, not as the scale it would make
            check_finite(name, part, part.to(torch.float32), self.source)
        weight = tensor.to(torch.float32)
        layer: QuantizedLinear = (
            Int8Linear(*quantize_rows(weight), kernel=False)
            if self.kind == "int8"
            else Int4Linear(*quantize_groups(weight), kernel=False)
        )
        if overflowing := layer.overflowing_tensor():
            raise not_finite(self.source, name.removesuffix("weight") + overflowing, "float32")
        for part, stored in layer.state_dict().items():
            self.out.write(name.removesuffix("weight") + part, stored.contiguous())


def row_slices(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """tensor as slices of whole rows of about FLOAT_ROWS_BYTES in float32 (a vector or a scalar is one)."""
    rows = tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() else tensor.reshape(1, 1)
    step = max(1, FLOAT_ROWS_BYTES // (4 * rows.shape[1]))
    for first in range(0, rows.shape[0], step):
        yield rows[first : first + step]


def check_finite(name: str, part: torch.Tensor, values: torch.Tensor, source: Path) -> None:
    """Refuse rows `part` of tensor `name` unless each value is finite as stored and as float32 (`values`, the same
    rows cast): 1e300 in float64 is not."""
    if not torch.isfinite(values).all():
        dtype = part.dtype if not torch.isfinite(part).all() else torch.float32
        raise not_finite(source, name, dtype_name(dtype))


def write_safetensors(
    path: Path, planned: Iterable[dict[str, torch.Tensor]], groups: Iterable[dict[str, torch.Tensor]], metadata: dict,
    source: Path,
) -> None:  # fmt: skip
    """A safetensors file of `groups`' tensors, each finite, written as they come, its header planned from
    `planned`: the same names, shapes and dtypes (on the meta device). Errors name `source`."""
    entries = [(name, tuple(t.shape), SAFETENSORS_NAMES[t.dtype]) for group in planned for name, t in group.items()]
    with open(path, "wb") as f:
        out = SafetensorsWriter(f, entries, metadata)
        for group in groups:
            for name, tensor in group.items():
                for part in row_slices(tensor):
                    check_finite(name, part, part.to(torch.float32), source)
                out.write(name, tensor.contiguous())
