"""The native engine's model: the C core (core.c) runs the forward pass over rows (token, position, cache), one
call per step, on weights a loader points it at (formats/mapped_weights.py: the checkpoint file's own bytes;
torch_engine/native_weights.py: a torch model's tensors). This module never imports torch, so a run on the CPU
never waits for torch to load."""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
from collections.abc import Callable
from ctypes import c_float, c_int32

from ..engine.config import GPTConfig, parameter_shapes
from ..engine.threads import usable_cpus
from .binding import ManasCache, ManasLinear, ManasModel, bind


class Logits:
    """Rows of float32 logits in memory the core writes: (rows, vocab), from row `first` of `buffer`."""

    def __init__(self, rows: int, vocab: int, buffer=None, first: int = 0) -> None:
        self.rows, self.vocab, self.first = rows, vocab, first
        self.buffer = (c_float * (rows * vocab))() if buffer is None else buffer

    def row(self, index: int) -> int:
        """The address of row `index`."""
        return ctypes.addressof(self.buffer) + 4 * (self.first + index) * self.vocab

    def __getitem__(self, rows: slice) -> Logits:
        """Rows start .. stop − 1, as a tensor's rows slice (batching takes each row's logits so, on either engine)."""
        start, stop, step = rows.indices(self.rows)
        if step != 1:
            raise ValueError("logits rows are sliced in order, one by one")
        return Logits(stop - start, self.vocab, self.buffer, self.first + start)


class NativeGPT:
    """A float32, int8 or int4 GPT run by the core. `weights`: where its tensors are, as binding.bind asks for
    them (vector(name), linear(name)), with the model's `config`, its weight type `name` and `nbytes`, the bytes
    the core reads. int8 and int4 layers multiply their input quantized per block of 32 in integers (as
    llama.cpp's q8_0 does), unless float_activations: then in float32, over the weights' exact dequantized
    values."""

    def __init__(self, weights, library: ctypes.CDLL, threads: int = 1, float_activations: bool = False) -> None:
        self._pool = None  # first: __del__ closes it
        self.config: GPTConfig = weights.config
        self.weights, self.weights_bytes = weights.name, weights.nbytes
        self.mapped_bytes: int = getattr(weights, "mapped_bytes", 0)  # read from a file's pages (a GGUF's blocks)
        self.library = library
        self.bound = bind(self.config, weights, integer_products=not float_activations)
        self._alive = weights  # the tensors and converted copies the bound pointers point into
        self._panels = pack_panels(self.bound, library, weights.release)
        self.panel_bytes = len(self._panels) if self._panels else 0
        self._scratch = ctypes.create_string_buffer(0)
        self._scratch_rows = -1
        self.set_threads(threads)

    def set_threads(self, threads: int) -> None:
        if self._pool is not None and self.threads == threads:
            return
        pool = self.library.manas_pool_new(threads, usable_cpus())  # more threads than cores: they never spin
        if not pool:
            raise MemoryError(f"the native core could not start {threads} threads")
        self.close()
        self._pool, self._threads = pool, threads

    @property
    def threads(self) -> int:
        return self._threads

    def close(self) -> None:
        if self._pool is not None:
            self.library.manas_pool_free(self._pool)
            self._pool = None

    def __del__(self) -> None:
        self.close()

    def num_parameters(self) -> int:
        return sum(math.prod(shape) for _, shape in parameter_shapes(self.config))

    def run(self, tokens: list[int], positions: list[int], caches: list, logit_rows: list[int]) -> Logits:
        """The core's forward pass over rows (token, position, cache); the logits of logit_rows, (len, vocab)."""
        rows, vocab = len(tokens), self.config.vocab_size
        if any(not 0 <= token < vocab for token in tokens):
            raise IndexError(f"token ids must be in [0, {vocab})")
        if len(logit_rows) > rows or any(not 0 <= row < rows for row in logit_rows):
            raise IndexError(f"logit rows must be at most {rows} of the rows [0, {rows})")
        if rows > self._scratch_rows:  # sized for the most rows yet: a decode step asks for no new memory
            needed = self.library.manas_scratch_bytes(ctypes.byref(self.bound), rows, self.threads)
            self._scratch, self._scratch_rows = ctypes.create_string_buffer(needed), rows
        logits = Logits(len(logit_rows), vocab)
        self.library.manas_forward(
            ctypes.byref(self.bound),
            self._pool,
            rows,
            int32s(tokens),
            int32s(positions),
            (ManasCache * rows)(*caches),
            len(logit_rows),
            int32s(logit_rows),
            logits.buffer,
            self._scratch,
        )
        return logits


def linears(model: ManasModel) -> list[ManasLinear]:
    """The model's linear layers, as views into its structs (setting a field sets the core's)."""
    names = ("qkv", "output", "gate", "up", "down", "key", "value")
    return [*(getattr(model.layers[i], name) for i in range(model.n_layer) for name in names), model.lm_head]


def pack_panels(model: ManasModel, library: ctypes.CDLL, release: Callable[[ManasLinear], None]) -> mmap.mmap | None:
    """Each layer's weights regrouped once as the core's products stream them (core.c, PANEL_UNIT), all the layers'
    in one mapping of their own (page-aligned, each layer on its own cache lines; the caller keeps it alive), then
    release(layer) told its rows as stored are read no more by the products. A layer the core cannot regroup is
    read as stored. One mapping, not one a layer, so that a small model's layers (each under 2 MiB) share huge
    pages too; its pages are touched only as each layer is packed, so the weights stay resident once."""
    sizes = [(linear, library.manas_panel_bytes(ctypes.byref(linear))) for linear in linears(model)]
    layers = [(linear, -(-size // 64) * 64) for linear, size in sizes if size]  # sizes in whole cache lines
    if not layers:
        return None
    arena = anonymous_memory(sum(size for _, size in layers))
    address = ctypes.addressof(ctypes.c_char.from_buffer(arena))
    for linear, size in layers:
        library.manas_pack(ctypes.byref(linear), address)
        linear.panels = address
        address += size
        release(linear)
    return arena


def anonymous_memory(nbytes: int) -> mmap.mmap:
    """nbytes of zeroed memory of its own, in 2 MiB pages where Linux gives them (a hint; elsewhere 4 KiB). The core
    streams the panels once a token: with 4 KiB pages each 4 KiB is another TLB miss and a page the CPU's
    prefetchers stop at (docs/native.md, Panels). Only for what is mapped once, at load: with Linux's `madvise`
    defrag a fault on a huge page may compact memory first, a stall a per-request buffer would pay each time."""
    memory = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            memory.madvise(mmap.MADV_HUGEPAGE)
    return memory


def int32s(values: list[int]):
    return (c_int32 * len(values))(*values)
