"""Reproduce the performance goals of manas in one run, each as a ratio measured side by side.

    python benchmarks/goals.py            # all goals (needs transformers for goal 1: pip install -e ".[test]")
    python benchmarks/goals.py --goal 1   # one goal
    python benchmarks/goals.py --json     # the numbers as JSON

1. GPT-2-124M shape, batch 1, 64-token prompt, 256 new tokens, float32, 2 threads: manas decode tokens/s against
   Hugging Face `generate` on the same random weights, and against the weight-bandwidth limit.
2. The shipped model: cached decode against crop-and-recompute within the window; per-token time across it.
3. Time to first token of a whole `manas generate` process against `python -c "import torch"`; `manas --help`.
4. `--num-samples 8` against one sample.

Decode speed depends on the machine and its load: compare the ratios of one run, not numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from manas_cli.bench import run_once
from manas_cli.checkpoint import load_checkpoint
from manas_cli.commands import resolve_checkpoint
from manas_cli.generation import generate, generate_reference
from manas_cli.kv_cache import CacheSession
from manas_cli.model import GPT, use_decode_layout
from manas_cli.sampling import Sampler

GREEDY = Sampler(temperature=0.0)


def median_rate(runs: int, measure) -> float:
    measure()  # warm-up: first calls are several times slower
    return statistics.median(measure() for _ in range(runs))


def manas_decode_rate(model: GPT, prompt: torch.Tensor, new_tokens: int, allocation: str) -> float:
    session = CacheSession(model, allocation)
    return run_once(generate(model, prompt, GREEDY, new_tokens, session=session), prompt.size(1), prompt.size(0)).decode_tokens_per_s


def read_bandwidth_bytes_per_s(gib: float = 1.0) -> float:
    """Streaming read bandwidth: the best of a few sums over a buffer far larger than the caches."""
    buffer = torch.ones(int(gib * 2**30) // 4)
    buffer.sum()
    best = min(_timed(buffer.sum) for _ in range(5))
    return buffer.numel() * 4 / best


def matvec_bandwidth_bytes_per_s(in_features: int = 768, out_features: int = 3072, total_gib: float = 0.5) -> float:
    """How fast BLAS streams weights through matrix-vector products (decode's case): layer-shaped matrices,
    stored (in, out), far more of them than the caches hold, the best of a few passes."""
    count = int(total_gib * 2**30) // (in_features * out_features * 4)
    weights = [torch.randn(out_features, in_features).t().contiguous().t() for _ in range(count)]
    x = torch.randn(1, in_features)

    def stream() -> None:
        for weight in weights:
            torch.nn.functional.linear(x, weight)

    stream()
    best = min(_timed(stream) for _ in range(3))
    return count * in_features * out_features * 4 / best


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def goal_gpt2_vs_hf(threads: int, runs: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    from manas_cli.convert import build_model, config_from_hf, gpt2_state_to_manas

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config()).eval()  # GPT-2-124M's shape, random weights
    config = config_from_hf(hf.config.to_dict(), Path("gpt2"))
    manas = build_model(config, gpt2_state_to_manas(hf.state_dict(), conv1d=True, source=Path("gpt2")), Path("gpt2"))
    prompt_tokens, new_tokens = 64, 256
    prompt = torch.randint(config.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))

    def hf_generate(max_new: int) -> float:
        with torch.inference_mode():
            return _timed(lambda: hf.generate(prompt, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                                              pad_token_id=0))

    def hf_rate() -> float:
        return (new_tokens - 1) / (hf_generate(new_tokens) - hf_generate(1))

    results = {"hf_generate": median_rate(runs, hf_rate)}
    results["manas_plain_layout_dynamic"] = median_rate(runs, lambda: manas_decode_rate(manas, prompt, new_tokens, "dynamic"))
    use_decode_layout(manas)
    for allocation in ("dynamic", "static"):
        results[f"manas_{allocation}"] = median_rate(runs, lambda: manas_decode_rate(manas, prompt, new_tokens, allocation))
    weight_bytes = sum(p.numel() * p.element_size() for p in manas.parameters())
    weight_bytes -= manas.position_embedding.weight.numel() * 4  # one row read per token, not the table
    read_bandwidth = read_bandwidth_bytes_per_s()
    matvec_bandwidth = matvec_bandwidth_bytes_per_s()
    best = max(results["manas_dynamic"], results["manas_static"])
    return {
        "tokens_per_s": results,
        "weight_bytes_per_token": weight_bytes,
        "read_bandwidth_gb_per_s": read_bandwidth / 1e9,
        "matvec_bandwidth_gb_per_s": matvec_bandwidth / 1e9,
        "read_limit_tokens_per_s": read_bandwidth / weight_bytes,
        "matvec_limit_tokens_per_s": matvec_bandwidth / weight_bytes,
        "ratio_vs_hf": best / results["hf_generate"],
        "fraction_of_read_limit": best * weight_bytes / read_bandwidth,
        "fraction_of_matvec_limit": best * weight_bytes / matvec_bandwidth,
    }


def shipped_model(threads: int):
    torch.set_num_threads(threads)
    checkpoint = load_checkpoint(resolve_checkpoint(None))
    return use_decode_layout(checkpoint.model)


def goal_cache_vs_recompute(threads: int, runs: int) -> dict:
    model = shipped_model(threads)
    new_tokens = model.config.block_size  # a 1-token prompt: every step stays within the window
    prompt = torch.zeros(1, 1, dtype=torch.long)
    cached = median_rate(runs, lambda: manas_decode_rate(model, prompt, new_tokens, "dynamic"))
    baseline = median_rate(runs, lambda: run_once(generate_reference(model, prompt, GREEDY, new_tokens), 1, 1).decode_tokens_per_s)
    steps = [s for s in generate(model, prompt, GREEDY, new_tokens) if s.kind == "decode"]
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


def goal_startup(runs: int) -> dict:
    manas = [sys.executable, "-m", "manas_cli"]

    def first_byte(command: list[str]) -> float:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        process.stdout.read(1)
        elapsed = time.perf_counter() - started
        process.stdout.read()
        process.wait()
        return elapsed

    def whole(command: list[str]) -> float:
        return _timed(lambda: subprocess.run(command, capture_output=True, check=True))

    import_torch = statistics.median(whole([sys.executable, "-c", "import torch"]) for _ in range(runs))
    ttft = statistics.median(first_byte(manas + ["generate", "-p", "ROMEO:", "-n", "8", "--seed", "1"]) for _ in range(runs))
    help_s = statistics.median(whole(manas + ["--help"]) for _ in range(runs))
    return {"import_torch_s": import_torch, "ttft_s": ttft, "ttft_minus_import_torch_s": ttft - import_torch, "help_s": help_s}


def goal_batched_samples(threads: int, runs: int) -> dict:
    model = shipped_model(threads)
    prompt = torch.zeros(1, 16, dtype=torch.long)

    def seconds(batch: int) -> float:
        return _timed(lambda: run_once(generate(model, prompt.repeat(batch, 1), GREEDY, 200), 16, batch))

    one = median_rate(runs, lambda: seconds(1))
    eight = median_rate(runs, lambda: seconds(8))
    return {"one_sample_s": one, "eight_samples_s": eight, "ratio_to_8x_one": eight / (8 * one)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--goal", type=int, choices=(1, 2, 3, 4), action="append", help="run only these goals")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    goals = {
        1: lambda: goal_gpt2_vs_hf(args.threads, args.runs),
        2: lambda: goal_cache_vs_recompute(args.threads, args.runs),
        3: lambda: goal_startup(args.runs),
        4: lambda: goal_batched_samples(args.threads, args.runs),
    }
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "threads": args.threads,
        "date": time.strftime("%Y-%m-%d"),
    }
    for number in args.goal or sorted(goals):
        report[f"goal_{number}"] = goals[number]()
        if not args.json:
            print(f"goal {number}: " + json.dumps(report[f"goal_{number}"], indent=2), flush=True)
    if args.json:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
