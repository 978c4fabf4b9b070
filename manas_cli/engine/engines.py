"""The one interface generation, batching, scoring, bench and the server call, whichever engine runs the model:
the native core (native/engine.py) or torch (torch_engine/engine.py). An engine is opened by manas_cli/models.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .config import GPTConfig
from .sampling import Sampler

ENGINES = ("auto", "native", "torch")


class Engine(Protocol):
    """A loaded model and what runs it. Logits are the engine's own rows: a tensor on torch, native/model.Logits
    on the core; both slice as rows (`logits[i : i + 1]`) and go back only to the engine's own sampling state."""

    name: str  # "native" or "torch"
    config: GPTConfig
    weights: str  # "float32", "bfloat16", "float16", "int8" or "int4"
    arithmetic_version: int | None  # native: the core's (a seeded text depends on it, docs/native.md); torch: None
    device: str  # "cpu", "cuda", "cuda:1"
    dtype: str  # what the activations compute in
    activation_bytes: int  # bytes of one activation value (memory.check_fits)

    @property
    def threads(self) -> int: ...  # the threads it computes on now

    def set_threads(self, threads: int) -> None: ...

    @property
    def weights_bytes(self) -> int: ...

    def new_session(self, allocation: str = "dynamic", capacity: int | None = None):
        """The KV cache of one request (engine/session.py's rules): prefill(rows), decode(tokens), positions; and
        where its checks of several tokens give each step's bits (the core's), check(tokens) and rewind(positions)
        for speculative decoding (speculation.py)."""

    def sampling_state(self, sampler: Sampler, rows: int, logprobs: int):
        """What sampling keeps for a request's rows between steps: sample(logits, windows, position)."""

    def generator(self, seed: int):
        """The sampler's seeded generator where the engine draws with one (torch), else None (the core keys its
        own on Sampler.seed)."""

    def decode_rows(self, tokens: list[int], sessions: list):
        """One decode step for the rows of several sessions at once (batching.py): their logits, in order."""

    def last_logits(self, windows: list[list[int]]):
        """The full model's logits of each row's last position, each row from position 0 (the uncached reference)."""

    def window_nats(self, window: list[int], targets: int, first_position: int = 0) -> float:
        """The summed negative log-likelihood of a window's last `targets` tokens, each given the tokens before it;
        first_position: the window's first token's position in the text (for the error when logits are not
        finite)."""

    def beside_torch(self, torch_module) -> None:
        """Settle the torch model it was opened from (a loaded checkpoint's): the core runs it with torch's own
        threads idle; torch lays its float weights out for decoding."""

    def free_memory_bytes(self) -> int | None: ...

    def peak_memory_bytes(self) -> int: ...


@dataclass(frozen=True)
class Opened:
    """An engine, and what the CLI should say about how it was chosen."""

    engine: Engine
    notice: str | None = None  # native was asked for and cannot run, or its cache folder was refused
    detail: str = ""  # the compiler's or loader's own message, for --debug
    compile_s: float | None = None  # this run compiled the core
    library: str | None = None  # the core's shared library
