"""Reproduce the performance goals of manas in one run, each as a ratio measured side by side.

    python benchmarks/goals.py            # all goals (needs transformers for goal 1: pip install -e ".[test]")
    python benchmarks/goals.py --goal 1   # one goal
    python benchmarks/goals.py --json     # the numbers as JSON

1. GPT-2-124M shape, batch 1, 64-token prompt, 256 new tokens, float32, 2 threads: manas decode tokens/s against
   Hugging Face `generate` on the same random weights, and against the weight-bandwidth limit.
2. The shipped model: cached decode against crop-and-recompute within the window; per-token time across it.
3. Time to first token of a whole `manas generate` process against `python -c "import torch"`; `manas --help`.
4. `--num-samples 8` against one sample.

Issue 10 (int8 weights and both cores), every variant measured in turns within one run (`--goal int8` etc.):
int8          GPT-2-124M shape, 64-token prompt, 256 new tokens: int8 decode against manas float32 and Hugging
              Face `generate` float32 on 1 thread; int8 on 2 threads against 1.
threads       the same float32 decode (and pp64 prefill) on 2 threads against 1, and whether the tokens agree.
int8-shipped  the shipped model: int8 against float32 decode, on 1 and 2 threads.
int8-prefill  GPT-2-124M shape, pp64 and pp512 prefill: int8 against float32, on 1 and 2 threads.
dtype         bfloat16 and float16 against float32 (`--dtype`): the shipped model and the GPT-2-124M shape,
              prefill and decode.

Pipelines (`--goal pipelines`): 100 prompts of 5-60 tokens, 64 new tokens each, shipped model: `--jsonl` against a
shell loop of `manas generate` processes and against `--batch-size 1`. `--goal batch`: continuous batching's total
decode tokens/s at batch 1 to 16, GPT-2-124M shape and shipped model.

llama.cpp beside manas (`--goal llama-cpp`, `--goal llama-cpp-shipped`; needs `bash ../shared/tools/build-llamacpp.sh`,
skipped with a message without it): manas float32, int8 and int4 against llama.cpp f32, q8_0 and q4_0 on the same
weights (manas exports the GGUF, llama-quantize makes q8_0 and q4_0), whole processes taking turns, each under
`chrt -f 1` where allowed, 1 and 2 threads: the GPT-2-124M shape (pp64, 256 new tokens) and the shipped model (pp64,
128 new tokens).

A busy machine (`--goal busy`): the default thread choice against `--threads 1` and
`--threads 2`, each a whole `manas bench` process, on a quiet machine and beside one process spinning on a core.

Decode speed depends on the machine and its load: compare the ratios of one run, not numbers across runs; the
report gives the load average before and after. Two threads on a busy machine are slower than one (OpenMP's
threads spin-wait for a core someone else holds), so measure these on a quiet one.
"""

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
from pathlib import Path

import torch

from manas_cli.engine.bench import bench_prompt, run_once
from manas_cli.formats.checkpoint import load_checkpoint
from manas_cli.cli.commands.common import resolve_checkpoint
from manas_cli.engine.generation import generate, generate_reference
from manas_cli.engine.kv_cache import CacheSession
from manas_cli.engine.model import GPT, use_decode_layout
from manas_cli.engine.sampling import Sampler

GREEDY = Sampler(temperature=0.0)
GPT2_PROMPT_TOKENS, GPT2_NEW_TOKENS = 64, 256


class Unavailable(Exception):
    """A goal that this checkout cannot measure."""


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


