"""Goal 3: time to first token of a whole `manas generate` process against `python -c "import torch"`, and
`manas --help`."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from harness import MANAS, run_goals, timed

def goal_startup(runs: int) -> dict:
    manas = MANAS

    def first_byte(command: list[str]) -> float:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        process.stdout.read(1)
        elapsed = time.perf_counter() - started
        process.stdout.read()
        process.wait()
        return elapsed

    def whole(command: list[str]) -> float:
        return timed(lambda: subprocess.run(command, capture_output=True, check=True))

    import_torch = statistics.median(whole([sys.executable, "-c", "import torch"]) for _ in range(runs))
    ttft = statistics.median(first_byte(manas + ["generate", "-p", "ROMEO:", "-n", "8", "--seed", "1"]) for _ in range(runs))
    help_s = statistics.median(whole(manas + ["--help"]) for _ in range(runs))
    return {"import_torch_s": import_torch, "ttft_s": ttft, "ttft_minus_import_torch_s": ttft - import_torch, "help_s": help_s}


GOALS = {
    "3": lambda args: goal_startup(args.runs),
}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
