"""Continuous batching: many independent requests decoded together, each row at its own position, with its own
cache, sampler and stopping point; when a row finishes, the next request takes its place (as vLLM and llama.cpp's
server do).

The decode steps of the rows run as one forward pass: the projections read each weight once for every row, and
attention runs row by row over that row's own cache. On the native engine the prompts of the requests that start
at a step run in that same pass (up to JOINT_ROWS tokens; a longer one is prefilled alone), so a new request costs
its prompt's arithmetic, not another pass over the weights; on torch each is prefilled alone. Each re-prefill of a
window runs alone, exactly as `generate` does it. Each row's numbers are those of the request alone: on the native
engine bit for bit (its products sum each row in the same order whatever rows share a call); on torch, a matrix
product over several rows may sum in another order than over one (the last bit of a float32), which can flip a
near tie.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from ..errors import ConstraintError, NumericalError
from .engines import Engine
from .generation import overflow_keep, slide
from .prefix_cache import PrefixCache
from .sampling import Sampler
from .session import prefill_if_due
from .speculation import DEFAULT_DRAFT_MAX, Propose, next_draft_max


@dataclass(frozen=True)
class Request:
    key: int  # the caller's name for it
    prompt: list[int]  # token ids, at most block_size of them
    sampler: Sampler
    max_tokens: int
    logprobs: int = 0
    proposer: Callable[[], Propose] | None = None  # speculative decoding: the row's own proposer (speculation.py)
    draft_max: int = DEFAULT_DRAFT_MAX


@dataclass(frozen=True)
class Token:
    """One request's new token, and how it was computed."""

    key: int
    token: int
    kind: str  # "prefill", "re_prefill" or "decode"
    seconds: float  # the step that made it (a decode step makes every decoding row's token at once)
    logprobs: tuple[float, list[int], list[float]] | None
    last: bool  # its budget is spent, or it is end-of-text, or it failed
    cache: object  # the row's cache (CacheSession or NativeSession), for what it holds once the request is done
    error: str | None = None  # why this request failed (its logits were not finite, its grammar); token is then -1
    speculated: tuple[int, int] | None = None  # on a check's last token: (proposed, accepted) tokens


class Row:
    """A request in the batch: its cache, its token window and its sampling state, as generate keeps them."""

    def __init__(self, engine: Engine, request: Request, eot_id: int | None) -> None:
        self.request, self.eot_id = request, eot_id
        self.session = engine.new_session()
        self.window = request.prompt[-engine.config.block_size :]
        self.prompt_length = len(self.window)
        self.state = engine.sampling_state(request.sampler, 1, request.logprobs)
        self.steps = 0
        self.propose = request.proposer() if request.proposer is not None else None
        self.draft_max = request.draft_max  # the tokens its next check may take (speculation.next_draft_max)

    def proposal(self) -> list[int]:
        """The tokens this decoding row's proposer guesses follow, as generate_speculative asks for them: never past
        the window or the budget; none without a proposer."""
        room = min(self.session.block_size - self.session.positions - 1, self.request.max_tokens - self.steps - 1)
        if self.propose is None or room <= 0:
            return []
        return self.propose(self.window, len(self.request.prompt) - 1 + self.steps, min(self.draft_max, room))

    def take_checked(self, logits, proposal: list[int], started: float) -> list[Token]:
        """The tokens a check gives (its logits: the last token's, then each proposed one's): each drawn as take
        draws it, kept while it is the proposal's; the cache rewound past the first that is not."""
        first, made = self.session.positions - len(proposal) - 1, []
        for i in range(len(proposal) + 1):
            made.append(self.take(logits[i : i + 1], "decode", started))
            kept = i < len(proposal) and made[-1].token == proposal[i]
            if not kept or made[-1].last:
                break
        self.session.rewind(first + i + 1)
        self.draft_max = next_draft_max(self.draft_max, self.request.draft_max, len(proposal), i + kept)
        made[-1] = replace(made[-1], speculated=(len(proposal), i + kept))
        return made

    def start(self, prefixes: PrefixCache | None) -> list[int]:
        """The first step's tokens still to run: the window, or, where the prefix cache holds its start (an engine
        whose sessions take snapshots: the native one), what follows that start, once it is copied in."""
        keep, snapshot = prefixes.find(self.window) if self.reuses(prefixes) else (0, None)
        if snapshot is not None:
            self.session.restore(snapshot, keep, len(self.window))
        return self.window[keep:]

    def started(self, prefixes: PrefixCache | None) -> None:
        """The prefilled window kept for later requests."""
        if self.reuses(prefixes):
            prefixes.add(self.window, self.session.snapshot())

    def reuses(self, prefixes: PrefixCache | None) -> bool:
        return prefixes is not None and hasattr(self.session, "snapshot")

    def prefill(self, prefixes: PrefixCache | None) -> tuple[str, object]:
        """The first step alone: start, the rest prefilled, started."""
        keep = len(self.window) - len(self.start(prefixes))
        logits = self.session.extend([self.window], keep) if keep else self.session.prefill([self.window])
        self.started(prefixes)
        return "prefill", logits

    def hand_over(self, prefixes: PrefixCache) -> None:
        """Once the request is done, its cache into the prefix cache, moved rather than copied: the prompt and the
        answer, which a chat's next turn starts with. Only where the window never slid (nor re-prefilled), so the
        cache holds its tokens but the last from position 0."""
        cached = self.window[:-1]
        if self.prompt_length + self.steps == len(self.window) and self.session.positions == len(cached):
            prefixes.add(cached, self.session.hand_over())

    def take(self, logits, kind: str, started: float) -> Token:
        """Sample this row's next token from its logits (one row)."""
        position = len(self.request.prompt) - 1 + self.steps
        try:
            (token,), top = self.state.sample(logits, [self.window], position)
        except (NumericalError, ConstraintError) as exc:  # this request's, not the engine's: the other rows go on
            return Token(self.request.key, -1, kind, time.perf_counter() - started, None, True, self.session, str(exc))
        seconds = time.perf_counter() - started
        self.window = slide(self.window, token, self.session.block_size)
        self.steps += 1
        last = self.steps == self.request.max_tokens or token == self.eot_id
        return Token(self.request.key, token, kind, seconds, top[0] if top else None, last, self.session)


