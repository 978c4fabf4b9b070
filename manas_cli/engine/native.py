"""The native engine: the C core (native/core.c) runs the model, one call per step, and samples its tokens
(engines.py chooses between it and torch).

NativeGPT stands where generation, batching and scoring take a model: it has the config, the full causal forward
(`model(rows)`, for the crop-and-recompute reference and for scoring) and, through NativeSession, a KV cache with
CacheSession's interface; NativeSampling draws each row's token in the core. Its weights are the mapped checkpoint
file's bytes (native/weights.py), or a torch model's tensors: this module never imports torch itself, so a run on
the CPU never waits for torch to load. The core computes each position's row with the same kernels
and the same order of arithmetic whether it is decoded alone, prefilled among a prompt's rows or decoded beside
other requests, so on this engine cached == recompute and batched == alone hold bit for bit.
"""

from __future__ import annotations

import ctypes
import math
from ctypes import c_float, c_int32, c_uint8

from ..errors import NumericalError
from ..native.binding import ManasCache, ManasDraw, ManasSampler, bind
from .config import GPTConfig, parameter_shapes
from .session import allocation_description, decode_tokens, prefill_rows
from .sampling import Sampler, logits_error

INT32_MAX = 2**31 - 1


class Logits:
    """Rows of float32 logits in memory the core writes: (rows, vocab), from row `first` of `buffer`.
    `torch()` views them as a tensor."""

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

    def torch(self):
        import torch

        whole = torch.frombuffer(self.buffer, dtype=torch.float32).view(-1, self.vocab)
        return whole[self.first : self.first + self.rows]


class NativeGPT:
    """A float32, int8 or int4 GPT run by the core. `source`: a MappedCheckpoint (its file's bytes, checked
    finite by the core) or a torch GPT on the CPU in nn.Linear's (out, in) layout (do not apply
    use_decode_layout)."""

    def __init__(self, source, library: ctypes.CDLL, threads: int = 1) -> None:
        from ..formats.header import MappedCheckpoint
        from ..native.weights import MappedWeights, TorchWeights

        self._pool = None  # first: __del__ closes it
        if isinstance(source, MappedCheckpoint):
            self.config: GPTConfig = source.header.config
            self.weights = source.header.quantization or "float32"
            weights = MappedWeights(source, library)
        else:
            check_torch_model(source)
            self.config, self.weights = source.config, torch_weights_name(source)
            weights = TorchWeights(source.eval())
        self.source, self.library = source, library
        self.bound = bind(self.config, weights)
        self._alive = weights  # the converted copies the bound pointers may point into
        self._scratch = ctypes.create_string_buffer(0)
        self._scratch_rows = -1
        self.set_threads(threads)

    def set_threads(self, threads: int) -> None:
        if self._pool is not None and self.threads == threads:
            return
        pool = self.library.manas_pool_new(threads)
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

    @property
    def weights_bytes(self) -> int:
        """Bytes of the weights the core reads: a torch model's own (quantize.weights_bytes); a mapped file's
        tensors as the core holds them: float values 4 bytes each (mapped, or converted), codes as stored, scales
        and zeros 2 (bfloat16)."""
        from ..formats.header import MappedCheckpoint

        if not isinstance(self.source, MappedCheckpoint):
            from .quantize import weights_bytes

            return weights_bytes(self.source)
        total = 0
        for name, entry in self.source.header.tensors.items():
            count = math.prod(entry.shape)
            companion = name.endswith((".scales", ".zeros"))
            total += count * (1 if entry.dtype in ("I8", "U8") else 2 if companion else 4)
        return total

    def run(self, tokens: list[int], positions: list[int], caches: list, logit_rows: list[int]) -> Logits:
        """The core's forward pass over rows (token, position, cache); the logits of logit_rows, (len, vocab)."""
        rows, vocab = len(tokens), self.config.vocab_size
        if any(not 0 <= token < vocab for token in tokens):
            raise IndexError(f"token ids must be in [0, {vocab})")
        if rows > self._scratch_rows:  # sized for the most rows yet: a decode step asks for no new memory
            needed = self.library.manas_scratch_bytes(ctypes.byref(self.bound), rows, self.threads)
            self._scratch, self._scratch_rows = ctypes.create_string_buffer(needed), rows
        logits = Logits(len(logit_rows), vocab)
        status = self.library.manas_forward(
            ctypes.byref(self.bound), self._pool, rows, _int32s(tokens), _int32s(positions),
            (ManasCache * rows)(*caches), len(logit_rows), _int32s(logit_rows), logits.buffer, self._scratch)
        if status:
            raise RuntimeError(f"the native core failed with status {status}")
        return logits

    def __call__(self, idx):
        """GPT.forward without targets: the logits of every position of rows of token ids, each row from
        position 0: a Logits of (B·T, vocab) for lists, a (B, T, vocab) tensor for a tensor."""
        rows = idx.tolist() if hasattr(idx, "tolist") else idx
        B, T = len(rows), len(rows[0])
        logits = self.logits_from(rows, 0)
        return logits if rows is idx else logits.torch().view(B, T, -1)

    def last_logits(self, rows: list[list[int]]) -> Logits:
        """The logits of each row's last position, (B, vocab), each row from position 0."""
        return self.logits_from(rows, len(rows[0]) - 1)

    def logits_from(self, rows: list[list[int]], first: int) -> Logits:
        """The logits of positions first .. T − 1 of each row, (B·(T − first), vocab), each row from position 0."""
        if len(rows[0]) > self.config.block_size:
            raise ValueError(f"sequence of {len(rows[0])} tokens exceeds block_size {self.config.block_size}")
        session = NativeSession(self, "static", capacity=len(rows[0]))
        session.allocate(len(rows), len(rows[0]))
        return session.run_prompts(rows, first)

    def window_nats(self, window: list[int], targets: int, first_position: int) -> float:
        """engines.window_nats on the core: the log-softmax of each target, from the logits of the positions
        before it."""
        first = len(window) - targets - 1  # the position whose logits predict the first target
        logits = self.logits_from([window], first)  # rows first .. T − 1: the targets' predictions, and one more
        logprobs = (ctypes.c_double * targets)()
        bad = self.library.manas_target_logprobs(logits.row(0), targets, self.config.vocab_size,
                                                 _int32s(window[-targets:]), logprobs)
        if bad >= 0:
            raise NumericalError(logits_error(first_position + first + bad, "float32"))
        return -sum(logprobs)


