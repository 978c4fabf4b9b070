"""The native engine's KV cache: CacheSession's interface (torch_engine/kv_cache.py) over buffers the core
reads and writes."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from ctypes import c_float
from dataclasses import dataclass

from ..engine.session import allocation_description, decode_tokens, grown_size, prefill_rows
from .binding import ManasCache
from .model import Logits, NativeGPT

# The rows of one forward call in a prefill of many prompts (bench --batch, --num-samples): each call's scratch
# (activations of every row) then stays a few megabytes however many prompts there are; the results are the same.
PREFILL_ROWS = 4096


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
        config = model.config
        self.position_floats = config.n_kv_head * config.head_size  # one layer's key (or value) at one position
        self.reset()

    def reset(self) -> None:
        self.k = self.v = None
        self.size = self.positions = self.batch_size = 0

    def allocate(self, batch_size: int, needed: int) -> None:
        """Room for `needed` positions of every row, the cached ones kept."""
        if needed > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} positions; {needed} were asked for")
        if self.k is not None and needed <= self.size:
            return
        size = grown_size(needed, self.positions, self.capacity, self.reserve)
        count = batch_size * self.model.config.n_layer * size * self.position_floats
        k, v = (c_float * count)(), (c_float * count)()
        if self.positions:
            self._copy_positions(self.k, k, size)
            self._copy_positions(self.v, v, size)
        self.k, self.v, self.size = k, v, size
        self._caches = [self._row_cache(row) for row in range(batch_size)]

    def _copy_positions(self, old, into, size: int) -> None:
        """The cached positions of every row and layer of `old` into a buffer of `size` positions per layer."""
        span = 4 * self.positions * self.position_floats
        for block in range(self.batch_size * self.model.config.n_layer):  # (row, layer) pairs, in memory order
            ctypes.memmove(
                ctypes.addressof(into) + 4 * block * size * self.position_floats,
                ctypes.addressof(old) + 4 * block * self.size * self.position_floats,
                span,
            )

    def cache(self, row: int) -> ManasCache:
        return self._caches[row]

    def _row_cache(self, row: int) -> ManasCache:
        offset = 4 * row * self.model.config.n_layer * self.size * self.position_floats
        return ManasCache(
            ctypes.cast(ctypes.addressof(self.k) + offset, ctypes.POINTER(c_float)),
            ctypes.cast(ctypes.addressof(self.v) + offset, ctypes.POINTER(c_float)),
            self.size,
        )

    def prefill(self, token_ids):
        """CacheSession.prefill: reset, run the prompt's rows (B, T ≤ block_size: lists, or a tensor's); the logits
        of each row's last position, Logits (B, vocab)."""
        self.reset()  # first: a refused prefill must not leave the previous request's cache to decode from
        rows = prefill_rows(token_ids, self.block_size)
        B, T = len(rows), len(rows[0])
        try:
            self.allocate(B, T)
            logits = self.run_prompts(rows, T - 1)
        except BaseException:
            self.reset()
            raise
        self.positions, self.batch_size = T, B
        return logits

    def extend(self, token_ids, keep: int):
        """A prefill that keeps the first `keep` cached positions, which must hold the rows' first `keep` tokens
        (a conversation's earlier turns), and runs only the rest: the logits of each row's last position, the same
        bits a prefill of the whole rows gives (each position's arithmetic reads only its own past). Falls back to
        the whole prefill where nothing can be kept."""
        rows = prefill_rows(token_ids, self.block_size)
        B, T = len(rows), len(rows[0])
        if not 0 < keep <= min(self.positions, T - 1) or B != self.batch_size:
            return self.prefill(rows)
        self.positions = keep  # what was cached past `keep` is written over
        try:
            self.allocate(B, T)
            caches = [self.cache(b) for b in range(B) for _ in range(keep, T)]
            tokens = [token for row in rows for token in row[keep:]]
            logit_rows = [(b + 1) * (T - keep) - 1 for b in range(B)]
            logits = self.model.run(tokens, list(range(keep, T)) * B, caches, logit_rows)
        except BaseException:
            self.reset()
            raise
        self.positions = T
        return logits

    def snapshot(self) -> Snapshot:
        """A copy of row 0's cached keys and values (the prefix cache's)."""
        n, layers = self.positions * self.position_floats, self.model.config.n_layer
        k, v = (c_float * (layers * n))(), (c_float * (layers * n))()
        for copy, cached in ((k, self.k), (v, self.v)):
            for layer in range(layers):
                source = ctypes.addressof(cached) + 4 * layer * self.size * self.position_floats
                ctypes.memmove(ctypes.addressof(copy) + 4 * layer * n, source, 4 * n)
        return Snapshot(self.positions, k, v, self.positions)

    def hand_over(self) -> Snapshot:
        """Row 0's cached keys and values as a snapshot without a copy, the session left empty: a finished
        request's cache, which nothing reads again, kept for the prefix cache at no cost."""
        if self.batch_size != 1:
            raise ValueError(f"only a cache of one row can be handed over, not of {self.batch_size}")
        snapshot = Snapshot(self.positions, self.k, self.v, self.size)
        self.reset()
        return snapshot

    def restore(self, snapshot: Snapshot, keep: int, room: int = 0) -> None:
        """One row holding a snapshot's first `keep` positions, as the prefill that made them left them, in a cache
        with room for `room` positions (the prompt it will be extended to: allocated once, not grown)."""
        self.reset()
        self.allocate(1, max(keep, room))
        stride, kept = snapshot.size * self.position_floats, keep * self.position_floats
        for copy, cached in ((snapshot.k, self.k), (snapshot.v, self.v)):
            for layer in range(self.model.config.n_layer):
                target = ctypes.addressof(cached) + 4 * layer * self.size * self.position_floats
                ctypes.memmove(target, ctypes.addressof(copy) + 4 * layer * stride, 4 * kept)
        self.positions, self.batch_size = keep, 1

    def run_prompts(self, ids: list[list[int]], logits_from: int) -> Logits:
        """Each batch row's tokens from position 0 into its cache; the logits of each row's positions logits_from
        .. T − 1, (B·(T − logits_from), vocab): all of them for scoring, the last for a prefill."""
        B, T = len(ids), len(ids[0])
        step = max(1, PREFILL_ROWS // T)  # whole prompts per call: a prompt's positions attend to its earlier ones
        groups = [range(first, min(B, first + step)) for first in range(0, B, step)]
        parts = [self._run_group(ids, group, logits_from) for group in groups]
        if len(parts) == 1:
            return parts[0]
        logits = Logits(B * (T - logits_from), self.model.config.vocab_size)
        for group, part in zip(groups, parts):
            ctypes.memmove(logits.row(group.start * (T - logits_from)), part.buffer, ctypes.sizeof(part.buffer))
        return logits

    def _run_group(self, ids: list[list[int]], group: range, logits_from: int) -> Logits:
        T = len(ids[0])
        caches = [cache for b in group for cache in [self.cache(b)] * T]
        logit_rows = [b * T + t for b in range(len(group)) for t in range(logits_from, T)]
        return self.model.run(
            [token for b in group for token in ids[b]], list(range(T)) * len(group), caches, logit_rows
        )

    def check(self, tokens: list[int]):
        """One row's tokens from its next position on, in one pass (speculation's check): each one's logits,
        Logits (len(tokens), vocab), the bits a decode step of each gives (each position's arithmetic reads only its
        own past). rewind() then keeps the positions that stay."""
        if self.batch_size != 1 or not 0 < self.positions <= self.block_size - len(tokens):
            raise ValueError(f"a check runs on one cached row with room for {len(tokens)} positions")
        first = self.positions
        self.allocate(1, first + len(tokens))
        logits = self.model.run(tokens, list(range(first, first + len(tokens))), [self.cache(0)] * len(tokens),
                                list(range(len(tokens))))  # fmt: skip
        self.positions = first + len(tokens)
        return logits

    def rewind(self, positions: int) -> None:
        """Keep the first `positions` cached positions; what lies past them is written over."""
        if not 0 < positions <= self.positions:
            raise ValueError(f"the cache holds {self.positions} positions, not {positions}")
        self.positions = positions

    def decode(self, token_ids):
        """CacheSession.decode: append one position per row (a list of B ids, or a (B, 1) tensor's); their logits,
        Logits (B, vocab)."""
        tokens = decode_tokens(token_ids, self.positions, self.batch_size, self.block_size)
        return decode_rows(self.model, tokens, [self])

    def storage(self) -> dict:
        logical = 2 * self.batch_size * self.model.config.n_layer * self.positions * self.position_floats * 4
        return {
            "positions": self.positions,
            "logical_bytes": logical,
            "storage_bytes": 0 if self.k is None else 2 * ctypes.sizeof(self.k),
            "dtype": "float32" if self.positions else None,
            "allocation": self.allocation,
        }

    def layer_shapes(self) -> list[tuple[list[int], list[int], int]]:
        """Per layer: K's and V's shapes as CacheSession's layers hold them, (B, n_kv_head, positions, head_size),
        and their bytes."""
        config = self.model.config
        shape = [self.batch_size, config.n_kv_head, self.positions, config.head_size]
        return [(shape, shape, 2 * 4 * math.prod(shape))] * (config.n_layer if self.k is not None else 0)


@dataclass(frozen=True)
class Snapshot:
    """A row's cached keys and values: k and v each (n_layer, size, n_kv_head, head_size) float32, the first
    `positions` of each layer's `size` filled (size is positions for a copy, the cache's room for a hand-over)."""

    positions: int
    k: object
    v: object
    size: int

    @property
    def nbytes(self) -> int:
        return 2 * ctypes.sizeof(self.k)


def run_rows(model: NativeGPT, rows: list[tuple[NativeSession, list[int]]], checks: Sequence[int] = ()) -> Logits:
    """One forward call over one-row sessions, each extended by its tokens from its own positions (a decode step's
    one token, a new request's prompt or what the prefix cache did not hold of it, a speculative check's last token
    and proposal): the logits of each one's last token, in order, and of every token of the rows in `checks` (as
    NativeSession.check gives them). Each row's arithmetic is its own whichever rows share the call, so each session
    ends as its own prefill, extend, decode or check would leave it, bit for bit; the weights are read once for all
    of them."""
    tokens, positions, caches, logit_rows = [], [], [], []
    for index, (session, new) in enumerate(rows):
        session.allocate(1, session.positions + len(new))
        first = len(tokens)
        tokens += new
        positions += range(session.positions, session.positions + len(new))
        caches += [session.cache(0)] * len(new)
        logit_rows += range(first, len(tokens)) if index in checks else [len(tokens) - 1]
    logits = model.run(tokens, positions, caches, logit_rows)
    for session, new in rows:
        session.positions, session.batch_size = session.positions + len(new), 1
    return logits


def decode_rows(model: NativeGPT, tokens: list[int], sessions: list[NativeSession]) -> Logits:
    """One new token for each row of several sessions at once, tokens in the sessions' row order, each at its
    own position over its own cache; their logits (R, vocab)."""
    caches, positions = [], []
    for session in sessions:
        session.allocate(session.batch_size, session.positions + 1)
        caches += [session.cache(b) for b in range(session.batch_size)]
        positions += [session.positions] * session.batch_size
    logits = model.run(tokens, positions, caches, list(range(len(positions))))
    for session in sessions:
        session.positions += 1
    return logits
