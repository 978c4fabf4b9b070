"""Generation that stays exact past the context window, and the crop-and-recompute reference it must equal. Free
of torch: token ids are lists, and each engine's session and sampling state (engines.Engine) do the arithmetic."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .engines import Engine
from .sampling import Sampler
from .session import prefill_if_due

OVERFLOW_POLICIES = ("recompute", "shift")


@dataclass(frozen=True)
class Step:
    """One new token per batch row, and how it was computed."""

    tokens: list[int]
    kind: (
        str  # "prefill" (the prompt), "re_prefill" (the window was full), "decode" (from the cache), "full" (uncached)
    )
    positions: int  # positions the model attended over for this token
    seconds: float  # forward pass and sampling, synchronized
    # With logprobs: per row, the token's log-probability and the most likely ids with theirs (sampling.top_logprobs)
    logprobs: list[tuple[float, list[int], list[float]]] | None = None
    speculated: tuple[int, int] | None = None  # on a speculative check's last token: (proposed, accepted) tokens


def crop_window(rows: list[list[int]], block_size: int) -> list[list[int]]:
    """The last block_size tokens of each row: all the context a model with absolute positions can see."""
    return [row[-block_size:] for row in rows]


def prompt_batch(ids: list[int], batch_size: int) -> list[list[int]]:
    """One prompt repeated for batch_size rows."""
    return [list(ids) for _ in range(batch_size)]


def token_rows(prompt) -> list[list[int]]:
    """A prompt's rows of token ids: lists as they are, a (B, T) tensor as lists; never empty."""
    rows = prompt.tolist() if hasattr(prompt, "tolist") else prompt
    if not rows or not isinstance(rows[0], list) or not rows[0] or any(len(row) != len(rows[0]) for row in rows):
        shape = tuple(prompt.shape) if hasattr(prompt, "shape") else f"{len(rows)} rows"
        raise ValueError(f"the prompt must be a non-empty (B, T) batch of token ids, got shape {shape}")
    return rows


def slide(window: list[int], token: int, block_size: int) -> list[int]:
    """The window once `token` follows it: only its last block_size tokens can ever be seen again (a sequence of
    every token would make each step O(length))."""
    return (window + [token])[-block_size:]


def overflow_keep(overflow: str, block_size: int) -> int:
    """How many of the window's last tokens a full cache re-prefills under the overflow policy."""
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}, got {overflow!r}")
    return block_size if overflow == "recompute" else max(1, block_size // 2)


# A step's forward pass: (first step?, the rows' windows) -> (Step.kind, the logits, the positions attended over).
Forward = Callable[[bool, list[list[int]]], tuple[str, object, int]]


def generate(
    engine: Engine,
    prompt,
    sampler: Sampler,
    max_new_tokens: int,
    eot_id: int | None = None,
    overflow: str = "recompute",
    session=None,
    logprobs: int = 0,
    reuse: int = 0,
) -> Iterator[Step]:
    """Yield max_new_tokens steps (fewer if every row has produced eot_id) from a KV cache, on either engine
    (prompt: (B, T) token ids, lists or a tensor).

    reuse=K: the session's cache already holds the prompt's first K tokens (a conversation's earlier turns): the
    prefill runs only the rest (session.extend), with the logits of a whole prefill.

    overflow="recompute": when the cache is full, prefill the last block_size tokens, so every token equals
    crop-and-recompute's. overflow="shift": prefill only the last block_size // 2, buying that many cached decode
    steps at the price of exactness (the model then sees a shorter context than the reference does).
    logprobs=N adds each token's log-probability and the N most likely alternatives to every step.
    """
    keep = overflow_keep(overflow, engine.config.block_size)
    session = session or engine.new_session()

    def cached(first: bool, windows: list[list[int]]) -> tuple[str, object, int]:
        if first and reuse:
            return "prefill", session.extend(windows, reuse), session.positions
        kind, logits = prefill_if_due(session, windows, first, keep) or (
            "decode",
            session.decode([window[-1] for window in windows]),
        )
        return kind, logits, session.positions

    yield from _sampled(engine, prompt, sampler, max_new_tokens, eot_id, logprobs, cached)


def generate_reference(
    engine: Engine, prompt, sampler: Sampler, max_new_tokens: int, eot_id: int | None = None, logprobs: int = 0
) -> Iterator[Step]:
    """nanoGPT's crop-and-recompute sampling: the full model over the last block_size tokens at every step."""

    def full(first: bool, windows: list[list[int]]) -> tuple[str, object, int]:
        return "full", engine.last_logits(windows), len(windows[0])

    yield from _sampled(engine, prompt, sampler, max_new_tokens, eot_id, logprobs, full)


def _sampled(
    engine: Engine, prompt, sampler: Sampler, max_new_tokens: int, eot_id: int | None, logprobs: int, forward: Forward
) -> Iterator[Step]:
    """The loop both generators share: forward, sample each row's token, slide its window, until the budget is
    spent or every row has ended."""
    rows = token_rows(prompt)
    block_size = engine.config.block_size
    windows = crop_window(rows, block_size)
    state = engine.sampling_state(sampler, len(rows), logprobs)
    finished = [False] * len(rows)
    for step in range(max_new_tokens):
        started = time.perf_counter()
        kind, logits, positions = forward(step == 0, windows)
        tokens, top = state.sample(logits, windows, len(rows[0]) - 1 + step)
        seconds = time.perf_counter() - started
        windows = [slide(window, token, block_size) for window, token in zip(windows, tokens)]
        yield Step(tokens, kind, positions, seconds, top)
        if _all_finished(finished, tokens, eot_id):
            return


def _all_finished(finished: list[bool], tokens: list[int], eot_id: int | None) -> bool:
    """Rows keep decoding after their own end (they share one cache); stop once every row has ended."""
    if eot_id is None:
        return False
    for row, token in enumerate(tokens):
        finished[row] = finished[row] or token == eot_id
    return all(finished)


@dataclass
class GenerationStats:
    """Speed and work counters accumulated from the steps of one run."""

    prompt_tokens: int
    batch_size: int = 1
    steps: int = 0
    ttft_s: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    re_prefills: int = 0
    proposed_tokens: int = 0  # speculative decoding's proposals, those the model drew itself, and its checks
    accepted_tokens: int = 0
    checks: int = 0
    # Kept only when asked for (inspect-cache shows them): past the window, recompute re-prefills at every step.
    re_prefill_positions: list[int] | None = None

    def update(self, step: Step) -> None:
        if step.speculated is not None:
            self.proposed_tokens += step.speculated[0]
            self.accepted_tokens += step.speculated[1]
            self.checks += 1
        if self.steps == 0:
            self.ttft_s = self.prefill_seconds = step.seconds
        else:
            self.decode_seconds += step.seconds
            self.decode_steps += 1
            if step.kind == "re_prefill":
                self.re_prefills += 1
                if self.re_prefill_positions is not None:
                    self.re_prefill_positions.append(self.prompt_tokens + self.steps)
        self.steps += 1

    @property
    def generated_tokens(self) -> int:
        return self.steps

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens * self.batch_size / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first, re-prefills included: what a user waits for."""
        return self.decode_steps * self.batch_size / self.decode_seconds if self.decode_seconds else 0.0
