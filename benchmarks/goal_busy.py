"""A busy machine (issue 19): the default thread choice against `--threads 1` and `--threads 2`, each a whole
`manas bench` process, on a quiet machine and beside one process spinning on a core."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import MANAS, gpt2_checkpoint, run_goals
from manas_cli.models import resolve_checkpoint


def bench_decode_rate(checkpoint: Path, tokens: int, threads: list[str]) -> tuple[float, int]:
    """A whole `manas bench` process's decode tokens/s and thread count: the default thread rule runs at start."""
    env = {name: value for name, value in os.environ.items() if name not in ("OMP_NUM_THREADS", "MANAS_THREADS")}
    done = subprocess.run(
        [
            *MANAS,
            "bench",
            "-c",
            str(checkpoint),
            "--tokens",
            str(tokens),
            "--prompt-tokens",
            "64",
            "--no-baseline",
            "--repeat",
            "2",
            "--json",
            *threads,
        ],
        capture_output=True,
        env=env,
        timeout=900,
        check=True,
    )
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


GOALS = {
    "busy": lambda args: goal_busy_machine(args.runs),
}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
