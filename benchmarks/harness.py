"""What every benchmark shares: models to measure (the shipped one, GPT-2-124M's shape with random weights), timing
(medians after a warm-up, variants taking turns round after round), whole processes at real-time priority where
the machine allows it, the CPU's name, and run_goals, the command line of each goal module and of goals.py.

A goal module holds GOALS, name -> function(args) -> a dict of figures; `python benchmarks/goal_X.py` runs its own,
`python benchmarks/goals.py` all of them."""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from manas_cli.engine.bench import run_once
from manas_cli.engine.generation import generate
from manas_cli.engine.sampling import Sampler
from manas_cli.formats.checkpoint import load_checkpoint
from manas_cli.models import resolve_checkpoint
from manas_cli.torch_engine.engine import TorchEngine
from manas_cli.torch_engine.kv_cache import CacheSession
from manas_cli.torch_engine.model import GPT, use_decode_layout

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"  # GPT-2's ranks and Tiny Shakespeare's opening, carried with the tests
MANAS = [sys.executable, "-m", "manas_cli"]
GPT2_PROMPT_TOKENS, GPT2_NEW_TOKENS = 64, 256

GREEDY = Sampler(temperature=0.0)


class Unavailable(Exception):
    """A goal that this checkout cannot measure."""


def median_rate(runs: int, measure) -> float:
    measure()  # warm-up: first calls are several times slower
    return statistics.median(measure() for _ in range(runs))


def interleaved(variants: dict, runs: int) -> dict[str, dict[str, float]]:
    """variants: name -> (threads, measure), measure() -> {figure: value}; threads None for a measure that runs a
    process of its own. The variants take turns, round after round, so that a change in the machine's load falls on
    all of them alike; the first round only warms up (first calls are several times slower). The median of each
    figure."""
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for round_ in range(runs + 1):
        for name, (threads, measure) in variants.items():
            if threads is not None:
                torch.set_num_threads(threads)
            figures = measure()
            if round_:
                samples[name].append(figures)
    return {
        name: {key: statistics.median(s[key] for s in taken) for key in taken[0]} for name, taken in samples.items()
    }


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


