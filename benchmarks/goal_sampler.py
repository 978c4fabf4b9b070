"""Issue 60's goal 4: what sampling costs beside a decode step at the Qwen2.5-0.5B shape (151,936-token vocabulary).

cost: the core's sampler (manas_sample, as the native engine calls it for each row) over 151,936 random logits
      with top_k 40, top_p 0.95, min_p 0.05, repeat_penalty 1.1 over a 64-token window, in µs per token (median
      of 200 draws after 20 to warm up); beside it greedy and plain temperature; and a decode step of the
      Qwen2.5-0.5B shape (random weights, manas bench, int4: the fastest, so the strictest share), the share
      being sampler ÷ step. Goal: ≤ 5%.

  python benchmarks/goal_sampler.py --goal cost --threads 2
"""

from __future__ import annotations

import ctypes
import random
import statistics
import tempfile
import time
from ctypes import c_float, c_int32
from pathlib import Path

from goal_llama_cpp import manas_bench_rates
from goal_llama_family import hf_model_and_checkpoint
from harness import run_goals
from manas_cli.native.binding import ManasDraw, ManasRow, ManasSampler
from manas_cli.native.build import build

QWEN_VOCAB = 151_936
SETTINGS = {  # ManasSampler's fields: temperature, top_k, top_p, min_p, repetition, last_n, frequency, presence
    "greedy": (0.0, 0, 1.0, 0.0, 1.0, 0, 0.0, 0.0),
    "temperature 0.8": (0.8, 0, 1.0, 0.0, 1.0, 0, 0.0, 0.0),
    "top_k 40, top_p 0.95, min_p 0.05, repeat_penalty 1.1": (0.8, 40, 0.95, 0.05, 1.1, 64, 0.0, 0.0),
    "top_p 0.95 alone": (0.8, 0, 0.95, 0.0, 1.0, 0, 0.0, 0.0),
}


def sampler_microseconds(settings: tuple, draws: int = 200) -> float:
    """The median µs of one manas_sample call over random logits of Qwen's vocabulary size."""
    library = build().library
    rng = random.Random(0)
    logits = (c_float * QWEN_VOCAB)(*(rng.gauss(0, 3) for _ in range(QWEN_VOCAB)))
    window = (c_int32 * 64)(*(rng.randrange(QWEN_VOCAB) for _ in range(64)))
    scratch = ctypes.create_string_buffer(library.manas_sample_scratch_bytes(QWEN_VOCAB))
    draw, times = ManasDraw(), []
    for position in range(draws + 20):
        sampler = ManasSampler(*settings, position, 0)
        row = ManasRow(ctypes.addressof(logits), window, 64, None, 0, position)
        started = time.perf_counter()
        library.manas_sample(
            ctypes.byref(sampler), ctypes.byref(row), QWEN_VOCAB, QWEN_VOCAB, None, scratch, ctypes.byref(draw)
        )
        times.append(time.perf_counter() - started)
    return statistics.median(times[20:]) * 1e6


def goal_cost(args) -> dict:
    costs = {name: round(sampler_microseconds(settings), 1) for name, settings in SETTINGS.items()}
    with tempfile.TemporaryDirectory() as folder:
        _, checkpoint = hf_model_and_checkpoint("qwen2.5-0.5b", Path(folder))
        decode = manas_bench_rates(checkpoint, 16, 32, args.threads, "int4")["decode"]
    step_us = 1e6 / decode
    return {
        "sampler_us": costs,
        "decode_step_us_int4": round(step_us, 1),
        "share_of_a_step": {name: round(us / step_us, 4) for name, us in costs.items()},
    }


GOALS = {"cost": goal_cost}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
