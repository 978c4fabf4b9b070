"""Sampling on the torch engine: sampling.Sampler's settings over torch logits, drawn with its torch.Generator."""

from __future__ import annotations

import torch

from ..engine.constraints import Constraints
from ..engine.sampling import Penalties, Sampler, logits_error
from ..errors import NumericalError


def penalize(
    penalties: Penalties, logits: torch.Tensor, context: torch.Tensor | None, counts: torch.Tensor | None
) -> torch.Tensor:
    """logits (B, V) float32; context (B, T) the token window the logits follow; counts (B, V) of each token's
    generations so far."""
    if penalties.context_needed and context is not None:
        whole = penalties.last_n == -1 or penalties.last_n >= context.size(1)  # more than the window is the window
        recent = context if whole else context[:, -penalties.last_n :]
        seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, recent, True)
        penalized = torch.where(logits > 0, logits / penalties.repetition, logits * penalties.repetition)
        logits = torch.where(seen, penalized, logits)
    if penalties.counts_needed and counts is not None:
        logits = logits - penalties.frequency * counts - penalties.presence * (counts > 0)
    return logits


def adjust(
    sampler: Sampler, logits: torch.Tensor, context: torch.Tensor | None = None, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """The logits the sampler draws from before temperature and filters: undecodable ids masked, penalties
    applied (context: the token window the logits follow; counts: each token's generations so far)."""
    if sampler.decodable is not None:
        logits = logits[:, : len(sampler.decodable)]
        if (undecodable := _undecodable(sampler)) is not None:
            logits = logits.masked_fill(undecodable.to(logits.device), float("-inf"))
    return penalize(sampler.penalties, logits.float(), context, counts)


def _undecodable(sampler: Sampler) -> torch.Tensor | None:
    """The ids to mask, or None when every id is decodable (most tokenizers): a step then spends no op on it.
    Kept on the sampler, made once."""
    if "_undecodable" not in sampler.__dict__:
        decodable = torch.as_tensor(sampler.decodable, dtype=torch.bool)
        object.__setattr__(sampler, "_undecodable", None if bool(decodable.all()) else ~decodable)
    return sampler.__dict__["_undecodable"]


def draw(sampler: Sampler, logits: torch.Tensor) -> torch.Tensor:
    """Adjusted logits (B, vocab) -> next token ids (B, 1)."""
    if sampler.temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    return torch.multinomial(probabilities(sampler, logits), num_samples=1, generator=sampler.generator)


def probabilities(sampler: Sampler, logits: torch.Tensor) -> torch.Tensor:
    logits = tempered(logits.float(), sampler.temperature)
    if sampler.top_k is not None and sampler.top_k < logits.size(-1):
        kth = torch.topk(logits, sampler.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampler.top_p is not None and sampler.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token is dropped when the mass before it already does.
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= sampler.top_p
        drop_sorted[:, 0] = False  # a top_p below the top probability (or 0 in float32) keeps the top token
        probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
    if sampler.min_p:
        probs = probs.masked_fill(probs < sampler.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
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


def check_logits(logits: torch.Tensor, first_position: int) -> torch.Tensor:
    """Logits (..., T, vocab) of the text's positions first_position onwards, which must be finite: weights that
    load finite may still overflow in the computation (a learned position row of 3e38 at one position, float16's
    range), and sampling from NaN would print token 0 over and over. One reduction per step: cheap beside the
    forward pass. The error names the first position whose logits are not finite."""
    if bool(torch.isfinite(logits).all()):  # one reduction on the usual path; where, only on failure
        return logits
    finite = torch.isfinite(logits).all(dim=-1)
    position = first_position + int((~finite).reshape(-1, finite.size(-1)).any(0).nonzero()[0])
    raise NumericalError(logits_error(position, str(logits.dtype).removeprefix("torch.")))


class TorchSampling:
    """What sampling keeps for a request's rows on the torch engine: how often each token has been generated
    (for the frequency and presence penalties; a (B, vocab) tensor, so a run of any length holds no more)."""

    def __init__(self, model, sampler: Sampler, rows: int, logprobs: int) -> None:
        self.sampler, self.logprobs = sampler, logprobs
        self.device = model.token_embedding.weight.device
        needed = sampler.penalties.counts_needed
        self.counts = torch.zeros(rows, model.config.vocab_size, device=self.device) if needed else None
        self.constraints = Constraints(sampler.grammar, rows) if sampler.grammar is not None else None

    def _constrained(self, logits: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """Adjusted logits (B, V) with the ids each row's structured output does not allow next at -inf (raw: the
        logits before any setting, whose argmax is the model's most likely id)."""
        if self.constraints is None:
            return logits
        size = logits.size(-1)
        rows = [
            bytearray(self.constraints.allowed(b, size, lambda b=b: int(raw[b].argmax()))) for b in range(len(logits))
        ]
        allowed = torch.stack([torch.frombuffer(row, dtype=torch.uint8) for row in rows]).to(logits.device)
        return logits.masked_fill(allowed == 0, float("-inf"))

    def sample(self, logits: torch.Tensor, windows: list[list[int]], position: int) -> tuple[list[int], list | None]:
        """The next id of each row, and the log-probabilities if asked. position: the text's position the logits
        (B, 1, vocab) follow (0 is the first token), for the error when they are not finite."""
        context = torch.tensor(windows, device=self.device) if self.sampler.penalties.context_needed else None
        raw = check_logits(logits[:, -1:], position)[:, -1]
        adjusted = self._constrained(adjust(self.sampler, raw, context, self.counts), raw)
        next_ids = draw(self.sampler, adjusted)
        if self.constraints is not None:
            for b, token in enumerate(next_ids[:, 0].tolist()):
                self.constraints.accept(b, token)
        if self.counts is not None:
            self.counts.scatter_add_(1, next_ids, torch.ones_like(next_ids, dtype=self.counts.dtype))
        top = top_logprobs(adjusted, next_ids, self.logprobs) if self.logprobs else None
        return next_ids.squeeze(
            1
        ).tolist(), top  # the host needs the ids anyway; this also syncs a GPU for honest timing


@torch.inference_mode()
def torch_window_nats(model, window: list[int], targets: int, first_position: int) -> float:
    """native.window_nats on the torch engine: cross-entropy of the window's last `targets` tokens."""
    ids = torch.tensor([window], device=model.token_embedding.weight.device)
    logits = check_logits(model(ids)[0, -targets - 1 : -1], first_position).float()
    return torch.nn.functional.cross_entropy(logits, ids[0, -targets:], reduction="sum").item()