def gpt2_pair():
    """Hugging Face's GPT-2-124M shape with random weights, and the same weights as a manas model (plain layout)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from manas_cli.formats.convert import build_model, config_from_hf, gpt2_state_to_manas

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config()).eval()
    config = config_from_hf(hf.config.to_dict(), Path("gpt2"))
    manas = build_model(config, gpt2_state_to_manas(hf.state_dict(), conv1d=True, source=Path("gpt2")), Path("gpt2"))
    return hf, manas


def hf_decode_rate(hf, prompt: torch.Tensor, new_tokens: int) -> float:
    """Hugging Face `generate`'s decode tokens/s: a run of new_tokens less a run of one (the prefill)."""

    def seconds(max_new: int) -> float:
        with torch.inference_mode():
            return _timed(lambda: hf.generate(prompt, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                                              pad_token_id=0))

    return (new_tokens - 1) / (seconds(new_tokens) - seconds(1))


def goal_gpt2_vs_hf(threads: int, runs: int) -> dict:
    torch.set_num_threads(threads)
    hf, manas = gpt2_pair()
    new_tokens = GPT2_NEW_TOKENS
    prompt = bench_prompt(manas, GPT2_PROMPT_TOKENS, 1)
    results = {"hf_generate": median_rate(runs, lambda: hf_decode_rate(hf, prompt, new_tokens))}
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


def interleaved(variants: dict, runs: int) -> dict[str, dict[str, float]]:
    """variants: name -> (threads, measure), measure() -> {figure: value}. The variants take turns, round after
    round, so that a change in the machine's load falls on all of them alike; the first round only warms up (first
    calls are several times slower). The median of each figure."""
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for round_ in range(runs + 1):
        for name, (threads, measure) in variants.items():
            torch.set_num_threads(threads)
            figures = measure()
            if round_:
                samples[name].append(figures)
    return {name: {key: statistics.median(s[key] for s in taken) for key in taken[0]} for name, taken in samples.items()}


def speeds(model: GPT, prompt: torch.Tensor, new_tokens: int) -> dict[str, float]:
    """Prefill and cached decode tokens/s of one greedy generation."""
    stats = run_once(generate(model, prompt, GREEDY, new_tokens), prompt.size(1), prompt.size(0))
    return {"prefill": stats.prefill_tokens_per_s, "decode": stats.decode_tokens_per_s}


def int8_copier():
    """A function making an int8 copy of a float model in its plain layout (int8 layers keep their own layout,
    as in the CLI); asked for before any model is built, so that a checkout without int8 skips at once."""
    try:
        from manas_cli.engine.quantize import quantize_model
    except ImportError:
        raise Unavailable("int8 weights (manas_cli.engine.quantize, issue 10) are not in this checkout") from None
    return lambda model: quantize_model(copy.deepcopy(model))


