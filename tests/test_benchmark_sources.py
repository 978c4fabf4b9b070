"""The C benchmarks in benchmarks/ still compile, warnings as errors: core_products.c compiles core.c into itself
and calls its static functions, so a change to the core can break it without any other test noticing. They are
only compiled here, never timed: a benchmark measures speed, and speed is not a test's to check."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SOURCES = sorted(BENCHMARKS.glob("*.c"))


def test_there_are_c_benchmarks() -> None:
    assert {path.name for path in SOURCES} >= {"core_products.c", "read_bandwidth.c", "run_gaps.c"}


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
@pytest.mark.parametrize("source", SOURCES, ids=lambda path: path.name)
def test_benchmark_compiles(source: Path) -> None:
    flags = ["-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-O3", "-march=native", "-ffp-contract=off", "-pthread"]
    result = subprocess.run(["gcc", *flags, str(source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
