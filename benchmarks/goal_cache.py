"""Goal 2: the shipped model, cached decode against crop-and-recompute within the window, and the time per token
across the window."""

from __future__ import annotations

import statistics

import torch

from harness import GREEDY, manas_decode_rate, median_rate, run_goals, shipped_model
from manas_cli.engine.bench import run_once
from manas_cli.engine.generation import generate, generate_reference
from manas_cli.torch_engine.engine import TorchEngine


def goal_cache_vs_recompute(threads: int, runs: int) -> dict:
    model = shipped_model(threads)
    new_tokens = model.config.block_size  # a 1-token prompt: every step stays within the window
    prompt = torch.zeros(1, 1, dtype=torch.long)
    cached = median_rate(runs, lambda: manas_decode_rate(model, prompt, new_tokens, "dynamic"))
    baseline = median_rate(
        runs,
        lambda: run_once(generate_reference(TorchEngine(model), prompt, GREEDY, new_tokens), 1, 1).decode_tokens_per_s,
    )
    steps = [s for s in generate(TorchEngine(model), prompt, GREEDY, new_tokens) if s.kind == "decode"]
    quarter = len(steps) // 4
    first = statistics.median(s.seconds for s in steps[:quarter])
    last = statistics.median(s.seconds for s in steps[-quarter:])
    return {
        "cached_tokens_per_s": cached,
        "recompute_tokens_per_s": baseline,
        "ratio": cached / baseline,
        "step_ms_first_quarter": first * 1000,
        "step_ms_last_quarter": last * 1000,
        "last_over_first": last / first,
    }


GOALS = {
    "2": lambda args: goal_cache_vs_recompute(args.threads, args.runs),
}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