def greedy_tokens(model: GPT, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    return [step.tokens[0] for step in generate(model, prompt, GREEDY, new_tokens)]


def goal_int8_gpt2(runs: int) -> dict:
    int8_copy = int8_copier()
    hf, plain = gpt2_pair()
    int8 = int8_copy(plain)
    manas = use_decode_layout(plain)
    prompt = bench_prompt(manas, GPT2_PROMPT_TOKENS, 1)
    rates = interleaved({
        "int8_1_thread": (1, lambda: speeds(int8, prompt, GPT2_NEW_TOKENS)),
        "int8_2_threads": (2, lambda: speeds(int8, prompt, GPT2_NEW_TOKENS)),
        "float32_1_thread": (1, lambda: speeds(manas, prompt, GPT2_NEW_TOKENS)),
        "hf_float32_1_thread": (1, lambda: {"decode": hf_decode_rate(hf, prompt, GPT2_NEW_TOKENS)}),
    }, runs)
    decode = {name: figures["decode"] for name, figures in rates.items()}
    return {
        "decode_tokens_per_s": decode,
        "int8_over_float32_1_thread": decode["int8_1_thread"] / decode["float32_1_thread"],  # goal ≥ 2.5
        "int8_over_hf_1_thread": decode["int8_1_thread"] / decode["hf_float32_1_thread"],  # goal ≥ 3.5
        "int8_2_over_1_threads": decode["int8_2_threads"] / decode["int8_1_thread"],  # goal ≥ 1.6
        # llama.cpp q8_0 on the same weights, llama-bench -p 64 -n 256, measured on a Zen 4 host (issue 10)
        "int8_over_llama_cpp_q8_0_zen4": {"1_thread": decode["int8_1_thread"] / 110.9,
                                          "2_threads": decode["int8_2_threads"] / 164.7},
    }


def goal_float32_threads(runs: int) -> dict:
    _, plain = gpt2_pair()
    manas = use_decode_layout(plain)
    prompt = bench_prompt(manas, GPT2_PROMPT_TOKENS, 1)
    rates = interleaved({f"{threads}_threads": (threads, lambda: speeds(manas, prompt, GPT2_NEW_TOKENS))
                         for threads in (1, 2)}, runs)
    tokens = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        tokens[threads] = greedy_tokens(manas, prompt, 64)
    return {
        "tokens_per_s": rates,
        "decode_2_over_1_threads": rates["2_threads"]["decode"] / rates["1_threads"]["decode"],  # goal ≥ 1.4
        "prefill_2_over_1_threads": rates["2_threads"]["prefill"] / rates["1_threads"]["prefill"],
        "greedy_tokens_agree_of_64": sum(a == b for a, b in zip(tokens[1], tokens[2])),
    }


def goal_int8_shipped(runs: int) -> dict:
    int8_copy = int8_copier()
    model = shipped_model(1)
    int8 = int8_copy(load_checkpoint(resolve_checkpoint(None)).model)
    prompt = bench_prompt(model, 16, 1)
    new_tokens = model.config.block_size - prompt.size(1)  # every step within the window: no re-prefill
    variants = {}
    for threads in (1, 2):
        variants[f"float32_{threads}_threads"] = (threads, lambda: speeds(model, prompt, new_tokens))
        variants[f"int8_{threads}_threads"] = (threads, lambda: speeds(int8, prompt, new_tokens))
    rates = interleaved(variants, runs)
    return {
        "tokens_per_s": rates,
        "int8_over_float32_decode": {f"{t}_threads": rates[f"int8_{t}_threads"]["decode"]
                                     / rates[f"float32_{t}_threads"]["decode"] for t in (1, 2)},
    }


def goal_int8_prefill(runs: int) -> dict:
    int8_copy = int8_copier()
    _, plain = gpt2_pair()
    int8 = int8_copy(plain)
    manas = use_decode_layout(plain)
    variants = {}
    for prompt_tokens in (64, 512):
        prompt = bench_prompt(manas, prompt_tokens, 1)
        for threads in (1, 2):
            for weights, model in (("float32", manas), ("int8", int8)):
                variants[f"pp{prompt_tokens}_{weights}_{threads}_threads"] = (
                    threads, lambda model=model, prompt=prompt: speeds(model, prompt, 1))
    prefill = {name: figures["prefill"] for name, figures in interleaved(variants, runs).items()}
    return {
        "prefill_tokens_per_s": prefill,
        "int8_over_float32": {  # goal ≥ 0.8
            f"pp{p}_{t}_threads": prefill[f"pp{p}_int8_{t}_threads"] / prefill[f"pp{p}_float32_{t}_threads"]
            for p in (64, 512) for t in (1, 2)
        },
    }


def goal_dtypes(runs: int) -> dict:
    """Half-precision weights (and activations) against float32, as `--dtype` runs them."""
    _, gpt2 = gpt2_pair()
    shipped = load_checkpoint(resolve_checkpoint(None)).model
    cases = {  # name: (float32 model, prompt tokens, new tokens): the shipped model stays within its window
        "gpt2": (gpt2, GPT2_PROMPT_TOKENS, GPT2_NEW_TOKENS),
        "shipped": (shipped, 64, shipped.config.block_size - 64),
    }
    variants = {}
    for case, (model, prompt_tokens, new_tokens) in cases.items():
        prompt = bench_prompt(model, prompt_tokens, 1)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            typed = use_decode_layout(copy.deepcopy(model).to(dtype))
            for threads in (1, 2):
                variants[f"{case}_{str(dtype).removeprefix('torch.')}_{threads}_threads"] = (
                    threads, lambda typed=typed, prompt=prompt, new_tokens=new_tokens: speeds(typed, prompt, new_tokens))
    rates = interleaved(variants, runs)
    return {
        "tokens_per_s": rates,
        "over_float32": {
            f"{case}_{half}_{t}_threads_{figure}": rates[f"{case}_{half}_{t}_threads"][figure]
            / rates[f"{case}_float32_{t}_threads"][figure]
            for case in cases for half in ("bfloat16", "float16") for t in (1, 2) for figure in ("prefill", "decode")
        },
    }


def gpt2_checkpoint(folder: Path) -> Path:
    """A GPT-2-124M-shaped manas checkpoint with random weights and GPT-2's tokenizer, written once into folder."""
    from manas_cli.formats.checkpoint import save_checkpoint
    from manas_cli.engine.model import GPTConfig
    from manas_cli.formats.tokenizer import spec_from_tiktoken_file

    path = folder / "gpt2-random.safetensors"
    if not path.exists():
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_kv_head=12, n_embd=768)
        ranks = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpt2.tiktoken"
        save_checkpoint(path, GPT(config).eval(), spec_from_tiktoken_file(ranks))
    return path