def check_torch_model(model) -> None:
    embedding = model.token_embedding.weight
    if native_unsupported(model) is not None:
        raise ValueError(f"the native core runs float32 weights on the CPU, not {embedding.dtype} on {embedding.device}")


def native_unsupported(model) -> str | None:
    """Why the core cannot run this torch model, or None: it runs float32, int8 and int4 weights on the CPU."""
    weights = model.token_embedding.weight
    if weights.device.type != "cpu":
        return f"the model is on {weights.device.type.upper() if weights.device.type == 'cuda' else weights.device}"
    if str(weights.dtype) != "torch.float32":
        return f"the core runs float32, int8 and int4 weights, not {str(weights.dtype).removeprefix('torch.')}"
    return None


def torch_weights_name(model) -> str:
    from .quantize import weights_name

    return weights_name(model)


def _int32s(values: list[int]):
    return (c_int32 * len(values))(*values)


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
        size = self.capacity if self.reserve else min(self.capacity, max(needed, 2 * self.positions))
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
            ctypes.memmove(ctypes.addressof(into) + 4 * block * size * self.position_floats,
                           ctypes.addressof(old) + 4 * block * self.size * self.position_floats, span)

    def cache(self, row: int) -> ManasCache:
        return self._caches[row]

    def _row_cache(self, row: int) -> ManasCache:
        offset = 4 * row * self.model.config.n_layer * self.size * self.position_floats
        return ManasCache(ctypes.cast(ctypes.addressof(self.k) + offset, ctypes.POINTER(c_float)),
                          ctypes.cast(ctypes.addressof(self.v) + offset, ctypes.POINTER(c_float)), self.size)

    def prefill(self, token_ids):
        """CacheSession.prefill: reset, run the prompt's rows (B, T ≤ block_size); the logits of each row's last
        position: Logits (B, vocab), or a (B, 1, vocab) tensor for a tensor."""
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
        return logits if rows is token_ids else logits.torch()[:, None]

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
        return self.model.run([token for b in group for token in ids[b]], list(range(T)) * len(group), caches,
                              logit_rows)

    def decode(self, token_ids):
        """CacheSession.decode: append one position per row (a list of B ids, or a (B, 1) tensor); its logits."""
        tokens = decode_tokens(token_ids, self.positions, self.batch_size, self.block_size)
        logits = decode_rows(self.model, tokens, [self])
        return logits if tokens is token_ids else logits.torch()[:, None]

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

    @property
    def layers(self) -> list:
        """Per layer, K and V tensor views (B, n_kv_head, positions, head_size), as CacheSession's layers hold
        them (imports torch: for tests and inspection)."""
        import torch

        if self.k is None:
            return []
        config = self.model.config
        shape = (self.batch_size, config.n_layer, self.size, config.n_kv_head, config.head_size)
        k, v = (torch.frombuffer(buffer, dtype=torch.float32).view(shape) for buffer in (self.k, self.v))
        return [_LayerView(k[:, i, : self.positions].transpose(1, 2), v[:, i, : self.positions].transpose(1, 2))
                for i in range(config.n_layer)]


