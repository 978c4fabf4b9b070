"""Sampling on the native engine: sampling.Sampler's settings, drawn by the core (core.c, "sampling")."""

from __future__ import annotations

import ctypes
from ctypes import c_int32, c_uint8
from functools import partial

from ..engine.constraints import Constraints
from ..engine.sampling import Sampler, logits_error
from ..errors import NumericalError
from .binding import ManasDraw, ManasRow, ManasSampler
from .model import Logits, NativeGPT, int32s

INT32_MAX = 2**31 - 1
GREEDY = ManasSampler(0.0, 0, 1.0, 0.0, 1.0, 0, 0.0, 0.0, 0, 0)  # temperature 0, no filter, no penalty


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
        self.settings = ManasSampler(
            sampler.temperature,
            top_k,
            1.0 if sampler.top_p is None else sampler.top_p,
            sampler.min_p or 0.0,
            p.repetition,
            min(p.last_n, INT32_MAX),
            p.frequency,
            p.presence,
            sampler.seed,
            self.logprobs,
        )
        self.counts = [(c_int32 * self.drawable)() for _ in range(rows)] if p.counts_needed else None
        self.last_n = p.last_n if p.context_needed else 0  # the window's tokens the core needs: these, or none
        self.scratch = ctypes.create_string_buffer(self.library.manas_sample_scratch_bytes(self.drawable))
        self.draw = ManasDraw()
        self.constraints = Constraints(sampler.grammar, rows) if sampler.grammar is not None else None

    def _mask(self, row: ManasRow):
        """The ids row may draw: the decodable ones, or those its structured output allows next (never an id
        without a token: structured.Vocabulary marks them special)."""
        if self.constraints is None:
            return self.mask
        allowed = self.constraints.allowed(row.row, self.drawable, partial(self._most_likely, row))
        return (c_uint8 * self.drawable).from_buffer_copy(allowed)

    def _most_likely(self, row: ManasRow) -> int:
        """The decodable id of the row's highest logit, before any setting (the core's greedy draw)."""
        plain = ManasRow(row.logits, None, 0, None, row.row, row.position)
        draw = ManasDraw()
        self.library.manas_sample(
            ctypes.byref(GREEDY), ctypes.byref(plain), self.vocab, self.drawable, self.mask, self.scratch,
            ctypes.byref(draw),
        )  # fmt: skip
        return draw.token

    def sample(self, logits: Logits, windows: list[list[int]], position: int) -> tuple[list[int], list | None]:
        """Each row's next token from its logits, and with logprobs (its log-probability, the most likely ids,
        theirs). position: the text position the logits follow (0 is the first token): the new token's position
        less one, and the one an error names when they are not finite."""
        tokens, top = [], [] if self.logprobs else None
        for b, window in enumerate(windows):
            draw, context = self.draw, window[-self.last_n :] if self.last_n > 0 else window
            counts = self.counts[b] if self.counts is not None else None
            window = int32s(context) if self.last_n else None
            row = ManasRow(logits.row(b), window, len(context), counts, b, position + 1)
            if self.library.manas_sample(
                ctypes.byref(self.settings),
                ctypes.byref(row),
                self.vocab,
                self.drawable,
                self._mask(row),
                self.scratch,
                ctypes.byref(draw),
            ):
                raise NumericalError(logits_error(position, "float32"))
            if self.constraints is not None:
                self.constraints.accept(b, draw.token)
            tokens.append(draw.token)
            if top is not None:
                top.append(
                    (draw.logprob, list(draw.top_ids[: self.logprobs]), list(draw.top_logprobs[: self.logprobs]))
                )
        return tokens, top