def bench_decode_rate(checkpoint: Path, tokens: int, threads: list[str]) -> tuple[float, int]:
    """A whole `manas bench` process's decode tokens/s and thread count: the default thread rule runs at start."""
    env = {name: value for name, value in os.environ.items() if name not in ("OMP_NUM_THREADS", "MANAS_THREADS")}
    done = subprocess.run([sys.executable, "-m", "manas_cli", "bench", "-c", str(checkpoint), "--tokens", str(tokens),
                           "--prompt-tokens", "64", "--no-baseline", "--repeat", "2", "--json", *threads],
                          capture_output=True, env=env, timeout=900, check=True)
    report = json.loads(done.stdout)
    return report["tests"][1]["tokens_per_s_mean"], report["model"]["threads"]


def goal_busy_machine(runs: int) -> dict:
    """Issue 19's goal: the default thread choice against --threads 1 and 2, on a quiet machine and with one other
    process spinning on a core (started before each manas process, as a browser or a build would be)."""
    import tempfile

    variants = {"default": [], "threads-1": ["--threads", "1"], "threads-2": ["--threads", "2"]}
    result = {}
    with tempfile.TemporaryDirectory() as folder:
        models = {"shipped": (resolve_checkpoint(None), 128), "gpt2-124M": (gpt2_checkpoint(Path(folder)), 48)}
        for condition in ("quiet", "busy"):
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if condition == "busy" else None
            try:
                time.sleep(0.5 if spinner else 0)
                for model, (path, tokens) in models.items():
                    rates = {name: [] for name in variants}
                    for _ in range(runs):  # the variants take turns
                        for name, flags in variants.items():
                            rates[name].append(bench_decode_rate(path, tokens, flags))
                    median = {name: statistics.median(rate for rate, _ in runs_) for name, runs_ in rates.items()}
                    row = {f"{name}_tok_s": round(value, 1) for name, value in median.items()}
                    row["default_threads"] = sorted({threads for _, threads in rates["default"]})
                    row["default_vs_threads_1"] = round(median["default"] / median["threads-1"], 2)
                    row["default_vs_best"] = round(median["default"] / max(median["threads-1"], median["threads-2"]), 2)
                    result[f"{condition}_{model}"] = row
            finally:
                if spinner:
                    spinner.kill()
                    spinner.wait()
    result["goal"] = "busy: default ≥ 0.8× --threads 1; quiet: default ≥ 0.9× the best of --threads 1 and 2"
    return result