class _LayerView:
    def __init__(self, k, v) -> None:
        self.k, self.v = k, v


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


class NativeSampling:
    """The sampler's state for rows of one request on the core: each row's generation counts (for the
    frequency and presence penalties) and the scratch its draws share. Row b of a request draws its token at
    text position p with the uniform number Philox(seed; p, b) (core.c): a seeded text never depends on how
    requests were batched."""

    def __init__(self, model: NativeGPT, sampler: Sampler, rows: int, logprobs: int) -> None:
        self.library, self.vocab = model.library, model.config.vocab_size
        decodable = sampler.decodable
        self.drawable = self.vocab if decodable is None else min(len(decodable), self.vocab)
        everything = decodable is None or all(decodable[: self.drawable])
        self.mask = None if everything else (c_uint8 * self.drawable)(*decodable[: self.drawable])
        # The core's counts are 32-bit: each setting as what it means there (top-k of the whole vocabulary is no
        # filter; a penalty window longer than any context is the whole context; no more alternatives than ids).
        top_k = sampler.top_k if sampler.top_k and sampler.top_k < self.drawable else 0
        self.logprobs = min(logprobs, self.drawable)
        p = sampler.penalties
        self.settings = ManasSampler(sampler.temperature, top_k, 1.0 if sampler.top_p is None else sampler.top_p,
                                     sampler.min_p or 0.0, p.repetition, min(p.last_n, INT32_MAX), p.frequency,
                                     p.presence, sampler.seed, self.logprobs)
        self.counts = [(c_int32 * self.drawable)() for _ in range(rows)] if p.counts_needed else None
        self.last_n = p.last_n if p.context_needed else 0  # the window's tokens the core needs: these, or none
        self.scratch = ctypes.create_string_buffer(self.library.manas_sample_scratch_bytes(self.drawable))
        self.draw = ManasDraw()

    def sample(self, logits: Logits, windows: list[list[int]], position: int) -> tuple[list[int], list | None]:
        """Each row's next token from its logits, and with logprobs (its log-probability, the most likely ids,
        theirs). position: the text position the logits follow (0 is the first token): the new token's position
        less one, and the one an error names when they are not finite."""
        tokens, top = [], [] if self.logprobs else None
        for b, window in enumerate(windows):
            draw, context = self.draw, window[-self.last_n:] if self.last_n > 0 else window
            counts = self.counts[b] if self.counts is not None else None
            if self.library.manas_sample(ctypes.byref(self.settings), logits.row(b), self.vocab, self.drawable,
                                         self.mask, _int32s(context) if self.last_n else None, len(context), counts,
                                         b, position + 1, self.scratch, ctypes.byref(draw)):
                raise NumericalError(logits_error(position, "float32"))
            tokens.append(draw.token)
            if top is not None:
                top.append((draw.logprob, list(draw.top_ids[: self.logprobs]), list(draw.top_logprobs[: self.logprobs])))
        return tokens, top
