"""Turning last-position logits into next tokens: penalties against repetition, then greedy, or temperature,
top-k, top-p and min-p sampling."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from functools import cached_property

import torch


def seeded_generator(seed: int | None, model: torch.nn.Module) -> tuple[torch.Generator, int]:
    """A generator on the model's device, seeded with `seed`, or with a fresh random seed that is returned so the
    run can be reproduced. A chosen seed is below 2^53: every JSON reader holds it exactly (jq rounds a 64-bit
    integer to a double)."""
    generator = torch.Generator(device=next(model.parameters()).device)
    if seed is None:
        seed = secrets.randbelow(JSON_SAFE_SEED_LIMIT)
    return generator.manual_seed(seed), seed


JSON_SAFE_SEED_LIMIT = 2**53  # integers up to here are exact in a double


@dataclass(frozen=True)
class Penalties:
    """Penalties against the loops a small model falls into. `repetition` as llama.cpp and Hugging Face define it:
    each token among the last `last_n` of the context (prompt included; -1: the whole window, 0: none) has its
    logit divided by it when positive, multiplied when negative. `frequency` and `presence` as OpenAI defines them:
    a token's logit less frequency × the times it was generated, less presence if it was generated at all."""

    repetition: float = 1.0
    last_n: int = 64
    frequency: float = 0.0
    presence: float = 0.0

    def __post_init__(self) -> None:
        if not self.repetition > 0:
            raise ValueError(f"the repetition penalty must be > 0, got {self.repetition}")
        if self.last_n < -1:
            raise ValueError(f"repeat_last_n must be -1 (the whole window), 0 (none) or more, got {self.last_n}")

    @property
    def counts_needed(self) -> bool:
        return self.frequency != 0 or self.presence != 0

    def apply(self, logits: torch.Tensor, context: torch.Tensor | None, counts: torch.Tensor | None) -> torch.Tensor:
        """logits (B, V) float32; context (B, T) the token window the logits follow; counts (B, V) of each token's
        generations so far."""
        if self.repetition != 1.0 and self.last_n != 0 and context is not None:
            whole = self.last_n == -1 or self.last_n >= context.size(1)  # more than the window is the window
            recent = context if whole else context[:, -self.last_n :]
            seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, recent, True)
            penalized = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits = torch.where(seen, penalized, logits)
        if self.counts_needed and counts is not None:
            logits = logits - self.frequency * counts - self.presence * (counts > 0)
        return logits


@dataclass(frozen=True)
class Sampler:
    """The penalties first; then temperature 0 is greedy (argmax), otherwise sample from the tempered, top-k-,
    top-p- and min-p-filtered softmax with `generator`, so a seeded generator reproduces a run draw for draw."""

    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None
    # Which ids may be drawn (tokenizer.decodable: a bool per id; ids past its end never are): nanoGPT pads its
    # embedding (50304 rows for GPT-2's 50257 tokens), and a padded id, or a hole in the ids, has no token to print.
    decodable: torch.Tensor | None = None
    min_p: float | None = None  # drop tokens less likely than min_p × the most likely one's probability
    penalties: Penalties = Penalties()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be ≥ 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be ≥ 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    def __call__(self, logits: torch.Tensor, context: torch.Tensor | None = None,
                 counts: torch.Tensor | None = None) -> torch.Tensor:
        """logits (B, vocab) -> next token ids (B, 1); context and counts feed the penalties (see adjust)."""
        return self.draw(self.adjust(logits, context, counts))

    def adjust(self, logits: torch.Tensor, context: torch.Tensor | None = None,
               counts: torch.Tensor | None = None) -> torch.Tensor:
        """The logits the sampler draws from before temperature and filters: undecodable ids masked, penalties
        applied (context: the token window the logits follow; counts: each token's generations so far)."""
        if self.decodable is not None:
            logits = logits[:, : self.decodable.numel()]
            if self._undecodable is not None:
                logits = logits.masked_fill(self._undecodable.to(logits.device), float("-inf"))
        return self.penalties.apply(logits.float(), context, counts)

    @cached_property
    def _undecodable(self) -> torch.Tensor | None:
        """The ids to mask, or None when every id is decodable (most tokenizers): a step then spends no op on it."""
        return None if bool(self.decodable.all()) else ~self.decodable

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """Adjusted logits (B, vocab) -> next token ids (B, 1)."""
        if self.temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)
        probs = self.probabilities(logits)
        return torch.multinomial(probs, num_samples=1, generator=self.generator)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        logits = tempered(logits.float(), self.temperature)
        if self.top_k is not None and self.top_k < logits.size(-1):
            kth = torch.topk(logits, self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p is not None and self.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p: a token is dropped when the mass before it already does.
            drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= self.top_p
            drop_sorted[:, 0] = False  # a top_p below the top probability (or 0 in float32) keeps the top token
            probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
        if self.min_p:
            probs = probs.masked_fill(probs < self.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        return probs


def top_logprobs(logits: torch.Tensor, chosen: torch.Tensor, n: int) -> list[tuple[float, list[int], list[float]]]:
    """Per row of adjusted logits (B, vocab): the chosen token's log-probability and the n most likely tokens with
    theirs, from the softmax at temperature 1 (before the temperature and the filters)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, min(n, logprobs.size(-1)), dim=-1)
    chosen_logprobs = logprobs.gather(-1, chosen).squeeze(-1).tolist()
    return list(zip(chosen_logprobs, top.indices.tolist(), top.values.tolist()))


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature; a row that the division overflows (a temperature too small to divide by) gets the
    limit as temperature -> 0 instead, all its mass on the argmax: greedy, as temperature 0 is."""
    scaled = logits / temperature
    overflowed = ~scaled.amax(dim=-1, keepdim=True).isfinite()
    if not overflowed.any():  # the usual case: skip the argmax, which costs more than the division
        return scaled
    greedy = torch.full_like(logits, float("-inf")).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 0.0)
    return torch.where(overflowed, greedy, scaled)
