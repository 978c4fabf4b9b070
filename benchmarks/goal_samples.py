"""Goal 4: `--num-samples 8` against one sample, the shipped model."""

from __future__ import annotations

import torch

from harness import GREEDY, median_rate, run_goals, shipped_model, timed
from manas_cli.engine.bench import run_once
from manas_cli.engine.generation import generate
from manas_cli.torch_engine.engine import TorchEngine


def goal_batched_samples(threads: int, runs: int) -> dict:
    model = shipped_model(threads)
    prompt = torch.zeros(1, 16, dtype=torch.long)

    def seconds(batch: int) -> float:
        return timed(lambda: run_once(generate(TorchEngine(model), prompt.repeat(batch, 1), GREEDY, 200), 16, batch))

    one = median_rate(runs, lambda: seconds(1))
    eight = median_rate(runs, lambda: seconds(8))
    return {"one_sample_s": one, "eight_samples_s": eight, "ratio_to_8x_one": eight / (8 * one)}


GOALS = {
    "4": lambda args: goal_batched_samples(args.threads, args.runs),
}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
