"""Speculative decoding that changes nothing: a proposer guesses the next tokens (prompt lookup: what followed the
text's last n-gram where it occurred before; a draft model: a small model with the same vocabulary, decoding ahead),
the model checks them all in one pass over the cache, and each is kept only where it is the token the model draws
there itself. The text is the one plain decoding gives, token for token.

It holds because the native core's pass over k + 1 positions gives each position the logits a decode step of it
gives, bit for bit (each position's arithmetic reads only its own past, as a prefill's rows do), and its sampler
draws a position's token from Philox keyed on the seed and that position (docs/native.md): a token drawn inside a
check is the one a step would have drawn. Penalties' counts and a grammar's state advance with each token drawn,
which is every token kept and the first one that differs, as plain decoding draws them. A proposal is only ever a
guess: what a proposer does can change the speed, never the text."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from ..errors import NumericalError
from .engines import Engine
from .generation import Step, crop_window, overflow_keep, slide, token_rows
from .sampling import Penalties, Sampler
from .session import prefill_if_due

DEFAULT_DRAFT_MAX = 4  # proposed tokens a check: the verify pass's cost grows with them, and a long guess fails sooner

# A proposer: (the text's window, ending with the token just drawn; that token's text position; the most tokens
# wanted) -> the tokens it guesses follow, at most that many (none: the step decodes one token).
Propose = Callable[[list[int], int, int], list[int]]


def lookup_proposer(ngram: int) -> Propose:
    """Prompt lookup with n-grams of up to `ngram` tokens (lookup_proposal)."""
    return lambda window, position, most: lookup_proposal(window, ngram, most)


def prediction_proposer(predicted: list[int], ngram: int = 3) -> Propose:
    """A predicted text's tokens as proposals (OpenAI's Predicted Outputs): what followed the text's last n-gram
    (up to `ngram` tokens) where it occurs in the prediction; none where it does not."""

    def propose(window: list[int], position: int, most: int) -> list[int]:
        tail = window[-ngram:]
        return lookup_proposal(predicted + tail, min(ngram, len(tail)), most)

    return propose


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


class DraftProposer:
    """A draft model's guesses: it decodes ahead of the model on its own cache, drawing each token with the
    model's sampler at the same text position (the same keyed number: where the two distributions are close, the
    same token), without the frequency and presence penalties' counts or a structured output's state, which only
    the model's own draws advance. Its cache follows the text: what it fed and the text still share is kept, the
    rest is rewound and fed again; a text past its window is cropped to half of it, so re-prefills stay rare."""

    def __init__(self, engine: Engine, sampler: Sampler, eot_id: int | None) -> None:
        self.block_size = engine.config.block_size
        self.session = engine.new_session("dynamic", capacity=self.block_size)
        plain = Penalties(sampler.penalties.repetition, sampler.penalties.last_n)
        self.state = engine.sampling_state(replace(sampler, penalties=plain, grammar=None), 1, 0)
        self.eot_id = eot_id
        self.fed: list[int] = []  # the tokens whose keys and values its cache holds, in order
        self.start = 0  # fed[0]'s text position

    def __call__(self, window: list[int], position: int, most: int) -> list[int]:
        """Up to `most` guesses; with most = 0, none: the draft only reads the text (the prompt, while the model
        prefills it, so the first check does not wait for the draft's prefill)."""
        room = self.block_size - max(0, most - 1)  # tokens it may hold before guessing (it feeds most - 1 more)
        if room < 1:
            return []
        proposal: list[int] = []
        try:
            logits, text = self._follow(window, position, room)
            while most:
                (token,), _ = self.state.sample(logits, [text], position + len(proposal))
                proposal.append(token)
                if len(proposal) == most or token == self.eot_id:
                    return proposal
                text = text + [token]
                self.fed.append(token)
                logits = self.session.decode([token])
            return []
        except NumericalError:  # the draft's logits are not finite: a guess, never the text, so none is made
            self.fed = []
            return []

    def _follow(self, window: list[int], position: int, room: int):
        """Bring the draft's cache to the text that ends at `position` (its last token's logits, and the tokens
        it holds), feeding only what it does not hold already."""
        first = position - len(window) + 1  # window[0]'s text position
        if not self.fed or self.start < first or position - self.start + 1 > room:
            self.start = first if position - first + 1 <= room else position + 1 - max(1, room // 2)
            self.fed = []
        text = window[self.start - first :]
        kept = _shared(self.fed, text, len(text) - 1)  # the last token is fed again: its logits are wanted
        if kept:
            self.session.rewind(kept)
            logits = self.session.check(text[kept:])[len(text) - kept - 1 :]
        else:
            logits = self.session.prefill([text])
        self.fed = list(text)
        return logits, text


def _shared(fed: list[int], text: list[int], most: int) -> int:
    """How many leading tokens fed and text share, at most `most`."""
    for i, (a, b) in enumerate(zip(fed[:most], text[:most])):
        if a != b:
            return i
    return min(len(fed), most)


def generate_speculative(
    engine: Engine,
    prompt,
    sampler: Sampler,
    max_new_tokens: int,
    eot_id: int | None,
    session,
    propose: Propose,
    draft_max: int = DEFAULT_DRAFT_MAX,
    logprobs: int = 0,
    overflow: str = "recompute",
    reuse: int = 0,
    draft_min: int = 0,
) -> Iterator[Step]:
    """generation.generate's steps, one token each, for one row, with proposals checked: the same tokens,
    logprobs and re-prefills as generate gives (reuse=K: the session holds the prompt's first K tokens already, as
    generate's reuse). Each check asks for the k tokens DraftLength finds pay best, draft_min (0: a plain step) to
    draft_max.
    The last step of a check carries its (proposed, accepted) counts, the first its pass's time."""
    (row,) = token_rows(prompt)
    block_size, keep = engine.config.block_size, overflow_keep(overflow, engine.config.block_size)
    (window,) = crop_window([row], block_size)
    state = engine.sampling_state(sampler, 1, logprobs)
    position = len(row) - 1  # the text position the next token's logits follow
    started = time.perf_counter()
    logits = session.extend([window], reuse) if reuse else session.prefill([window])
    propose(window, position, 0)  # a draft reads the prompt now: its prefill is the first token's wait
    token, top = state.sample(logits, [window], position)
    yield Step(token, "prefill", session.positions, time.perf_counter() - started, top)
    produced, length = 1, DraftLength(draft_max, draft_min)
    while produced < max_new_tokens and token[0] != eot_id:
        window, position = slide(window, token[0], block_size), position + 1
        # A check never passes the window: a full cache re-prefills at the very step plain decoding does.
        room = min(block_size - session.positions - 1, max_new_tokens - produced - 1, length.next())
        started = time.perf_counter()
        proposal = propose(window, position, room) if room > 0 else []
        if not proposal:
            kind, logits = prefill_if_due(session, [window], False, keep) or ("decode", session.decode(token))
            if kind == "decode":
                length.stepped(time.perf_counter() - started)
            token, top = state.sample(logits, [window], position)
            yield Step(token, kind, session.positions, time.perf_counter() - started, top)
            produced += 1
            continue
        first = session.positions
        logits = session.check([token[0], *proposal])  # the last token's logits, then each proposed one's
        checked_s = time.perf_counter() - started  # the proposal and the pass: what the plain step's decode costs
        for i in range(len(proposal) + 1):
            if i:  # proposal[i - 1] was kept: it is the text's next token
                window, position = slide(window, token[0], block_size), position + 1
            token, top = state.sample(logits[i : i + 1], [window], position)
            kept = i < len(proposal) and token[0] == proposal[i]
            produced += 1
            last = not kept or produced >= max_new_tokens or token[0] == eot_id
            seconds = time.perf_counter() - started if i == 0 else 0.0  # the proposal, the pass and the first draw
            yield Step(token, "decode", first + i + 1, seconds, top, (len(proposal), i + kept) if last else None)
            if last:
                break
        session.rewind(first + i + 1)  # the cache keeps the tokens fed up to row i, whose logits drew the last
        length.checked(len(proposal), i + kept, checked_s)


# Plain steps before a check of one token while checks do not pay (a text may begin to repeat), doubled after each
# probe that does not pay either: a draft's probe costs its catching up with the text too.
PROBE_EVERY = 16
SURE_AFTER = 3  # checks before their measures may turn them off


class DraftLength:
    """How many tokens a row's next check asks for: the k, draft_min (0: a plain step) to draft_max, that the checks
    so far say gives the most tokens a second.

    A check of k gives 1 + a + a^2 ... + a^k tokens, where each proposed token is kept with chance a (a geometric
    run: the tokens kept over those kept and the checks that missed one, as a moving tally). It costs a plain
    step's seconds and what each proposed token has added to a check's (the draft's steps, the pass's extra rows).
    Whether checks pay depends on the machine as much as on the text: on an AVX2 host, each extra row of an int8
    check costs half a decode step, of a float32 one an eighth.

    Plain steps are chosen only after SURE_AFTER checks. While they pay best, one token is checked after
    PROBE_EVERY of them, then after twice as many; never where a proposed token costs a plain step or more (a draft
    slower than the model), since then no acceptance could pay. It sets the speed, never the text."""

    def __init__(self, draft_max: int, draft_min: int = 0) -> None:
        self.draft_max, self.draft_min = draft_max, min(draft_min, draft_max)
        self.step_s: float | None = None  # a plain decode step's seconds, sampling aside (a moving average)
        self.token_s: float | None = None  # what a proposed token adds to a check's seconds (a moving average)
        self.kept = self.missed = 0.0  # proposed tokens kept, and checks that missed one (decaying tallies)
        self.plain = 0  # plain steps since the last check
        self.checks = 0
        self.probe_after = PROBE_EVERY  # plain steps before the next probe

    def next(self) -> int:
        if self.step_s is None and not self.draft_min:
            return 0  # a plain step first: what the checks are measured against
        if self.step_s is None or self.token_s is None:
            return self.draft_max
        lowest = self.draft_min if self.checks >= SURE_AFTER else max(1, self.draft_min)
        best = max(range(lowest, self.draft_max + 1), key=self._tokens_per_s)
        if best:
            self.probe_after = PROBE_EVERY
        elif self.plain >= self.probe_after and self.token_s < self.step_s:  # else even a guess always kept loses
            self.probe_after *= 2
            return 1
        return best

    def _tokens_per_s(self, k: int) -> float:
        chance = (self.kept + 1) / (self.kept + self.missed + 2)  # Laplace's rule: never 0 or 1
        return sum(chance**j for j in range(k + 1)) / (self.step_s + k * self.token_s)

    def stepped(self, seconds: float) -> None:
        self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds
        self.plain += 1

    def checked(self, proposed: int, accepted: int, seconds: float) -> None:
        self.kept, self.missed = 0.9 * self.kept + accepted, 0.9 * self.missed + (accepted < proposed)
        self.checks, self.plain = self.checks + 1, 0
        # The first check's time is not its cost: the first pass of several rows sizes its scratch, the cache grows
        if self.step_s is not None and self.checks > 1:
            extra = max(0.0, seconds - self.step_s) / proposed
            self.token_s = extra if self.token_s is None else 0.8 * self.token_s + 0.2 * extra


def next_draft_max(k: int, draft_max: int, proposed: int, accepted: int) -> int:
    """The most tokens a batched row's next check asks for (its steps are shared, so its own cost is not measured),
    after one that asked for k: doubled (to draft_max) after a proposal kept whole, one past the tokens kept after
    one that was not."""
    return min(draft_max, 2 * k) if accepted == proposed else max(1, accepted + 1)