LLAMA_CPP_DIR = Path(os.environ.get("LLAMA_CPP_DIR", Path.home() / ".cache" / "manas-llamacpp")) / "build" / "bin"
LLAMA_CPP_TYPES = {"float32": "f32", "int8": "q8_0", "int4": "q4_0"}  # manas weights -> llama.cpp's peer type


def llama_cpp_files(checkpoint: Path, folder: Path) -> dict[str, Path]:
    """The checkpoint as GGUF files of llama.cpp's f32, q8_0 and q4_0, from manas's own export and llama-quantize."""
    if not (LLAMA_CPP_DIR / "llama-bench").is_file():
        raise Unavailable(f"llama.cpp is not built in {LLAMA_CPP_DIR.parent.parent}: "
                          "run `bash ../shared/tools/build-llamacpp.sh` (about 5 minutes)")
    files = {"f32": folder / f"{checkpoint.stem}-f32.gguf"}
    subprocess.run([sys.executable, "-m", "manas_cli", "export", str(checkpoint), "--format", "gguf", "--outtype",
                    "f32", "--out", str(files["f32"]), "--force"], check=True, capture_output=True)
    for kind in ("q8_0", "q4_0"):
        files[kind] = folder / f"{checkpoint.stem}-{kind}.gguf"
        subprocess.run([str(LLAMA_CPP_DIR / "llama-quantize"), str(files["f32"]), str(files[kind]), kind],
                       check=True, capture_output=True)
    return files


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


def llama_cpp_rates(gguf: Path, prompt_tokens: int, new_tokens: int, threads: int) -> dict[str, float]:
    """llama-bench's prefill and decode tokens/s; --repack 0: its repacked path dies on CPUs with AMX."""
    done = subprocess.run(realtime([str(LLAMA_CPP_DIR / "llama-bench"), "-m", str(gguf), "-p", str(prompt_tokens),
                                    "-n", str(new_tokens), "-t", str(threads), "-r", "1", "--repack", "0",
                                    "-o", "json"]), capture_output=True, check=True, timeout=900)
    tests = json.loads(done.stdout)
    return {"prefill": next(t["avg_ts"] for t in tests if t["n_prompt"]),
            "decode": next(t["avg_ts"] for t in tests if t["n_gen"])}


def manas_bench_rates(checkpoint: Path, prompt_tokens: int, new_tokens: int, threads: int,
                      weights: str) -> dict[str, float]:
    """A whole `manas bench` process's prefill and decode tokens/s, as a user runs it."""
    quantize = [] if weights == "float32" else ["--quantize", weights]
    done = subprocess.run(realtime([sys.executable, "-m", "manas_cli", "bench", "-c", str(checkpoint), "--tokens",
                                    str(new_tokens), "--prompt-tokens", str(prompt_tokens), "--no-baseline",
                                    "--repeat", "1", "--threads", str(threads), "--json", *quantize]),
                          capture_output=True, check=True, timeout=900)
    prefill, decode = json.loads(done.stdout)["tests"]
    return {"prefill": prefill["tokens_per_s_mean"], "decode": decode["tokens_per_s_mean"]}


