"""A busy machine never stalls manas, bench says when its figures are noise, and the small mends of the command line:
through the real CLI, on the tiny checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cli_fixtures import MANAS, RUN_OPTIONS, checkpoints, cli_env, manas, rope  # noqa: F401 (fixtures)
from manas_cli.cli.render import is_noisy, noise_warning
from manas_cli.engine.threads import ThreadChoice, choose_threads, free_cores


def bench_json(checkpoint, *args: str, **env: str | None) -> dict:
    run = manas(
        "bench",
        "-c",
        checkpoint.path,
        "--device",
        "cpu",
        "--tokens",
        "8",
        "--prompt-tokens",
        "4",
        "--repeat",
        "2",
        "--no-baseline",
        "--json",
        *args,
        fresh=True,
        **env,
    ).ok()
    return json.loads(run.out)


# ---- the thread rule ---------------------------------------------------------------------------------------------


def test_threads_flag_and_environment_mean_exactly_that_and_bench_says_which_rule(rope):
    flag, environment = bench_json(rope, "--threads", "1")["model"], bench_json(rope, MANAS_THREADS="2")["model"]
    assert (flag["threads"], flag["threads_rule"]) == (1, "--threads")
    assert (environment["threads"], environment["threads_rule"]) == (2, "$MANAS_THREADS")
    chosen = bench_json(rope, MANAS_THREADS=None)["model"]
    assert chosen["threads_rule"].endswith("cores free at start") and 1 <= chosen["threads"] <= os.cpu_count()


@pytest.mark.parametrize("value", ["0", "many", "100000"])
def test_a_bad_manas_threads_is_one_error_naming_the_variable(rope, value):
    run = manas("generate", "-c", rope.path, "-p", "a", "-n", "2", MANAS_THREADS=value, fresh=True)
    assert run.returncode == 1 and run.err.startswith("error: $MANAS_THREADS=") and "Traceback" not in run.err


def test_a_spinning_process_takes_its_core_from_the_default_choice():
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        pytest.skip("needs two cores")
    quiet = free_cores(cpus)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # running
        busy = free_cores(cpus)
    finally:
        spinner.kill()
        spinner.wait()
    assert busy < quiet or busy == 1
    assert choose_threads(3) == ThreadChoice(3, "--threads", adaptive=False)


# ---- honest numbers ----------------------------------------------------------------------------------------------


def test_a_figure_whose_runs_spread_over_10_percent_is_marked_and_explained():
    steady = {"name": "tg256", "tokens_per_s_mean": 100.0, "tokens_per_s_std": 5.0}
    noisy = {"name": "pp128", "tokens_per_s_mean": 1816.6, "tokens_per_s_std": 1408.9}
    assert not is_noisy(steady) and is_noisy(noisy)
    assert noise_warning({"tests": [steady]}) is None
    warning = noise_warning({"tests": [noisy, steady]})
    assert warning.startswith("warning: runs varied by more than 10% (pp128 ±78%)")
    assert "--threads 1" in warning and "--repeat" in warning


def test_bench_json_marks_each_figure_noisy_or_not(rope):
    tests = bench_json(rope, "--threads", "1")["tests"]
    assert all(test["noisy"] == is_noisy(test) for test in tests)


def test_the_sweeps_buckets_are_labelled_by_what_they_hold(rope):
    rows = bench_json(rope, "--threads", "1", "--sweep")["sweep"]
    for row in rows:
        assert row["end"] - row["start"] == row["tokens"]  # positions start .. end - 1, one token each
    assert rows[-1]["end"] == rows[0]["start"] + sum(row["tokens"] for row in rows)


# ---- small mends ---------------------------------------------------------------------------------------------------


def test_debug_works_after_the_command_name_too(rope):
    run = manas("generate", "--debug", "-c", rope.path.parent / "missing.safetensors", "-p", "a", fresh=True)
    assert run.returncode == 1 and "Traceback" in run.err and run.err.rstrip().splitlines()[-1].startswith("error: ")
    assert manas("generate", "-c", rope.path, *RUN_OPTIONS, "-p", "--debug", "-n", "2").ok()


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--stop", ""], "an empty stop text"),
        (["-q", "--stats"], "--quiet prints nothing but the text"),
    ],
)
def test_contradictory_or_empty_flags_are_usage_errors(rope, args, fragment):
    run = manas("generate", "-c", rope.path, *RUN_OPTIONS, "-p", "a", *args)
    assert run.returncode == 2 and fragment in run.err


def test_an_error_about_the_checkpoint_from_the_environment_names_the_variable(tmp_path):
    run = manas("generate", "-p", "a", MANAS_CHECKPOINT=str(tmp_path / "nope.safetensors"))
    assert run.returncode == 1 and "$MANAS_CHECKPOINT" in run.err


def test_the_top_level_help_shows_each_commands_first_sentence_whole():
    run = manas("--help").ok()
    commands = run.out.split("Commands:")[1]
    assert "..." not in commands
    assert "streaming it to stdout as it is" in run.out and "produced" in run.out


def test_stats_after_a_ctrl_c_past_the_window_show_the_cache_as_it_was(rope):
    process = subprocess.Popen(
        [*MANAS, "generate", "-c", rope.path, *RUN_OPTIONS, "-p", "ROMEO:", "-n", "1000000", "--stats"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    streamed = 0
    while streamed < 2000:  # a few hundred tokens: far past the 32-position window, where every step re-prefills
        chunk = process.stdout.read1(65536)
        assert chunk, process.stderr.read().decode()  # it must still be generating
        streamed += len(chunk)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130
    assert "cache 32 positions" in stderr.decode()
