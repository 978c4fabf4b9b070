"""The native engine: the torch model's own tensors run by the C core (native/core.c), one call per step.

NativeGPT stands where generation, batching and scoring take a model: it has the config, the full causal forward
(`model(idx)`, for the crop-and-recompute reference and for scoring) and, through NativeSession, a KV cache with
CacheSession's interface. The core computes each position's row with the same kernels and the same order of
arithmetic whether it is decoded alone, prefilled among a prompt's rows or decoded beside other requests, so on
this engine cached == recompute and batched == alone hold bit for bit.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..native.binding import ManasCache, bind
from .kv_cache import CacheSession, allocation_description, check_decode_ids, check_prefill_ids
from .model import GPT, GPTConfig


class NativeGPT:
    """A float32, int8 or int4 GPT on the CPU, run by the C core on its own tensors (nn.Linear's (out, in) layout:
    do not apply use_decode_layout)."""

    def __init__(self, model: GPT, library: ctypes.CDLL, threads: int = 1) -> None:
        self._pool = None  # first: __del__ closes it
        embedding = model.token_embedding.weight
        if embedding.device.type != "cpu" or embedding.dtype != torch.float32:
            raise ValueError(f"the native core runs float32 weights on the CPU, not {embedding.dtype} on {embedding.device}")
        self.model = model.eval()
        self.config: GPTConfig = model.config
        self.library = library
        self.bound, self._alive = bind(model)
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self.set_threads(threads)

    def set_threads(self, threads: int) -> None:
        if self._pool is not None and self.library.manas_pool_threads(self._pool) == threads:
            return
        pool = self.library.manas_pool_new(threads)
        if not pool:
            raise MemoryError(f"the native core could not start {threads} threads")
        self.close()
        self._pool = pool

    @property
    def threads(self) -> int:
        return self.library.manas_pool_threads(self._pool)

    def close(self) -> None:
        if self._pool is not None:
            self.library.manas_pool_free(self._pool)
            self._pool = None

    def __del__(self) -> None:
        self.close()

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The torch model's parameters: the tensors the core reads."""
        return self.model.parameters()

    def run(self, tokens: list[int], positions: list[int], caches: list, logit_rows: list[int]) -> torch.Tensor:
        """The core's forward pass over rows (token, position, cache); the logits of logit_rows, (len, vocab)."""
        rows = len(tokens)
        if any(not 0 <= token < self.config.vocab_size for token in tokens):
            raise IndexError(f"token ids must be in [0, {self.config.vocab_size})")
        needed = self.library.manas_scratch_bytes(ctypes.byref(self.bound), rows, self.threads)
        if self._scratch.numel() < needed:
            self._scratch = torch.empty(needed, dtype=torch.uint8)
        logits = torch.empty(len(logit_rows), self.config.vocab_size)
        c_caches = (ManasCache * rows)(*caches)
        status = self.library.manas_forward(
            ctypes.byref(self.bound), self._pool, rows, _int32s(tokens), _int32s(positions), c_caches,
            len(logit_rows), _int32s(logit_rows), _floats(logits), self._scratch.data_ptr())
        if status:
            raise RuntimeError(f"the native core failed with status {status}")
        return logits

    @torch.inference_mode()
    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        """GPT.forward without targets: the logits (B, T, vocab) of every position, each row from position 0."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds block_size {self.config.block_size}")
        session = NativeSession(self, "static", capacity=T)
        session.allocate(B, T)
        return session.run_prompts(idx.tolist(), every_position=True).view(B, T, -1)


def _int32s(values: list[int]):
    return (ctypes.c_int32 * len(values))(*values)


def _floats(tensor: torch.Tensor):
    return ctypes.cast(tensor.data_ptr(), ctypes.POINTER(ctypes.c_float))


class NativeSession:
    """CacheSession's interface over the core's caches: per batch row, K and V as (n_layer, capacity, n_kv_head,
    head_size) float32, the layout core.c reads. "dynamic" grows the capacity by doubling (copying once per
    doubling), "static" allocates `capacity` at once."""

    def __init__(self, model: NativeGPT, allocation: str = "dynamic", capacity: int | None = None) -> None:
        self.model = model
        self.block_size = model.config.block_size
        self.allocation = allocation_description(allocation)
        self.reserve = allocation == "static"
        self.capacity = self.block_size if capacity is None else min(capacity, self.block_size)
        self.k = self.v = None
        self.positions = 0
        self.batch_size = 0

    def reset(self) -> None:
        self.k = self.v = None
        self.positions = self.batch_size = 0

    def allocate(self, batch_size: int, needed: int) -> None:
        """Room for `needed` positions of every row, the cached ones kept."""
        if needed > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} positions; {needed} were asked for")
        if self.k is not None and needed <= self.k.size(2):
            return
        size = self.capacity if self.reserve else min(self.capacity, max(needed, 2 * self.positions))
        config = self.model.config
        shape = (batch_size, config.n_layer, size, config.n_kv_head, config.head_size)
        k, v = torch.empty(shape), torch.empty(shape)
        if self.positions:
            k[:, :, : self.positions], v[:, :, : self.positions] = self.k[:, :, : self.positions], self.v[:, :, : self.positions]
        self.k, self.v = k, v

    def cache(self, row: int):
        return ManasCache(_floats(self.k[row]), _floats(self.v[row]), self.k.size(2))

    def prefill(self, token_ids: torch.Tensor) -> torch.Tensor:
        """CacheSession.prefill: reset, run the prompt (B, T ≤ block_size); logits of its last position (B, 1, vocab)."""
        self.reset()  # first: a refused prefill must not leave the previous request's cache to decode from
        check_prefill_ids(token_ids, self.block_size)
        B, T = token_ids.shape
        try:
            self.allocate(B, T)
            logits = self.run_prompts(token_ids.tolist(), every_position=False)
        except BaseException:
            self.reset()
            raise
        self.positions, self.batch_size = T, B
        return logits[:, None]

    def run_prompts(self, ids: list[list[int]], every_position: bool) -> torch.Tensor:
        """Each batch row's tokens from position 0 into its cache, all rows in one call; the logits of every
        position, (B·T, vocab), or of each row's last, (B, vocab)."""
        B, T = len(ids), len(ids[0])
        caches = [cache for b in range(B) for cache in [self.cache(b)] * T]
        logit_rows = range(B * T) if every_position else range(T - 1, B * T, T)
        return self.model.run([token for row in ids for token in row], list(range(T)) * B, caches, list(logit_rows))

    def decode(self, token_ids: torch.Tensor) -> torch.Tensor:
        """CacheSession.decode: append one position per row (B, 1); its logits (B, 1, vocab)."""
        check_decode_ids(token_ids, self.positions, self.batch_size, self.block_size)
        return decode_rows(self.model, token_ids, [self])

    def storage(self) -> dict:
        config = self.model.config
        logical = 2 * self.batch_size * config.n_layer * self.positions * config.n_kv_head * config.head_size * 4
        return {
            "positions": self.positions,
            "logical_bytes": logical,
            "storage_bytes": 0 if self.k is None else 2 * self.k.numel() * 4,
            "dtype": "float32" if self.positions else None,
            "allocation": self.allocation,
        }

    @property
    def layers(self) -> list:
        """Per layer, K and V views (B, n_kv_head, positions, head_size), as CacheSession's layers hold them."""
        if self.k is None:
            return []
        return [_LayerView(self.k[:, i, : self.positions].transpose(1, 2), self.v[:, i, : self.positions].transpose(1, 2))
                for i in range(self.model.config.n_layer)]