def against_llama_cpp(checkpoint: Path, prompt_tokens: int, new_tokens: int, runs: int) -> dict:
    """manas float32, int8 and int4 beside llama.cpp f32, q8_0 and q4_0 on the same weights, every command a whole
    process, all of them taking turns round after round (the first round warms up), on 1 and on 2 threads."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        gguf = llama_cpp_files(checkpoint, Path(folder))
        commands = {}
        for threads in (1, 2):
            for weights, peer in LLAMA_CPP_TYPES.items():
                commands[f"manas_{weights}_{threads}t"] = lambda w=weights, t=threads: manas_bench_rates(
                    checkpoint, prompt_tokens, new_tokens, t, w)
                commands[f"llama_cpp_{peer}_{threads}t"] = lambda p=peer, t=threads: llama_cpp_rates(
                    gguf[p], prompt_tokens, new_tokens, t)
        samples = {name: [] for name in commands}
        for round_ in range(runs + 1):
            for name, measure in commands.items():
                figures = measure()
                if round_:
                    samples[name].append(figures)
    rates = {name: {key: round(statistics.median(s[key] for s in taken), 1) for key in ("prefill", "decode")}
             for name, taken in samples.items()}
    ratios = {f"{weights}_over_{peer}_{threads}t": round(rates[f"manas_{weights}_{threads}t"]["decode"]
                                                          / rates[f"llama_cpp_{peer}_{threads}t"]["decode"], 2)
              for threads in (1, 2) for weights, peer in LLAMA_CPP_TYPES.items()}
    return {"tokens_per_s": rates, "decode_ratio": ratios}


def goal_llama_cpp_gpt2(runs: int) -> dict:
    """Issue 15: GPT-2-124M shape, pp64, 256 new tokens. Goals: int4 ≥ 1.2× q4_0, int8 ≥ 1.0× q8_0, float32 ≥ 1.0×
    f32 decode; int4 and int8 prefill ≥ 0.8× float32's."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        result = against_llama_cpp(gpt2_checkpoint(Path(folder)), GPT2_PROMPT_TOKENS, GPT2_NEW_TOKENS, runs)
    rates = result["tokens_per_s"]
    result["prefill_over_float32"] = {f"{weights}_{t}t": round(rates[f"manas_{weights}_{t}t"]["prefill"]
                                                               / rates[f"manas_float32_{t}t"]["prefill"], 2)
                                      for weights in ("int8", "int4") for t in (1, 2)}
    return result


def goal_llama_cpp_shipped(runs: int) -> dict:
    """Issue 16: the shipped model, pp64, 128 new tokens within the window. Goals: float32 ≥ 1.0× llama.cpp f32,
    int8 and int4 ≥ 1.0× q8_0 decode, on 1 and on 2 threads."""
    result = against_llama_cpp(resolve_checkpoint(None), 64, 128, runs)
    rates = result["tokens_per_s"]
    result["quantized_over_q8_0"] = {f"{weights}_{t}t": round(rates[f"manas_{weights}_{t}t"]["decode"]
                                                              / rates[f"llama_cpp_q8_0_{t}t"]["decode"], 2)
                                     for weights in ("int8", "int4") for t in (1, 2)}
    return result


