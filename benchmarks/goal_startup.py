"""Start-up as whole processes (issue 26): `manas generate` on the native engine, which never imports torch, beside
the same command on the torch engine (the start-up manas had before) and llama.cpp's `llama-completion` on the
same model's GGUF, taking turns round after round, each under `chrt -f 1` where allowed; medians of --runs (at
least 5). Also goal 3 of the first issues: time to first token against `python -c "import torch"`.

startup       generate -p "ROMEO:" -n 100 -t 0: whole process, time to first token (from the spawn to the first
              byte on stdout), peak memory (the child's maximum resident set).
startup-loop  a shell loop of 10 `manas generate` processes, one prompt each, 30 tokens.
startup-score `manas score` of Tiny Shakespeare's last 10%, and `manas bench -n 32 -r 1 --no-baseline`, whole
              processes on each engine, and whether each imported torch.
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from goal_llama_cpp import LLAMA_CPP_DIR
from harness import DATA, MANAS, ROOT, Unavailable, interleaved, realtime, run_goals, timed

PROMPT = "ROMEO:"


def goal_import_torch(runs: int) -> dict:
    def whole(command: list[str]) -> float:
        return timed(lambda: subprocess.run(command, capture_output=True, check=True))

    import_torch = statistics.median(whole([sys.executable, "-c", "import torch"]) for _ in range(runs))
    ttft = statistics.median(
        first_byte(MANAS + ["generate", "-p", PROMPT, "-n", "8", "--seed", "1"])["ttft_s"] for _ in range(runs)
    )
    help_s = statistics.median(whole(MANAS + ["--help"]) for _ in range(runs))
    return {
        "import_torch_s": import_torch,
        "ttft_s": ttft,
        "ttft_minus_import_torch_s": ttft - import_torch,
        "help_s": help_s,
    }


def first_byte(command: list[str]) -> dict[str, float]:
    """A whole process: seconds to its first byte on stdout and to its exit, and its peak resident memory as
    GNU time reports it (the child's own: a forked child's counter would start at this harness's size)."""
    with tempfile.NamedTemporaryFile() as peak:
        started = time.perf_counter()
        process = subprocess.Popen(
            ["/usr/bin/time", "-o", peak.name, "-f", "%M", *realtime(command)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        process.stdout.read(1)
        ttft = time.perf_counter() - started
        process.stdout.read()
        process.wait()
        elapsed = time.perf_counter() - started
        if process.returncode:
            raise RuntimeError(f"{command} exited {process.returncode}")
        return {"seconds": elapsed, "ttft_s": ttft, "peak_rss_mb": int(Path(peak.name).read_text().split()[-1]) / 1024}


def take_turns(commands: dict[str, list[str]], runs: int, measure=first_byte) -> dict[str, dict[str, float]]:
    """Each command once per round (harness.interleaved: a warm-up round first, for the page cache and the core's
    library); the medians."""
    return interleaved({name: (None, functools.partial(measure, command)) for name, command in commands.items()}, runs)


def shipped_gguf(folder: Path) -> Path:
    if not (LLAMA_CPP_DIR / "llama-completion").is_file():
        raise Unavailable(
            f"llama.cpp is not built in {LLAMA_CPP_DIR.parent.parent}: run `bash ../shared/tools/build-llamacpp.sh`"
        )
    gguf = folder / "shipped-f32.gguf"
    subprocess.run(
        [
            *MANAS,
            "export",
            str(ROOT / "checkpoints" / "shakespeare.safetensors"),
            "--format",
            "gguf",
            "--outtype",
            "f32",
            "--out",
            str(gguf),
            "--force",
        ],
        check=True,
        capture_output=True,
    )
    return gguf


def compile_bytecode() -> None:
    """The package's bytecode, as an installed package has it: where PYTHONDONTWRITEBYTECODE is set (CI
    sandboxes), every start would otherwise compile manas's modules from source."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "manas_cli")], check=True)


def goal_startup(runs: int) -> dict:
    if not shutil.which("/usr/bin/time"):
        raise Unavailable("GNU time (/usr/bin/time) measures the peak memory: install it (apt install time)")
    compile_bytecode()
    with tempfile.TemporaryDirectory() as folder:
        gguf = shipped_gguf(Path(folder))
        generate = [*MANAS, "generate", "-p", PROMPT, "-n", "100", "-t", "0"]
        result = take_turns(
            {
                "manas_native": generate,
                "manas_torch": [*generate, "--engine", "torch"],
                "llama_completion": [
                    str(LLAMA_CPP_DIR / "llama-completion"),
                    "-m",
                    str(gguf),
                    "-p",
                    PROMPT,
                    "-n",
                    "100",
                    "--temp",
                    "0",
                    "-no-cnv",
                    "--no-warmup",
                ],
            },
            max(runs, 5),
        )
    native, llama = result["manas_native"], result["llama_completion"]
    result["native_over_llama_cpp"] = native["seconds"] / llama["seconds"]
    result["goals"] = {
        "1_whole_process_le_0.25_s": native["seconds"] <= 0.25,
        "1_le_2.5x_llama_completion": result["native_over_llama_cpp"] <= 2.5,
        "2_ttft_le_0.15_s": native["ttft_s"] <= 0.15,
        "3_peak_rss_le_80_mb": native["peak_rss_mb"] <= 80,
    }
    return result


def loop_seconds(engine: list[str]) -> dict[str, float]:
    script = f'for i in 1 2 3 4 5 6 7 8 9 10; do "$@" generate -p "ROMEO:" -n 30 {" ".join(engine)} >/dev/null; done'
    return {
        "seconds": timed(
            lambda: subprocess.run(
                realtime(["bash", "-c", script, "loop", *MANAS]), check=True, stderr=subprocess.DEVNULL
            )
        )
    }


def goal_loop(runs: int) -> dict:
    compile_bytecode()
    result = take_turns({"native": [], "torch": ["--engine", "torch"]}, max(runs, 5), measure=loop_seconds)
    speedup = result["torch"]["seconds"] / result["native"]["seconds"]
    return {**result, "speedup": speedup, "goal_4_ge_8x": speedup >= 8}


def imports_torch(command: list[str], stdin: Path | None) -> bool:
    with open(stdin or os.devnull, "rb") as source:
        done = subprocess.run(
            command, stdin=source, capture_output=True, check=True, env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
        )
    return any(line.split("|")[-1].strip() == "torch" for line in done.stderr.decode().splitlines())


def goal_score_and_bench(runs: int) -> dict:
    compile_bytecode()
    shared = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
    text = (
        shared.read_text(encoding="utf-8") if shared.is_file() else (DATA / "tinyshakespeare-held-out.txt").read_text()
    )
    with tempfile.TemporaryDirectory() as folder:
        tail = Path(folder) / "last-tenth.txt"
        tail.write_text(text[-len(text) // 10 :], encoding="utf-8")
        commands = {
            "score_native": [*MANAS, "score", str(tail)],
            "score_torch": [*MANAS, "score", str(tail), "--engine", "torch"],
            "bench_native": [*MANAS, "bench", "-n", "32", "-r", "1", "--no-baseline"],
            "bench_torch": [*MANAS, "bench", "-n", "32", "-r", "1", "--no-baseline", "--engine", "torch"],
        }
        result = take_turns(commands, max(runs, 5))
        for name, command in commands.items():
            result[name]["imports_torch"] = imports_torch(command, None)
        result["text_characters"] = len(text) // 10
    return result


GOALS = {
    "3": lambda args: goal_import_torch(args.runs),
    "startup": lambda args: goal_startup(args.runs),
    "startup-loop": lambda args: goal_loop(args.runs),
    "startup-score": lambda args: goal_score_and_bench(args.runs),
}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