class _LayerView:
    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v


def new_session(model: GPT | NativeGPT, allocation: str = "dynamic", capacity: int | None = None):
    """The KV cache of one request, for whichever engine runs the model."""
    session_type = NativeSession if isinstance(model, NativeGPT) else CacheSession
    return session_type(model, allocation, capacity)


def decode_rows(model: GPT | NativeGPT, token_ids: torch.Tensor, sessions: list) -> torch.Tensor:
    """One new token for each row of several sessions at once, token_ids (R, 1) in the sessions' row order, each
    at its own position over its own cache; the logits (R, 1, vocab)."""
    if not isinstance(model, NativeGPT):
        return model.decode_rows(token_ids, [s.positions for s in sessions], [s.layers for s in sessions])
    caches, positions = [], []
    for session in sessions:
        session.allocate(session.batch_size, session.positions + 1)
        caches += [session.cache(b) for b in range(session.batch_size)]
        positions += [session.positions] * session.batch_size
    logits = model.run(token_ids[:, 0].tolist(), positions, caches, list(range(len(positions))))
    for session in sessions:
        session.positions += 1
    return logits[:, None]


ENGINES = ("auto", "native", "torch")


@dataclass(frozen=True)
class EngineChoice:
    """What runs the model, and what the CLI should say about the choice."""

    model: GPT | NativeGPT
    name: str  # "native" or "torch"
    notice: str | None = None  # native was asked for and cannot run, or its cache folder was refused
    detail: str = ""  # the compiler's or loader's own message, for --debug
    compile_s: float | None = None  # this run compiled the core
    library: str | None = None  # the core's shared library

    @property
    def threads(self) -> int:
        """The threads the engine computes on now."""
        return self.model.threads if self.name == "native" else torch.get_num_threads()

    def set_threads(self, threads: int) -> None:
        if self.name == "native":
            self.model.set_threads(threads)
        elif threads != torch.get_num_threads():
            torch.set_num_threads(threads)


def native_unsupported(model: GPT) -> str | None:
    """Why the core cannot run this model, or None: it runs float32, int8 and int4 weights on the CPU."""
    weights = model.token_embedding.weight
    if weights.device.type != "cpu":
        return f"the model is on {weights.device.type.upper() if weights.device.type == 'cuda' else weights.device}"
    if weights.dtype != torch.float32:
        return f"the core runs float32, int8 and int4 weights, not {str(weights.dtype).removeprefix('torch.')}"
    return None


def choose_engine(name: str, model: GPT, threads: int) -> EngineChoice:
    """`auto`: the native core when it can run the model and builds here, else torch; `native`: the same, with a
    notice when torch runs instead; `torch`: torch."""
    from ..native.build import NativeUnavailable, build
    from ..native.binding import declare

    if name not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {name!r}")
    if name == "torch":
        return EngineChoice(model, "torch")
    reason, detail = native_unsupported(model), ""
    if reason is None:
        try:
            built = build()
            return EngineChoice(NativeGPT(model, declare(built.library), threads), "native", built.notice,
                                compile_s=built.compile_s, library=str(built.path))
        except NativeUnavailable as exc:
            reason, detail = exc.reason, exc.detail
    notice = f"the native engine cannot run: {reason}; the torch engine runs instead" if name == "native" else None
    return EngineChoice(model, "torch", notice, detail)