def pipeline_prompts(count: int, seed: int = 0) -> list[str]:
    """count prompts of 5 to 60 tokens of the shipped model, cut from Tiny Shakespeare."""
    import random

    text = (Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt").read_text()
    encoding = load_checkpoint(resolve_checkpoint(None)).encoding
    rng, prompts = random.Random(seed), []
    for _ in range(count):
        start, length = rng.randrange(len(text) - 1000), rng.randint(5, 60)
        prompts.append(encoding.decode(encoding.encode_ordinary(text[start : start + 1000])[:length]))
    return prompts


def goal_pipelines(count: int = 100, new_tokens: int = 64) -> dict:
    """Pipelines, goal 1: `count` prompts, `new_tokens` each, on the shipped model: one `--jsonl` process (its
    default batch size, and --batch-size 1) against a shell loop of one `manas generate` process per prompt."""
    prompts = pipeline_prompts(count)
    lines = "".join(json.dumps({"prompt": p, "max_tokens": new_tokens, "temperature": 0}) + "\n" for p in prompts)
    manas = [sys.executable, "-m", "manas_cli", "generate"]

    def timed(*command: str, stdin: str = "") -> float:
        started = time.perf_counter()
        subprocess.run(command, input=stdin.encode(), capture_output=True, check=True)
        return time.perf_counter() - started

    batched = timed(*manas, "--jsonl", stdin=lines)
    one_row = timed(*manas, "--jsonl", "--batch-size", "1", stdin=lines)
    loop = sum(timed(*manas, "-p", prompt, "-n", str(new_tokens), "-t", "0") for prompt in prompts)
    return {"prompts": count, "new_tokens": new_tokens, "shell_loop_s": round(loop, 1), "jsonl_s": round(batched, 2),
            "jsonl_batch_1_s": round(one_row, 2), "vs_shell_loop": round(loop / batched, 1),
            "vs_batch_1": round(one_row / batched, 2), "goal": "≥ 20× the shell loop, ≥ 3× --batch-size 1"}


def batched_decode_rate(model: GPT, batch: int, new_tokens: int) -> float:
    """Total decode tokens/s of `batch` greedy requests of a 64-token prompt decoding together."""
    from manas_cli.engine.batching import Request, generate_batched

    prompt = bench_prompt(model, 64, 1)[0].tolist()
    requests = [Request(i, prompt, GREEDY, new_tokens) for i in range(batch)]
    decoded, seconds = 0, 0.0
    for tokens in generate_batched(model, iter(requests), batch):
        if tokens[0].kind == "decode":
            decoded, seconds = decoded + len(tokens), seconds + tokens[0].seconds
    return decoded / seconds


def goal_batch_sizes(runs: int) -> dict:
    """Pipelines, goal 2 and the default batch size: total decode tokens/s of continuous batching at batch 1 to 16,
    on the GPT-2-124M shape (weight-bound: more rows read the weights once) and the shipped model."""
    import tempfile

    result = {}
    with tempfile.TemporaryDirectory() as folder:
        models = {"gpt2-124M": (gpt2_checkpoint(Path(folder)), 32), "shipped": (resolve_checkpoint(None), 128)}
        for name, (path, new_tokens) in models.items():
            model = use_decode_layout(load_checkpoint(path).model)
            rates = {batch: median_rate(runs, lambda: batched_decode_rate(model, batch, new_tokens))
                     for batch in (1, 2, 4, 8, 16)}
            result[name] = {f"batch_{batch}_tok_s": round(rate, 1) for batch, rate in rates.items()}
            result[name]["batch_8_vs_1"] = round(rates[8] / rates[1], 2)
    result["threads"] = torch.get_num_threads()
    result["goal"] = "GPT-2-124M shape: batch 8 ≥ 4× batch 1"
    return result


def cpu_name() -> str:
    """The CPU model and the vector extensions that decide which kernels torch runs."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    name = lines.get("model name\t", platform.processor() or platform.machine()).strip()
    flags = set(lines.get("flags\t\t", "").split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    return f"{name}, {os.cpu_count()} cores, " + " ".join(flag for flag in wanted if flag in flags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    goals = {
        "1": lambda: goal_gpt2_vs_hf(args.threads, args.runs),
        "2": lambda: goal_cache_vs_recompute(args.threads, args.runs),
        "3": lambda: goal_startup(args.runs),
        "4": lambda: goal_batched_samples(args.threads, args.runs),
        "int8": lambda: goal_int8_gpt2(args.runs),
        "threads": lambda: goal_float32_threads(args.runs),
        "int8-shipped": lambda: goal_int8_shipped(args.runs),
        "int8-prefill": lambda: goal_int8_prefill(args.runs),
        "dtype": lambda: goal_dtypes(args.runs),
        "busy": lambda: goal_busy_machine(args.runs),
        "pipelines": lambda: goal_pipelines(),
        "batch": lambda: goal_batch_sizes(args.runs),
        "llama-cpp": lambda: goal_llama_cpp_gpt2(args.runs),
        "llama-cpp-shipped": lambda: goal_llama_cpp_shipped(args.runs),
    }
    parser.add_argument("--goal", choices=goals, action="append", help="run only these goals")
    parser.add_argument("--threads", type=int, default=2, help="threads of goals 1, 2 and 4 (the others set their own)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
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
            report[f"goal_{name}"] = goals[name]()
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


if __name__ == "__main__":
    main()
