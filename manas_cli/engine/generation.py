"""Generation that stays exact past the context window, and the crop-and-recompute reference it must equal."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..errors import NumericalError
from .kv_cache import CacheSession
from .native import new_session
from .model import GPT
from .sampling import Sampler, top_logprobs

OVERFLOW_POLICIES = ("recompute", "shift")


@dataclass(frozen=True)
class Step:
    """One new token per batch row, and how it was computed."""

    tokens: list[int]
    kind: str  # "prefill" (the prompt), "re_prefill" (the window was full), "decode" (from the cache), "full" (uncached)
    positions: int  # positions the model attended over for this token
    seconds: float  # forward pass and sampling, synchronized
    # With logprobs: per row, the token's log-probability and the most likely ids with theirs (sampling.top_logprobs)
    logprobs: list[tuple[float, list[int], list[float]]] | None = None


def crop_window(ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """The last block_size tokens: all the context a model with absolute positions can see."""
    return ids[:, -block_size:]


def prompt_batch(ids: list[int], batch_size: int, model: GPT) -> torch.Tensor:
    """One prompt repeated for batch_size rows, on the model's device: (batch_size, len(ids))."""
    return torch.tensor([ids] * batch_size, dtype=torch.long, device=next(model.parameters()).device)


def validate_prompt(prompt: torch.Tensor) -> None:
    if prompt.dim() != 2 or prompt.size(1) == 0:
        raise ValueError(f"the prompt must be a non-empty (B, T) tensor of token ids, got shape {tuple(prompt.shape)}")


class SamplingState:
    """What the sampler needs beyond the logits, kept alike by the cached generator and the reference: the token
    window the logits follow, and how often each token has been generated (for the frequency and presence
    penalties; a (B, vocab) tensor, so a run of any length holds no more)."""

    def __init__(self, sampler: Sampler, prompt: torch.Tensor, vocab_size: int, logprobs: int) -> None:
        self.sampler = sampler
        self.logprobs = logprobs
        needed = sampler.penalties.counts_needed
        self.counts = torch.zeros(prompt.size(0), vocab_size, device=prompt.device) if needed else None

    def sample(self, logits: torch.Tensor, window: torch.Tensor, started: float,
               position: int) -> tuple[torch.Tensor, list[int], float, list | None]:
        """The next ids (B, 1) and as a list, the seconds since `started`, and the log-probabilities if asked.
        position: the text's position the logits follow (0 is the first token), for the error when they are not
        finite."""
        adjusted = self.sampler.adjust(check_logits(logits[:, -1:], position)[:, -1], window, self.counts)
        next_ids = self.sampler.draw(adjusted)
        if self.counts is not None:
            self.counts.scatter_add_(1, next_ids, torch.ones_like(next_ids, dtype=self.counts.dtype))
        logprobs = top_logprobs(adjusted, next_ids, self.logprobs) if self.logprobs else None
        tokens = next_ids.squeeze(1).tolist()  # the host needs the ids anyway; this also syncs a GPU for honest timing
        return next_ids, tokens, time.perf_counter() - started, logprobs


def prefill_due(session: CacheSession, window: torch.Tensor, first: bool, keep: int) -> tuple[str, torch.Tensor] | None:
    """The window rule, in one place: the prompt's window is prefilled; a full cache re-prefills the last `keep`
    tokens of the window (all of it in recompute mode, half in shift mode); otherwise None: decode from the cache."""
    if first:
        return "prefill", session.prefill(window)
    if session.positions >= session.block_size:
        return "re_prefill", session.prefill(crop_window(window, keep))
    return None


