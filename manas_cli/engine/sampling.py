"""How last-position logits become next tokens: penalties against repetition, then greedy, or temperature,
top-k, top-p and min-p sampling. This module holds the settings and their rules, free of torch; the native core
samples with them (core.c, "sampling"), torch_engine/sampling.py does on the torch engine."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass


def choose_seed(seed: int | None) -> int:
    """`seed`, or a fresh random one, returned so the run can be reproduced. A chosen seed is below 2^53: every
    JSON reader holds it exactly (jq rounds a 64-bit integer to a double)."""
    if seed is not None:
        return seed
    # os.urandom, not the secrets module: the same bytes, without loading OpenSSL's hashing at every start.
    return int.from_bytes(os.urandom(8), "little") % JSON_SAFE_SEED_LIMIT


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

    @property
    def context_needed(self) -> bool:
        return self.repetition != 1.0 and self.last_n != 0


@dataclass(frozen=True)
class Sampler:
    """The penalties first; then temperature 0 is greedy (argmax), otherwise sample from the tempered, top-k-,
    top-p- and min-p-filtered softmax. The torch engine draws with `generator` (a seeded torch.Generator
    reproduces a run draw for draw); the native core with its counter-based generator keyed on `seed`."""

    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = None
    generator: object | None = None  # a torch.Generator, for the torch engine
    # Which ids may be drawn (tokenizer.decodable: a bool per id; ids past its end never are): nanoGPT pads its
    # embedding (50304 rows for GPT-2's 50257 tokens), and a padded id, or a hole in the ids, has no token to print.
    decodable: Sequence[bool] | None = None
    min_p: float | None = None  # drop tokens less likely than min_p × the most likely one's probability
    penalties: Penalties = Penalties()
    seed: int = 0  # the native core's draws
    # A structured output's compiled constraint (structured.Grammar): each draw only among the ids it allows next
    grammar: object | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be ≥ 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be ≥ 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")


def make_sampler(settings, seed: int, decodable: Sequence[bool] | None, engine, grammar=None) -> Sampler:
    """The sampler of a request's settings (cli/settings.py's GenerationSettings: temperature, top_k, top_p, min_p
    and the penalties) and seed, for `engine` (engines.Engine), which gives the generator it draws with; grammar:
    the request's compiled structured output, if any."""
    penalties = Penalties(
        settings.repetition_penalty, settings.repeat_last_n, settings.frequency_penalty, settings.presence_penalty
    )
    generator = engine.generator(seed) if settings.temperature > 0 else None
    return Sampler(
        settings.temperature,
        settings.top_k,
        settings.top_p,
        generator,
        decodable,
        settings.min_p,
        penalties,
        seed,
        grammar,
    )


def logits_error(position: int, dtype: str) -> str:
    """The error for logits that are not finite at a text position, with what to do about it."""
    advice = (
        "its weights overflow float32 there although each is finite (--dtype float32 cannot help): check the checkpoint"
        if dtype == "float32"
        else "its weights overflow that type; run it with --dtype float32, or check the checkpoint"
    )
    return f"the model computed NaN or infinite logits at position {position} in {dtype}: {advice}"
