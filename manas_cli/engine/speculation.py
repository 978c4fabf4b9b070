"""Speculative decoding by prompt lookup that changes nothing: the tokens that followed the text's last n-gram where it
occurred before are proposed, the model checks them all in one pass over the cache, and each is kept only where it
is the token the model draws there itself. The text is the one plain decoding gives, token for token.

It holds because the native core's pass over k + 1 positions gives each position the logits a decode step of it
gives, bit for bit (each position's arithmetic reads only its own past, as a prefill's rows do), and its sampler
draws a position's token from Philox keyed on the seed and that position (docs/native.md): a token drawn inside a
check is the one a step would have drawn. Penalties' counts and a grammar's state advance with each token drawn,
which is every token kept and the first one that differs, as plain decoding draws them."""

from __future__ import annotations

import time
from collections.abc import Iterator

from .engines import Engine
from .generation import Step, crop_window, overflow_keep, slide, token_rows
from .sampling import Sampler
from .session import prefill_if_due

DEFAULT_DRAFT_MAX = 4  # proposed tokens a check: the verify pass's cost grows with them, and a long guess fails sooner


def lookup_proposal(tokens: list[int], ngram: int, most: int) -> list[int]:
    """Up to `most` tokens that followed the latest earlier occurrence of the tokens' last n-gram, trying n from
    `ngram` down to 1 (prompt lookup, as transformers' prompt_lookup_num_tokens and vLLM's ngram propose); none
    where no suffix occurred before."""
    if most <= 0:
        return []
    for n in range(min(ngram, len(tokens) - 1), 0, -1):
        if (end := _latest_end(tokens, tokens[-n:])) is not None:
            return tokens[end + 1 : end + 1 + most]
    return []


def _latest_end(tokens: list[int], suffix: list[int]) -> int | None:
    """Where the latest occurrence of suffix before the tokens' own last ends: the list's own search (C) finds each
    place its last token occurs, and only those are compared whole (this runs at every decode step)."""
    found, end, n = None, len(suffix) - 2, len(suffix)
    while True:
        try:
            end = tokens.index(suffix[-1], end + 1, len(tokens) - 1)
        except ValueError:
            return found
        if tokens[end - n + 1 : end + 1] == suffix:
            found = end


def generate_with_lookup(
    engine: Engine,
    prompt,
    sampler: Sampler,
    max_new_tokens: int,
    eot_id: int | None,
    session,
    ngram: int,
    draft_max: int = DEFAULT_DRAFT_MAX,
    logprobs: int = 0,
    overflow: str = "recompute",
) -> Iterator[Step]:
    """generation.generate's steps, one token each, for one row, with prompt lookup (ngram ≥ 1): the same tokens,
    logprobs and re-prefills as generate gives. The last step of a check carries its (proposed, accepted) counts,
    the first its pass's time."""
    (row,) = token_rows(prompt)
    block_size, keep = engine.config.block_size, overflow_keep(overflow, engine.config.block_size)
    (window,) = crop_window([row], block_size)
    state = engine.sampling_state(sampler, 1, logprobs)
    position = len(row) - 1  # the text position the next token's logits follow
    started = time.perf_counter()
    token, top = state.sample(session.prefill([window]), [window], position)
    yield Step(token, "prefill", session.positions, time.perf_counter() - started, top)
    produced = 1
    while produced < max_new_tokens and token[0] != eot_id:
        window, position = slide(window, token[0], block_size), position + 1
        # A check never passes the window: a full cache re-prefills at the very step plain decoding does.
        room = min(block_size - session.positions - 1, max_new_tokens - produced - 1)
        proposal = lookup_proposal(window, ngram, min(draft_max, room))
        started = time.perf_counter()
        if not proposal:
            kind, logits = prefill_if_due(session, [window], False, keep) or ("decode", session.decode(token))
            token, top = state.sample(logits, [window], position)
            yield Step(token, kind, session.positions, time.perf_counter() - started, top)
            produced += 1
            continue
        first = session.positions
        logits = session.check([token[0], *proposal])  # the last token's logits, then each proposed one's
        for i in range(len(proposal) + 1):
            if i:  # proposal[i - 1] was kept: it is the text's next token
                window, position = slide(window, token[0], block_size), position + 1
            token, top = state.sample(logits[i : i + 1], [window], position)
            kept = i < len(proposal) and token[0] == proposal[i]
            produced += 1
            last = not kept or produced >= max_new_tokens or token[0] == eot_id
            seconds = time.perf_counter() - started if i == 0 else 0.0  # the pass and the first draw
            yield Step(token, "decode", first + i + 1, seconds, top, (len(proposal), i + kept) if last else None)
            if last:
                break
        session.rewind(first + i + 1)  # the cache keeps the tokens fed up to row i, whose logits drew the last