def kept_on_overflow(overflow: str, block_size: int) -> int:
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}, got {overflow!r}")
    return block_size if overflow == "recompute" else max(1, block_size // 2)


@torch.inference_mode()
def generate(
    model: GPT,
    prompt: torch.Tensor,
    sampler: Sampler,
    max_new_tokens: int,
    eot_id: int | None = None,
    overflow: str = "recompute",
    session: CacheSession | None = None,
    logprobs: int = 0,
) -> Iterator[Step]:
    """Yield max_new_tokens steps (fewer if every row has produced eot_id) from a KV cache.

    overflow="recompute": when the cache is full, prefill the last block_size tokens, so every token equals
    crop-and-recompute's. overflow="shift": prefill only the last block_size // 2, buying that many cached decode
    steps at the price of exactness (the model then sees a shorter context than the reference does).
    logprobs=N adds each token's log-probability and the N most likely alternatives to every step.
    """
    keep = kept_on_overflow(overflow, model.config.block_size)
    validate_prompt(prompt)
    session = session or new_session(model)
    block_size = model.config.block_size
    sequence = crop_window(prompt, block_size)
    state = SamplingState(sampler, prompt, model.config.vocab_size, logprobs)
    finished = [False] * prompt.size(0)
    for step in range(max_new_tokens):
        started = time.perf_counter()
        kind, logits = prefill_due(session, sequence, step == 0, keep) or ("decode", session.decode(sequence[:, -1:]))
        next_ids, tokens, seconds, top = state.sample(logits, sequence, started, prompt.size(1) - 1 + step)
        # Only the window can ever be seen again: a sequence of every token would make each step O(length).
        sequence = crop_window(torch.cat((sequence, next_ids), dim=1), block_size)
        yield Step(tokens, kind, session.positions, seconds, top)
        if _all_finished(finished, tokens, eot_id):
            return


@torch.inference_mode()
def generate_reference(
    model: GPT, prompt: torch.Tensor, sampler: Sampler, max_new_tokens: int, eot_id: int | None = None,
    logprobs: int = 0,
) -> Iterator[Step]:
    """nanoGPT's crop-and-recompute sampling: the full model over the last block_size tokens at every step."""
    validate_prompt(prompt)
    block_size = model.config.block_size
    sequence = crop_window(prompt, block_size)
    state = SamplingState(sampler, prompt, model.config.vocab_size, logprobs)
    finished = [False] * prompt.size(0)
    for step in range(max_new_tokens):
        started = time.perf_counter()
        next_ids, tokens, seconds, top = state.sample(model(sequence)[:, -1:], sequence, started,
                                                      prompt.size(1) - 1 + step)
        positions = sequence.size(1)
        sequence = crop_window(torch.cat((sequence, next_ids), dim=1), block_size)
        yield Step(tokens, "full", positions, seconds, top)
        if _all_finished(finished, tokens, eot_id):
            return


def check_logits(logits: torch.Tensor, first_position: int) -> torch.Tensor:
    """Logits (..., T, vocab) of the text's positions first_position onwards, which must be finite: weights that
    load finite may still overflow in the computation (a learned position row of 3e38 at one position, float16's
    range), and sampling from NaN would print token 0 over and over. One reduction per step: cheap beside the
    forward pass. The error names the first position whose logits are not finite."""
    if bool(torch.isfinite(logits).all()):  # one reduction on the usual path; where, only on failure
        return logits
    finite = torch.isfinite(logits).all(dim=-1)
    position = first_position + int((~finite).reshape(-1, finite.size(-1)).any(0).nonzero()[0])
    dtype = str(logits.dtype).removeprefix("torch.")
    advice = ("its weights overflow float32 there although each is finite (--dtype float32 cannot help): check "
              "the checkpoint" if logits.dtype == torch.float32 else
              "its weights overflow that type; run it with --dtype float32, or check the checkpoint")
    raise NumericalError(f"the model computed NaN or infinite logits at position {position} in {dtype}: {advice}")


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
    # Kept only when asked for (inspect-cache shows them): past the window, recompute re-prefills at every step.
    re_prefill_positions: list[int] | None = None

    def update(self, step: Step) -> None:
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