@functools.cache
def realtime_allowed() -> bool:
    try:
        return subprocess.run(["chrt", "-f", "1", "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def realtime(command: list[str]) -> list[str]:
    """The command at real-time priority where the machine allows it: the scheduler then lets no other process cut
    into a measurement on a shared machine (OpenMP's spin-waits are the first to suffer)."""
    return ["chrt", "-f", "1", *command] if realtime_allowed() else command


def cpu_name() -> str:
    """The CPU model and the vector extensions that decide which kernels torch runs."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    name = lines.get("model name\t", platform.processor() or platform.machine()).strip()
    flags = set(lines.get("flags\t\t", "").split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    return f"{name}, {os.cpu_count()} cores, " + " ".join(flag for flag in wanted if flag in flags)


def shipped_model(threads: int):
    torch.set_num_threads(threads)
    checkpoint = load_checkpoint(resolve_checkpoint(None))
    return use_decode_layout(checkpoint.model)


def gpt2_pair():
    """Hugging Face's GPT-2-124M shape with random weights, and the same weights as a manas model (plain layout)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from manas_cli.formats.gpt2 import config_from_hf, gpt2_state_to_manas
    from manas_cli.formats.importing import build_model

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config()).eval()
    config = config_from_hf(hf.config.to_dict(), Path("gpt2"))
    manas = build_model(config, gpt2_state_to_manas(hf.state_dict(), conv1d=True, source=Path("gpt2")), Path("gpt2"))
    return hf, manas


GPT2_SHAPES = {"124M": (12, 12, 768), "355M": (24, 16, 1024)}  # GPT-2 and GPT-2-medium: layers, heads, width


def gpt2_checkpoint(folder: Path, size: str = "124M") -> Path:
    """A GPT-2-shaped manas checkpoint (124M, or GPT-2-medium's 355M) with random weights and GPT-2's tokenizer,
    written once into folder."""
    from manas_cli.formats.checkpoint import save_checkpoint
    from manas_cli.formats.tokenizer import spec_from_tiktoken_file
    from manas_cli.torch_engine.model import GPTConfig

    path = folder / ("gpt2-random.safetensors" if size == "124M" else f"gpt2-{size}-random.safetensors")
    if not path.exists():
        torch.manual_seed(0)
        n_layer, n_head, n_embd = GPT2_SHAPES[size]
        config = GPTConfig(
            vocab_size=50257, block_size=1024, n_layer=n_layer, n_head=n_head, n_kv_head=n_head, n_embd=n_embd
        )
        ranks = DATA / "gpt2.tiktoken"
        save_checkpoint(path, GPT(config).eval(), spec_from_tiktoken_file(ranks))
    return path


def manas_decode_rate(model: GPT, prompt: torch.Tensor, new_tokens: int, allocation: str) -> float:
    session = CacheSession(model, allocation)
    return run_once(
        generate(TorchEngine(model), prompt, GREEDY, new_tokens, session=session), prompt.size(1), prompt.size(0)
    ).decode_tokens_per_s


def hf_decode_rate(hf, prompt: torch.Tensor, new_tokens: int) -> float:
    """Hugging Face `generate`'s decode tokens/s: a run of new_tokens less a run of one (the prefill)."""

    def seconds(max_new: int) -> float:
        with torch.inference_mode():
            return timed(
                lambda: hf.generate(
                    prompt, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=0
                )
            )

    return (new_tokens - 1) / (seconds(new_tokens) - seconds(1))


def speeds(model: GPT, prompt: torch.Tensor, new_tokens: int) -> dict[str, float]:
    """Prefill and cached decode tokens/s of one greedy generation."""
    stats = run_once(generate(TorchEngine(model), prompt, GREEDY, new_tokens), prompt.size(1), prompt.size(0))
    return {"prefill": stats.prefill_tokens_per_s, "decode": stats.decode_tokens_per_s}


def greedy_tokens(model: GPT, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    return [step.tokens[0] for step in generate(TorchEngine(model), prompt, GREEDY, new_tokens)]


def int8_copier():
    """A function making an int8 copy of a float model in its plain layout (int8 layers keep their own layout,
    as in the CLI); asked for before any model is built, so that a checkout without int8 skips at once."""
    try:
        from manas_cli.torch_engine.quantize import quantize_model
    except ImportError:
        raise Unavailable("int8 weights (manas_cli.torch_engine.quantize, issue 10) are not in this checkout") from None
    return lambda model: quantize_model(copy.deepcopy(model))


def run_goals(goals: dict[str, Callable[[argparse.Namespace], dict]], description: str) -> None:
    """The command line of a goal module (and of goals.py): --goal to choose, --runs, --threads, --json; the report
    names the machine, torch, the date and the load average around the run."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--goal", choices=goals, action="append", help="run only these goals")
    parser.add_argument("--threads", type=int, default=2, help="threads of goals 1, 2 and 4 (the others set their own)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--weights", choices=("float32", "int8", "int4"), default="float32", help="weights of the goals that take one"
    )
    parser.add_argument(
        "--slots", type=int, default=16, help="rows a server decodes together (--batch-size; llama-server's -np)"
    )
    args = parser.parse_args()
    report = {
        "machine": cpu_name(),
        "torch": torch.__version__,
        "threads": args.threads,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_average_before": os.getloadavg()[0],
    }
    for name in args.goal or goals:
        try:
            report[f"goal_{name}"] = goals[name](args)
        except Unavailable as exc:
            report[f"goal_{name}"] = {"skipped": str(exc)}
            print(f"goal {name} skipped: {exc}", file=sys.stderr, flush=True)
            continue
        if not args.json:
            print(f"goal {name}: " + json.dumps(report[f"goal_{name}"], indent=2), flush=True)
    report["load_average_after"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"load average {report['load_average_before']:.2f} before, {report['load_average_after']:.2f} after")
