"""A model's loss on a text, with a sliding window: each token scored once, with as much context before it as the
window holds, as Hugging Face's perplexity guide computes it (llama.cpp's `llama-perplexity` scores only the second
half of non-overlapping windows, so its figures differ)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .engines import Engine


@dataclass(frozen=True)
class Score:
    nats: float  # the summed negative log-likelihood of the tokens scored
    tokens: int  # tokens scored: all but the first (and, with stride = block_size, each window's first)
    characters: int

    @property
    def nats_per_token(self) -> float:
        return self.nats / self.tokens

    @property
    def nats_per_char(self) -> float:
        return self.nats / self.characters

    @property
    def perplexity(self) -> float:
        return math.exp(self.nats_per_token)


def windows(length: int, block_size: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, targets) of each window: windows of up to block_size tokens whose ends advance by stride; the
    last `targets` tokens of each are scored (the ones no earlier window scored). A window's first token has no
    context in it: with stride = block_size it is never scored, as in Hugging Face's guide."""
    spans, scored_to = [], 1  # the first token has no context to be predicted from: scoring starts at the second
    for begin in range(0, length, stride):
        end = min(begin + block_size, length)
        targets = min(end - scored_to, end - begin - 1)
        if targets > 0:  # a last window of one token (stride = block_size) holds nothing to score
            spans.append((begin, end, targets))
        scored_to = end
        if end == length:
            break
    return spans


def score(
    engine: Engine, ids: list[int], characters: int, stride: int, on_window: Callable[[int], None] = lambda tokens: None
) -> Score:
    """The model's loss on the token ids of a text of `characters` characters;
    on_window(tokens scored) after each window (a progress bar). stride must be between 1 and block_size."""
    if len(ids) < 2:
        raise ValueError("a text of fewer than 2 tokens has nothing to score")
    nats, scored = 0.0, 0
    for begin, end, targets in windows(len(ids), engine.config.block_size, stride):
        nats += engine.window_nats(ids[begin:end], targets, begin)
        scored += targets
        on_window(targets)
    return Score(nats, scored, characters)
