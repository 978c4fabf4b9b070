"""The native engine (engine/engines.py's Engine): the core computes every step and samples its tokens. It
computes each position's row with the same kernels and the same order of arithmetic whether it is decoded alone,
prefilled among a prompt's rows or decoded beside other requests, so on this engine cached == recompute and
batched == alone hold bit for bit."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from ..engine.memory import cpu_available_bytes, process_peak_bytes
from ..engine.sampling import Sampler, logits_error
from ..errors import NumericalError
from .model import Logits, NativeGPT, int32s
from .sampling import NativeSampling
from .session import NativeSession, decode_rows, run_rows


class NativeEngine:
    name, device, dtype = "native", "cpu", "float32"
    activation_bytes = 4  # the core computes in float32 whatever the weights

    def __init__(self, model: NativeGPT) -> None:
        self.model, self.config = model, model.config
        self.weights, self.weights_bytes = model.weights, model.weights_bytes
        self.arithmetic_version: int | None = model.library.manas_arithmetic_version()

    @property
    def threads(self) -> int:
        return self.model.threads

    def set_threads(self, threads: int) -> None:
        self.model.set_threads(threads)

    def beside_torch(self, torch_module) -> None:
        """The core computes and samples: torch's OpenMP workers would only spin beside it. (Passed in: this
        engine never imports torch.)"""
        torch_module.set_num_threads(1)

    def new_session(self, allocation: str = "dynamic", capacity: int | None = None) -> NativeSession:
        return NativeSession(self.model, allocation, capacity)

    def sampling_state(self, sampler: Sampler, rows: int, logprobs: int) -> NativeSampling:
        return NativeSampling(self.model, sampler, rows, logprobs)

    def generator(self, seed: int) -> None:
        """None: the core keys its own counter-based generator on the sampler's seed."""
        return None

    def decode_rows(self, tokens: list[int], sessions: list[NativeSession]) -> Logits:
        return decode_rows(self.model, tokens, sessions)

    def run_rows(self, rows: list[tuple[NativeSession, list[int]]], checks: Sequence[int] = ()) -> Logits:
        """A continuous batch's step in one call: decode rows, speculative checks and new prompts together
        (session.run_rows)."""
        return run_rows(self.model, rows, checks)

    def last_logits(self, windows: list[list[int]]) -> Logits:
        """The logits of each row's last position, (B, vocab), each row from position 0."""
        return self.logits_from(windows, len(windows[0]) - 1)

    def logits_from(self, rows: list[list[int]], first: int) -> Logits:
        """The logits of positions first .. T − 1 of each row, (B·(T − first), vocab), each row from position 0."""
        if len(rows[0]) > self.config.block_size:
            raise ValueError(f"sequence of {len(rows[0])} tokens exceeds block_size {self.config.block_size}")
        session = NativeSession(self.model, "static", capacity=len(rows[0]))
        session.allocate(len(rows), len(rows[0]))
        return session.run_prompts(rows, first)

    def window_nats(self, window: list[int], targets: int, first_position: int = 0) -> float:
        """The log-softmax of each target, from the logits of the positions before it."""
        first = len(window) - targets - 1  # the position whose logits predict the first target
        logits = self.logits_from([window], first)  # rows first .. T − 1: the targets' predictions, and one more
        logprobs = (ctypes.c_double * targets)()
        bad = self.model.library.manas_target_logprobs(
            logits.row(0), targets, self.config.vocab_size, int32s(window[-targets:]), logprobs
        )
        if bad >= 0:
            raise NumericalError(logits_error(first_position + first + bad, "float32"))
        return -sum(logprobs)

    def free_memory_bytes(self) -> int | None:
        """Free memory less the weights read from a file's pages (a GGUF's blocks in place): the kernel counts
        those as reclaimable cache, but every step reads them."""
        available = cpu_available_bytes()
        return None if available is None else max(0, available - self.model.mapped_bytes)

    def peak_memory_bytes(self) -> int:
        """The whole process's peak resident memory."""
        return process_peak_bytes()
