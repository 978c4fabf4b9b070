"""The server's one engine: a thread that runs the continuous-batching generator of `--jsonl` over the requests
the HTTP threads submit, and hands each request's tokens back to the thread that waits for them.

Each choice of a request is one row, at its own position in its own cache (batching.py), so a response equals
`manas generate --json` for that request alone. A choice whose client has gone, or that a stop string ended, is
dropped from the batch at the next step.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from ...requests import Prepared, Requests
from ...settings import GenerationSettings


class QueueFull(Exception):
    """More requests are waiting than the server holds: the client should retry later."""


@dataclass(frozen=True)
class Released:
    """Text a choice's tokens released (empty while a multi-byte character is incomplete), and the token's
    logprob entry when the request asked for logprobs."""

    index: int  # the choice's
    text: str
    entry: dict | None


@dataclass(frozen=True)
class Ended:
    """The last event of a choice, sent once, whatever ended it (see Choice.error)."""

    index: int


@dataclass
class Choice:
    """One row of a request: its prompt and settings in, its text and tokens out, through `events`."""

    index: int
    prompt_ids: list[int]
    request: Prepared  # its seed, sampler and text stream
    # A Released per token, then one Ended; the choices of one request share their queue
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: bool = False
    ended: bool = False
    error: str | None = None  # why the engine could not finish it (its logits were not finite, a shutdown)
    error_status: int = 500
    first_token_s: float | None = None  # time.monotonic() when the prefill's token was sampled
    proposed_tokens: int = 0  # speculative decoding's proposals, and those kept
    accepted_tokens: int = 0

    @property
    def stream(self):
        return self.request.streams[0]

    @property
    def done(self) -> bool:
        return self.cancelled or self.stream.finished

    def send(self, text: str, entry: dict | None) -> None:
        self.events.put(Released(self.index, text, entry))

    def end(self) -> None:
        """The last event of the choice, sent once whatever ended it."""
        if not self.ended:
            self.ended = True
            self.events.put(Ended(self.index))


class Scheduler:
    """Runs generate_batched on its own thread. submit() queues choices; each choice's events carry its text as
    it is released, then None once it is done (budget, end-of-text, stop string, or cancelled)."""

    def __init__(
        self,
        engine,
        checkpoint,
        batch_size: int,
        max_queued: int,
        overflow: str = "recompute",
        prefix_cache_bytes: int = 0,
        draft=None,
        speculative=None,
    ) -> None:
        """draft: the server's draft model (serve --draft-model); speculative: what a request that says nothing of
        it runs (settings.Speculation: serve --lookup, --draft-model)."""
        from ...engine.prefix_cache import PrefixCache

        self.engine, self.checkpoint = engine, checkpoint
        self.prefixes = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None
        self.batch_size, self.max_queued, self.overflow = batch_size, max_queued, overflow
        self.requests = Requests(engine, checkpoint.encoding, draft, speculative)
        self._waiting: queue.Queue[Choice] = queue.Queue()
        self._running: dict[int, Choice] = {}
        self._keys = iter(range(1, 1 << 62))
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.error: BaseException | None = None  # what ended the engine thread, if anything did
        self._thread = threading.Thread(target=self._run, name="manas-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def new_choice(self, index: int, prompt_ids: list[int], settings: GenerationSettings, grammar=None) -> Choice:
        """A choice of a request; a request without a seed gets a fresh one, as generate does. grammar:
        settings.format compiled (Requests.grammar)."""
        return Choice(index, prompt_ids, self.requests.prepare(settings, grammar=grammar))

    def submit(self, choices: list[Choice]) -> None:
        """Queue a request's choices together, or refuse them all when the queue is full."""
        with self._lock:
            if self._waiting.qsize() + len(choices) > self.max_queued:
                raise QueueFull(f"{self._waiting.qsize()} requests are waiting already")
            if self._stopping.is_set():
                raise QueueFull("the server is shutting down")
            for choice in choices:
                self._waiting.put(choice)

    @property
    def rows(self) -> int:
        """Choices decoding."""
        return len(self._running)

    @property
    def queued(self) -> int:
        return self._waiting.qsize()

    @property
    def busy(self) -> int:
        return self.rows + self.queued

    @property
    def failure(self) -> str | None:
        """Why the engine thread is no longer running, or None while it runs (or has not started)."""
        if self.error is not None:
            return f"the engine stopped: {self.error}"
        if self._thread.ident is not None and not self._thread.is_alive() and not self._stopping.is_set():
            return "the engine stopped"
        return None

    def stop(self) -> None:
        """Take no more requests; end the engine thread once the batch is empty."""
        self._stopping.set()

    def cancel_all(self) -> None:
        """Cut every choice (a shutdown's deadline): each is answered as cut, never as finished."""
        for choice in list(self._running.values()):
            self._cut(choice)
        while True:
            try:
                choice = self._waiting.get_nowait()
            except queue.Empty:
                break
            self._cut(choice)
            choice.end()

    def _cut(self, choice: Choice) -> None:
        if not choice.stream.finished and choice.error is None:  # an engine that died says so, a shutdown so
            choice.error, choice.error_status = self.failure or "the server shut down before this choice finished", 503
        choice.cancelled = True

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _take(self, wait: bool):
        """generate_batched's take: the next waiting choice as a Request; waiting only when no row decodes."""

        while True:
            try:
                choice = self._waiting.get(timeout=0.1) if wait else self._waiting.get_nowait()
            except queue.Empty:
                if not wait or self._stopping.is_set():
                    return None
                continue
            if choice.cancelled:
                choice.end()
                continue
            key = next(self._keys)
            self._running[key] = choice
            return choice.request.request(key, choice.prompt_ids)

    def _finished(self, key: int) -> bool:
        choice = self._running.get(key)  # _deliver lets go of a choice once it is done
        return choice is None or choice.done

    def _run(self) -> None:
        from ...engine.batching import generate_batched

        steps = generate_batched(
            self.engine, self._take, self.batch_size, self.requests.eot, self.overflow, self._finished, self.prefixes
        )
        try:
            for tokens in steps:
                for made in tokens:
                    self._deliver(made)
        except BaseException as exc:  # the engine failed: every waiting client gets an error, not a hang
            self.error = exc
            self.cancel_all()
        finally:
            steps.close()
            for choice in self._running.values():
                choice.end()
            self._running.clear()

    def _deliver(self, made) -> None:
        """A row's new token to its choice; a done choice leaves the batch (generate_batched asks _finished)."""
        choice = self._running.get(made.key)
        if choice is None:  # done at an earlier token of the same speculative check (a stop string)
            return
        if made.error is not None:
            choice.error = made.error
        if choice.cancelled or choice.error is not None:
            self._running.pop(made.key).end()
            return
        if choice.first_token_s is None:
            choice.first_token_s = time.monotonic()
        if made.speculated is not None:
            choice.proposed_tokens += made.speculated[0]
            choice.accepted_tokens += made.speculated[1]
        stream = choice.stream
        entries_before = len(stream.logprobs)
        text = stream.feed(made.token, made.logprobs)
        entry = stream.logprobs[-1] if len(stream.logprobs) > entries_before else None
        if made.last and not stream.finished:
            text += stream.finish("length")
        choice.send(text, entry)
        if stream.finished:
            self._running.pop(made.key)
            choice.end()
