"""Reproduce the performance goals of manas in one run, each as a ratio measured side by side. Each goal lives in a
module of its own (goal_*.py, runnable alone the same way) over a small shared harness (harness.py).

    python benchmarks/goals.py            # all goals (goal 1 needs transformers: pip install -e ".[test]")
    python benchmarks/goals.py --goal 1   # one goal
    python benchmarks/goal_int8.py        # one module's goals
    python benchmarks/goals.py --json     # the numbers as JSON

goal_gpt2_vs_hf  1: GPT-2-124M shape, 64-token prompt, 256 new tokens, float32: decode against Hugging Face
                 `generate` on the same random weights, and against the weight-bandwidth limit.
goal_cache       2: the shipped model, cached decode against crop-and-recompute; per-token time across the window.
goal_startup     3: time to first token of a whole `manas generate` process against importing torch; `--help`.
                 startup, startup-loop, startup-score: whole processes on the native engine (no torch) beside
                 the torch engine and llama.cpp's `llama-completion` (issue 26).
goal_samples     4: `--num-samples 8` against one sample.
goal_int8        int8, threads, int8-shipped, int8-prefill: int8 weights and both cores (issue 10).
goal_dtype       dtype: bfloat16 and float16 against float32, prefill and decode.
goal_busy        busy: the default thread choice against --threads 1 and 2, quiet and beside a spinning process.
goal_pipelines   pipelines, batch: --jsonl against a shell loop and --batch-size 1; batch sizes 1 to 16.
goal_llama_cpp   llama-cpp, llama-cpp-medium, llama-cpp-shipped: manas float32/int8/int4 beside llama.cpp
                 f32/q8_0/q4_0 on GPT-2's 124M and 355M shapes and the shipped model (needs
                 `bash ../shared/tools/build-llamacpp.sh`; skipped with a message without it).
goal_llama_server  llama-server: `manas serve` beside llama.cpp's `llama-server`, 1, 16 and 64 clients (the same).
goal_kernels     f32-bandwidth, past-window: GPT-2-shape float32 decode on one thread against the machine's read
                 bandwidth; `manas generate -n 1024` past the shipped model's window (issue 34).

Decode speed depends on the machine and its load: compare the ratios of one run, not numbers across runs; the
report gives the load average before and after. Two threads on a busy machine are slower than one (OpenMP's
threads spin-wait for a core someone else holds), so measure these on a quiet one.
"""

from __future__ import annotations

import goal_busy
import goal_cache
import goal_dtype
import goal_gpt2_vs_hf
import goal_int8
import goal_kernels
import goal_llama_cpp
import goal_llama_server
import goal_pipelines
import goal_samples
import goal_startup
from harness import run_goals

MODULES = (
    goal_gpt2_vs_hf,
    goal_cache,
    goal_startup,
    goal_samples,
    goal_int8,
    goal_dtype,
    goal_busy,
    goal_pipelines,
    goal_llama_cpp,
    goal_llama_server,
    goal_kernels,
)
GOALS = {name: goal for module in MODULES for name, goal in module.GOALS.items()}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
