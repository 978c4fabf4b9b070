"""Speed measurements: prefill, cached decode and the uncached baseline, repeated after a warm-up."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .engines import Engine
from .generation import GenerationStats, Step, generate, generate_reference
from .sampling import Sampler
from .speculation import Propose, generate_speculative


@dataclass(frozen=True)
class Measurement:
    name: str  # llama-bench style: pp128 (prefill 128 tokens), tg256 (generate 256), "tg256 no-cache"
    tokens_per_s: list[float]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.tokens_per_s)

    @property
    def std(self) -> float:
        return statistics.stdev(self.tokens_per_s) if len(self.tokens_per_s) > 1 else 0.0


@dataclass(frozen=True)
class Speculation:
    """bench's speculative decode test: its name (llama-bench style, after tgN: "lookup2", "draft"), a fresh proposer
    for each run (a draft's cache starts empty), and the most and fewest tokens a check takes."""

    name: str
    proposer: Callable[[], Propose]
    draft_max: int
    draft_min: int = 0


def speculation_figures(stats: GenerationStats) -> dict:
    """What a speculative run's proposals came to: the share kept, and the tokens each check gave (those kept and
    the model's own draw after them)."""
    return {
        "proposed_tokens": stats.proposed_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "checks": stats.checks,
        "acceptance_rate": stats.accepted_tokens / stats.proposed_tokens if stats.proposed_tokens else 0.0,
        "tokens_per_check": (stats.accepted_tokens + stats.checks) / stats.checks if stats.checks else 0.0,
    }


@dataclass(frozen=True)
class BenchResult:
    measurements: list[Measurement]
    ttft_s: float
    re_prefills: int
    cache_bytes: int
    peak_memory_bytes: int
    baseline_estimate_s: float | None = None  # the uncached baseline's estimated time, where it was left out for it
    speculation: dict | None = None  # speculation_figures of the speculative test, where it ran

    @property
    def speedup(self) -> float | None:
        """Cached decode over the uncached baseline, when the baseline ran."""
        uncached = [m for m in self.measurements if m.name.endswith("no-cache")]
        return self.measurements[1].mean / uncached[0].mean if uncached else None


def bench_prompt(engine: Engine, prompt_tokens: int, batch: int, seed: int = 0) -> list[list[int]]:
    """A reproducible random prompt: speed does not depend on which tokens they are."""
    draw = random.Random(seed)
    ids = [draw.randrange(engine.config.vocab_size) for _ in range(prompt_tokens)]
    return [list(ids) for _ in range(batch)]


def reporting(steps: Iterator[Step], on_step: Callable[[str], None], label: str) -> Iterator[Step]:
    """The steps, calling on_step(label) after each."""
    for step in steps:
        yield step
        on_step(label)


def run_once(steps: Iterator[Step], prompt_tokens: int, batch: int) -> GenerationStats:
    stats = GenerationStats(prompt_tokens=prompt_tokens, batch_size=batch)
    for step in steps:
        stats.update(step)
    return stats


BASELINE_BUDGET_S = 60.0  # an uncached baseline estimated to take longer runs only when asked for


def run_bench(
    engine: Engine,
    prompt_tokens: int,
    new_tokens: int,
    repeat: int,
    batch: int = 1,
    baseline: bool | None = True,
    allocation: str = "dynamic",
    overflow: str = "recompute",
    on_step: Callable[[str], None] = lambda label: None,
    depth: int = 0,
    on_measurement: Callable[[Measurement], None] = lambda measurement: None,
    speculation: Speculation | None = None,
    prompt_ids: list[int] | None = None,
) -> BenchResult:
    """pp{P}, tg{N} and (optionally) tg{N} no-cache, each `repeat` times after one warm-up run of each. on_step is
    called after every generated token with what is running (a progress bar), on_measurement with each test's
    figures as soon as they are known. baseline None: the uncached baseline runs where baseline_seconds estimates
    at most BASELINE_BUDGET_S for it (on a large model it can take half an hour), and the result says the estimate
    where it did not.

    depth=D (llama-bench's -d): before each run, D tokens are put in the cache, untimed; the prefill test then
    times the prompt's P tokens after them (each attending over the D before it), and the decode test, a run of its
    own as llama-bench's, decodes after the D and the prompt's first token. The uncached baseline recomputes the
    decode test's tokens so far at each step.

    speculation: a test of its own after tgN, the same greedy decode with proposals checked (one row, no depth);
    prompt_ids: the prompt's tokens instead of random ones (proposals are kept from real text, rarely from noise)."""
    block_size = engine.config.block_size
    prompt_tokens = min(prompt_tokens, block_size - depth)  # the prefill crops a longer prompt to the window
    history = bench_prompt(engine, depth, batch, seed=1)
    prompt_rows = bench_prompt(engine, prompt_tokens, batch) if prompt_ids is None else [prompt_ids[-prompt_tokens:]]
    prompt = [row + ids for row, ids in zip(history, prompt_rows)]
    decode_prompt = [row[: depth + 1] for row in prompt] if depth else prompt
    greedy = Sampler(temperature=0.0)
    session = engine.new_session(allocation, capacity=min(block_size, depth + prompt_tokens + new_tokens))

    def cached(rows: list[list[int]], tokens: int) -> Callable[[], Iterator[Step]]:
        def steps() -> Iterator[Step]:
            if depth:
                session.prefill(history)  # the depth, untimed: generate extends the cache from it
            return generate(engine, rows, greedy, tokens, overflow=overflow, session=session, reuse=depth)

        return steps

    def timed(name: str, make_steps: Callable[[], Iterator[Step]], prompt_length: int) -> list[GenerationStats]:
        run_once(reporting(make_steps(), on_step, f"warming up {name}"), prompt_length, batch)  # first calls are slower
        return [
            run_once(
                reporting(make_steps(), on_step, f"timing {name} (run {run + 1} of {repeat})"), prompt_length, batch
            )
            for run in range(repeat)
        ]

    decode_length = 1 if depth else prompt_tokens  # the decode run's prompt past the depth
    at = f" @ d{depth}" if depth else ""  # llama-bench's names
    measurements = []

    def measured(name: str, figures: list[float]) -> None:
        measurements.append(Measurement(name, figures))
        on_measurement(measurements[-1])

    prefilled = timed("prefill", cached(prompt, 1), prompt_tokens) if depth else None
    decoded = timed("cached", cached(decode_prompt, new_tokens), decode_length)
    prefilled = prefilled or decoded
    measured(f"pp{prompt_tokens}{at}", [s.prefill_tokens_per_s for s in prefilled])
    measured(f"tg{new_tokens}{at}", [s.decode_tokens_per_s for s in decoded])
    speculated = None
    if speculation is not None:

        def speculative() -> Iterator[Step]:
            propose = speculation.proposer()
            return generate_speculative(
                engine, prompt, greedy, new_tokens, None, session, propose, speculation.draft_max, 0, overflow,
                draft_min=speculation.draft_min,
            )  # fmt: skip

        speculated = timed(speculation.name, speculative, prompt_tokens)
        measured(f"tg{new_tokens} {speculation.name}", [s.decode_tokens_per_s for s in speculated])
    estimate = baseline_seconds(decode_length + depth, new_tokens, repeat, batch, block_size, measurements[0].mean)
    skipped = baseline is None and estimate > BASELINE_BUDGET_S
    if baseline is not False and not skipped:
        uncached = timed(
            "baseline", lambda: generate_reference(engine, decode_prompt, greedy, new_tokens), decode_length
        )
        measured(f"tg{new_tokens}{at} no-cache", [s.decode_tokens_per_s for s in uncached])
    return BenchResult(
        measurements=measurements,
        ttft_s=statistics.median(s.ttft_s for s in prefilled),
        re_prefills=decoded[-1].re_prefills,
        cache_bytes=session.storage()["storage_bytes"],
        peak_memory_bytes=engine.peak_memory_bytes(),
        baseline_estimate_s=estimate if skipped else None,
        speculation=speculation_figures(speculated[-1]) if speculated else None,
    )


def baseline_seconds(
    prompt_tokens: int, new_tokens: int, repeat: int, batch: int, block_size: int, prefill_tokens_per_s: float
) -> float:
    """About how long the uncached baseline takes, warm-up included: each of its steps prefills the whole text so
    far (at most the window), at the measured prefill speed (of every row together, as the batch's are)."""
    positions = sum(min(prompt_tokens + i, block_size) for i in range(new_tokens))
    return (repeat + 1) * positions * batch / max(prefill_tokens_per_s, 1e-9)


def sweep(
    engine: Engine, prompt_tokens: int, new_tokens: int, buckets: int, on_token: Callable[[], None] = lambda: None
) -> list[dict]:
    """Decode speed against context position, in `buckets` spans: shows what re-prefills cost. on_token is called
    after each token (a progress bar)."""
    prompt = bench_prompt(engine, prompt_tokens, 1)
    greedy = Sampler(temperature=0.0)
    run_once(generate(engine, prompt, greedy, min(new_tokens, 16)), prompt_tokens, 1)  # warm-up
    span = max(1, (prompt_tokens + new_tokens) // buckets)
    rows: dict[int, dict] = {}
    position = len(prompt[0])
    for step in generate(engine, prompt, greedy, new_tokens):
        on_token()
        position += 1
        if step.kind == "prefill":
            continue  # time to first token, not decode speed
        row = rows.setdefault(position // span, {"start": position, "seconds": 0.0, "tokens": 0, "re_prefills": 0})
        row["end"] = position + 1  # one past the last position the bucket holds
        row["seconds"] += step.seconds
        row["tokens"] += 1
        row["re_prefills"] += step.kind == "re_prefill"
    for row in rows.values():
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
    return list(rows.values())
