"""A mapped checkpoint's tensors as the native core reads them (no torch): the loader native/model.py's NativeGPT
is given. binding.bind asks for each tensor by its module name: `vector(name)`, a float32 pointer (None where the
model has no such tensor), and `linear(name)`, a ManasLinear of float32, int8 or int4 weights
(torch_engine/native_weights.py is the same loader over a torch model's tensors).
"""

from __future__ import annotations

import ctypes
import math
import mmap
from ctypes import POINTER, c_float, c_uint16

from ..native.binding import WEIGHTS_F32, WEIGHTS_INT4, WEIGHTS_INT8, ManasLinear, stored_bytes
from .header import ITEMSIZES, MappedCheckpoint, companion_name, not_finite

STORED = {"F32": 0, "F16": 1, "BF16": 2, "F64": 3}  # core.c's STORED_* codes


class MappedWeights:
    """The checkpoint's own bytes where they are already what the core reads (float32, bfloat16 scales, codes),
    else a converted copy; every tensor checked finite as the core will compute with it, by the core."""

    def __init__(self, mapped: MappedCheckpoint, library: ctypes.CDLL) -> None:
        self.mapped, self.library = mapped, library
        self.config = mapped.header.config
        self.quantization = mapped.header.quantization
        self.name = self.quantization or "float32"
        self.kept: dict[tuple[str, bool], object] = {}  # the converted copies, alive as long as the pointers into them
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(mapped.mapping)) if len(mapped.mapping) else 0

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors as the core holds them: float values 4 bytes each (mapped, or converted), codes as
        stored, scales and zeros 2 (bfloat16)."""
        total = 0
        for name, entry in self.mapped.header.tensors.items():
            count = math.prod(entry.shape)
            companion = name.endswith((".scales", ".zeros"))
            total += count * (1 if entry.dtype in ("I8", "U8") else 2 if companion else 4)
        return total

    def vector(self, name: str):
        """A float tensor as float32; None when the file has none of that name (no bias; a quantized file's tied
        token embedding, which the core dequantizes from the output layer's codes)."""
        quantized_table = self.quantization and self.config.tie_embeddings and name == "token_embedding.weight"
        if name not in self.mapped.header.tensors or quantized_table:
            return None
        return ctypes.cast(self._converted(name, bfloat16=False), POINTER(c_float))

    def linear(self, name: str) -> ManasLinear:
        stored = self._output_layer if name == "lm_head" else name  # a tied output layer is stored once
        weight = f"{stored}.weight"
        rows, columns = self.mapped.header.tensors[weight].shape
        bias = self.vector(f"{name}.bias")
        if not self.quantization:
            return ManasLinear(WEIGHTS_F32, columns, rows, 0, self._converted(weight, bfloat16=False), None, None, bias)
        scales = self._bfloat16s(companion_name(weight, "scales"))
        if self.quantization == "int8":
            layer = ManasLinear(WEIGHTS_INT8, columns, rows, 0, self._address(weight), scales, None, bias)
        else:
            zeros = self._bfloat16s(companion_name(weight, "zeros"))
            layer = ManasLinear(
                WEIGHTS_INT4,
                2 * columns,
                rows,
                self.mapped.header.group_size,
                self._address(weight),
                scales,
                zeros,
                bias,
            )
        if overflow := self.library.manas_quantized_overflow(ctypes.byref(layer)):
            raise not_finite(self.mapped.path, f"{stored}.{('scales', 'zeros')[overflow - 1]}", "float32")
        if stored == "token_embedding":
            self._check_embedding(layer)
        return layer

    def release(self, linear: ManasLinear) -> None:
        """Drops the mapped pages of a layer's rows once the core reads them from a copy (native/model.py,
        pack_panels), so the weights are resident once, not twice: a page touched again (the tied embedding's
        rows) comes back from the file. Rows in a converted copy, or in a file read whole, stay."""
        mapping = self.mapped.mapping
        start = (linear.weight or 0) - self._base
        if not isinstance(mapping, mmap.mmap) or not 0 <= start <= len(mapping) - stored_bytes(linear):
            return
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # the whole pages inside the rows
        end = (start + stored_bytes(linear)) // mmap.PAGESIZE * mmap.PAGESIZE
        if first < end:
            mapping.madvise(mmap.MADV_DONTNEED, first, end - first)

    @property
    def _output_layer(self) -> str:
        """Where the output layer is stored: as the token embedding when tied, else under its own name."""
        return "token_embedding" if self.config.tie_embeddings else "lm_head"

    def _address(self, name: str) -> int:
        """Where tensor `name` starts in the mapping; its extent, every byte its shape implies, was checked with the
        header (check_tensors), and the mapping covers it (MappedCheckpoint)."""
        return self._base + self.mapped.header.tensors[name].start

    def _converted(self, name: str, bfloat16: bool) -> int:
        """The address of tensor `name` as float32 (or bfloat16): in the mapping where it is stored so, aligned;
        else converted into a copy. Refused, naming it, when a value is not finite in that type."""
        if (name, bfloat16) in self.kept:  # the tied embedding is the float output layer too: one copy
            return ctypes.addressof(self.kept[name, bfloat16])
        entry = self.mapped.header.tensors[name]
        count = entry.nbytes // ITEMSIZES[entry.dtype]  # the byte extent checked with the header (check_tensors)
        if not bfloat16 and entry.dtype == "F32" and self.mapped.aligned(name):
            if self.library.manas_first_not_finite(self._address(name), count) >= 0:
                raise not_finite(self.mapped.path, name, "float32")
            return self._address(name)
        converted = ((c_uint16 if bfloat16 else c_float) * count)()
        if self.library.manas_convert(self._address(name), STORED[entry.dtype], count, bfloat16, converted) >= 0:
            raise not_finite(self.mapped.path, name, "bfloat16" if bfloat16 else "float32")
        self.kept[name, bfloat16] = converted
        return ctypes.addressof(converted)

    def _bfloat16s(self, name: str):
        """Scales and zeros as the core reads them, bfloat16 (quantize.py's COMPUTE_DTYPE): always a copy, as
        small as one value per row or per group."""
        return ctypes.cast(self._converted(name, bfloat16=True), POINTER(c_uint16))

    def _check_embedding(self, layer: ManasLinear) -> None:
        """A quantized file's token embedding is its output layer's rows dequantized: each must be finite."""
        row = (c_float * layer.n_in)()
        if not self.library.manas_dequantized_finite(ctypes.byref(layer), row):
            raise not_finite(self.mapped.path, "token_embedding.weight", "float32")
