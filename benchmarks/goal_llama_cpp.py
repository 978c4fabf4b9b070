"""llama.cpp beside manas (issues 15, 16 and 25; needs `bash ../shared/tools/build-llamacpp.sh`, skipped with a
message without it): manas float32, int8 and int4 on its native engine (and, for the shipped model, on torch too,
side by side) against llama.cpp f32, q8_0 and q4_0 on the same weights (manas exports
the GGUF, llama-quantize makes q8_0 and q4_0), whole processes taking turns, each under `chrt -f 1` where
allowed, 1 and 2 threads: the GPT-2-124M shape (`llama-cpp`: pp64, 256 new tokens), the GPT-2-medium shape
(`llama-cpp-medium`: 355M, pp64, 64 new tokens) and the shipped model (`llama-cpp-shipped`: pp64, 128 new
tokens)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path

from harness import GPT2_NEW_TOKENS, GPT2_PROMPT_TOKENS, MANAS, Unavailable, gpt2_checkpoint, realtime, run_goals
from manas_cli.models import resolve_checkpoint

LLAMA_CPP_DIR = Path(os.environ.get("LLAMA_CPP_DIR", Path.home() / ".cache" / "manas-llamacpp")) / "build" / "bin"


LLAMA_CPP_TYPES = {"float32": "f32", "int8": "q8_0", "int4": "q4_0"}  # manas weights -> llama.cpp's peer type


def llama_cpp_files(checkpoint: Path, folder: Path) -> dict[str, Path]:
    """The checkpoint as GGUF files of llama.cpp's f32, q8_0 and q4_0, from manas's own export and llama-quantize."""
    if not (LLAMA_CPP_DIR / "llama-bench").is_file():
        raise Unavailable(
            f"llama.cpp is not built in {LLAMA_CPP_DIR.parent.parent}: "
            "run `bash ../shared/tools/build-llamacpp.sh` (about 5 minutes)"
        )
    files = {"f32": folder / f"{checkpoint.stem}-f32.gguf"}
    subprocess.run(
        [
            *MANAS,
            "export",
            str(checkpoint),
            "--format",
            "gguf",
            "--outtype",
            "f32",
            "--out",
            str(files["f32"]),
            "--force",
        ],
        check=True,
        capture_output=True,
    )
    for kind in ("q8_0", "q4_0"):
        files[kind] = folder / f"{checkpoint.stem}-{kind}.gguf"
        subprocess.run(
            [str(LLAMA_CPP_DIR / "llama-quantize"), str(files["f32"]), str(files[kind]), kind],
            check=True,
            capture_output=True,
        )
    return files


def llama_cpp_rates(gguf: Path, prompt_tokens: int, new_tokens: int, threads: int, depth: int = 0) -> dict[str, float]:
    """llama-bench's prefill and decode tokens/s (after `depth` tokens in the cache: its -d); --repack 0: its
    repacked path dies on CPUs with AMX."""
    done = subprocess.run(
        realtime(
            [
                str(LLAMA_CPP_DIR / "llama-bench"),
                "-m",
                str(gguf),
                "-p",
                str(prompt_tokens),
                "-n",
                str(new_tokens),
                "-t",
                str(threads),
                "-r",
                "1",
                "--repack",
                "0",
                "-d",
                str(depth),
                "-o",
                "json",
            ]
        ),
        capture_output=True,
        check=True,
        timeout=900,
    )
    tests = json.loads(done.stdout)
    return {
        "prefill": next(t["avg_ts"] for t in tests if t["n_prompt"]),
        "decode": next(t["avg_ts"] for t in tests if t["n_gen"]),
    }


def manas_bench_rates(
    checkpoint: Path,
    prompt_tokens: int,
    new_tokens: int,
    threads: int,
    weights: str,
    engine: str = "native",
    depth: int = 0,
) -> dict[str, float]:
    """A whole `manas bench` process's prefill and decode tokens/s (after `depth` tokens in the cache), as a user
    runs it."""
    quantize = [] if weights == "float32" else ["--quantize", weights]
    done = subprocess.run(
        realtime(
            [
                *MANAS,
                "bench",
                "-c",
                str(checkpoint),
                "--tokens",
                str(new_tokens),
                "--prompt-tokens",
                str(prompt_tokens),
                "--no-baseline",
                "--repeat",
                "1",
                "--threads",
                str(threads),
                "--json",
                "--engine",
                engine,
                "--depth",
                str(depth),
                *quantize,
            ]
        ),
        capture_output=True,
        check=True,
        timeout=900,
    )
    prefill, decode = json.loads(done.stdout)["tests"]
    return {"prefill": prefill["tokens_per_s_mean"], "decode": decode["tokens_per_s_mean"]}


def against_llama_cpp(
    checkpoint: Path, prompt_tokens: int, new_tokens: int, runs: int, torch_too: bool = False, depth: int = 0
) -> dict:
    """manas float32, int8 and int4 (the native engine; with torch_too, the torch engine's as well) beside
    llama.cpp f32, q8_0 and q4_0 on the same weights, every command a whole process, all of them taking turns
    round after round (the first round warms up), on 1 and on 2 threads; depth: tokens in the cache before both
    tests (llama-bench's -d, manas bench's --depth)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        gguf = llama_cpp_files(checkpoint, Path(folder))
        commands = {}
        for threads in (1, 2):
            for weights, peer in LLAMA_CPP_TYPES.items():
                commands[f"manas_{weights}_{threads}t"] = lambda w=weights, t=threads: manas_bench_rates(
                    checkpoint, prompt_tokens, new_tokens, t, w, depth=depth
                )
                commands[f"llama_cpp_{peer}_{threads}t"] = lambda p=peer, t=threads: llama_cpp_rates(
                    gguf[p], prompt_tokens, new_tokens, t, depth
                )
                if torch_too:
                    commands[f"manas_torch_{weights}_{threads}t"] = lambda w=weights, t=threads: manas_bench_rates(
                        checkpoint, prompt_tokens, new_tokens, t, w, "torch"
                    )
        samples = {name: [] for name in commands}
        for round_ in range(runs + 1):
            for name, measure in commands.items():
                figures = measure()
                if round_:
                    samples[name].append(figures)
    rates = {
        name: {key: round(statistics.median(s[key] for s in taken), 1) for key in ("prefill", "decode")}
        for name, taken in samples.items()
    }
    return {
        "tokens_per_s": rates,
        "decode_ratio": ratios_of(rates, "decode"),
        "prefill_ratio": ratios_of(rates, "prefill"),
    }


def ratios_of(rates: dict, test: str) -> dict[str, float]:
    """manas ÷ llama.cpp for one test ("decode" or "prefill"), each weight type against its peer, 1 and 2 threads."""
    return {
        f"{weights}_over_{peer}_{threads}t": round(
            rates[f"manas_{weights}_{threads}t"][test] / rates[f"llama_cpp_{peer}_{threads}t"][test], 2
        )
        for threads in (1, 2)
        for weights, peer in LLAMA_CPP_TYPES.items()
    }


def goal_llama_cpp_gpt2(runs: int) -> dict:
    """Issue 15: GPT-2-124M shape, pp64, 256 new tokens. Goals: int4 ≥ 1.2× q4_0, int8 ≥ 1.0× q8_0, float32 ≥ 1.0×
    f32 decode; int4 and int8 prefill ≥ 0.8× float32's."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        result = against_llama_cpp(gpt2_checkpoint(Path(folder)), GPT2_PROMPT_TOKENS, GPT2_NEW_TOKENS, runs)
    rates = result["tokens_per_s"]
    result["prefill_over_float32"] = {
        f"{weights}_{t}t": round(rates[f"manas_{weights}_{t}t"]["prefill"] / rates[f"manas_float32_{t}t"]["prefill"], 2)
        for weights in ("int8", "int4")
        for t in (1, 2)
    }
    return result


def goal_llama_cpp_medium(runs: int) -> dict:
    """Issue 34: the GPT-2-medium shape (355M, random weights), pp64, 64 new tokens. Goal: decode ≥ 1.2× and
    prefill ≥ 1.0× llama.cpp at every weight type, 1 and 2 threads."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        return against_llama_cpp(gpt2_checkpoint(Path(folder), "355M"), GPT2_PROMPT_TOKENS, 64, runs)


def goal_llama_cpp_shipped(runs: int) -> dict:
    """Issue 16: the shipped model, pp64, 128 new tokens within the window. Goals: float32 ≥ 1.0× llama.cpp f32,
    int8 and int4 ≥ 1.0× q8_0 decode, on 1 and on 2 threads."""
    result = against_llama_cpp(resolve_checkpoint(None), 64, 128, runs, torch_too=True)
    rates = result["tokens_per_s"]
    result["quantized_over_q8_0"] = {
        f"{weights}_{t}t": round(rates[f"manas_{weights}_{t}t"]["decode"] / rates[f"llama_cpp_q8_0_{t}t"]["decode"], 2)
        for weights in ("int8", "int4")
        for t in (1, 2)
    }
    return result


GOALS = {
    "llama-cpp": lambda args: goal_llama_cpp_gpt2(args.runs),
    "llama-cpp-medium": lambda args: goal_llama_cpp_medium(args.runs),
    "llama-cpp-shipped": lambda args: goal_llama_cpp_shipped(args.runs),
}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