# The most prompt tokens a step runs beside its decode rows in one call (a longer prompt is prefilled on its own):
# the call's scratch holds every row's activations, and a few steps' worth of prompts keeps it to megabytes.
JOINT_ROWS = 1024


def joins(engine: Engine, joining: list[Row], row: Row) -> bool:
    """Whether a new request's prompt runs in the step's one call with the decode rows and the other new prompts:
    on an engine that runs them together (native), within JOINT_ROWS."""
    return hasattr(engine, "run_rows") and sum(len(r.window) for r in joining) + len(row.window) <= JOINT_ROWS


def generate_batched(
    engine: Engine,
    take: Callable[[bool], Request | None],
    batch_size: int,
    eot_id: int | None = None,
    overflow: str = "recompute",
    finished: Callable[[int], bool] = lambda key: False,
    prefixes: PrefixCache | None = None,
) -> Iterator[list[Token]]:
    """Yield, step after step, the new tokens of up to batch_size requests decoding together.

    take(wait) gives the next request, or None: with wait, None only once there are no more; without, None also
    when none has come yet. Requests are taken as rows free up, waiting only when no row is decoding, so a request
    is never held back for one that has not arrived. finished(key) lets the caller end a request early (a stop
    string), checked after each step. prefixes: an exact prefix cache for the prompts' prefills."""
    keep = overflow_keep(overflow, engine.config.block_size)
    rows: list[Row] = []
    while True:
        while len(rows) < batch_size and (request := take(not rows)) is not None:
            rows.append(Row(engine, request, eot_id))
        if not rows:
            return
        started = time.perf_counter()
        made, decoding, joining, proposals = {}, [], [], {}
        for row in rows:
            if row.steps == 0 and joins(engine, joining, row):
                joining.append(row)
                continue
            due = row.prefill(prefixes) if row.steps == 0 else prefill_if_due(row.session, [row.window], False, keep)
            if due is None:
                decoding.append(row)
                if proposal := row.proposal():
                    proposals[row] = proposal
            else:
                made[row] = [row.take(due[1], due[0], started)]
        if joining or proposals:
            parts = [(row.session, [row.window[-1], *proposals.get(row, [])]) for row in decoding]
            checks = [index for index, row in enumerate(decoding) if row in proposals]
            logits = engine.run_rows(parts + [(row.session, row.start(prefixes)) for row in joining], checks)
            for row in joining:
                row.started(prefixes)
        elif decoding:
            logits = engine.decode_rows([row.window[-1] for row in decoding], [row.session for row in decoding])
        index = 0  # each row's first logits row: a check has one per token it ran, any other row one
        for row in decoding + joining:
            if row in proposals:
                made[row] = row.take_checked(logits[index:], proposals[row], started)
                index += len(proposals[row]) + 1
            else:
                made[row] = [row.take(logits[index : index + 1], "decode" if row.steps else "prefill", started)]
                index += 1
        yield [token for row in rows for token in made[row]]
        done = [row for row in rows if made[row][-1].last or finished(row.request.key)]
        for row in done:
            if row.reuses(prefixes) and made[row][-1].error is None:
                row.hand_over(prefixes)
        rows = [row for row in rows if row not in done]
