"""The shell contract through the real CLI: each failure is one `error:` line on stderr with exit 1 (run time) or 2
(usage) and no traceback unless --debug; --help answers without importing torch; no escape codes reach a pipe."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import typer
from safetensors.torch import save_file

from cli_fixtures import LONG_PROMPT, RUN_OPTIONS, checkpoints, cli_env, generate, manas, rope  # noqa: F401 (fixtures)
from manas_cli.cli.app import app


def assert_one_error_line(run, code: int, *names: str) -> str:
    """Exit `code`, nothing on stdout, and a single stderr line `error: ...` naming each of `names`."""
    assert run.returncode == code, run.err
    assert run.stdout == b""
    assert "Traceback" not in run.err
    (line,) = run.err.splitlines()
    assert line.startswith("error: ")
    for name in names:
        assert name in line
    return line


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, rope) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("bad-files")
    files = {
        "missing": folder / "missing.safetensors",
        "corrupt": folder / "corrupt.safetensors",
        "truncated": folder / "truncated.safetensors",
        "foreign": folder / "foreign.safetensors",
        "missing_prompt": folder / "missing-prompt.txt",
        "latin1_prompt": folder / "latin1-prompt.txt",
        "good": rope.path,
    }
    files["corrupt"].write_bytes(b"\x00\x13garbage, not a safetensors header" * 10)
    full = rope.path.read_bytes()
    files["truncated"].write_bytes(full[: len(full) // 2])
    save_file({"weight": torch.zeros(2, 2)}, files["foreign"])  # a valid safetensors file without manas metadata
    files["latin1_prompt"].write_bytes("ROMEO: café".encode("latin-1"))
    return {name: str(path) for name, path in files.items()}


# (arguments, standard input, environment, what the error line must name); {name} is a file from bad_files
RUN_TIME_ERRORS = {
    "missing checkpoint": (("generate", "-c", "{missing}", "-p", "x"), b"", {}, ["{missing}"]),
    "corrupt checkpoint": (("generate", "-c", "{corrupt}", "-p", "x"), b"", {}, ["{corrupt}"]),
    "truncated checkpoint": (("inspect-cache", "-c", "{truncated}"), b"", {}, ["{truncated}"]),
    "not a manas checkpoint": (
        ("bench", "-c", "{foreign}", "--tokens", "2", "--repeat", "1"),
        b"",
        {},
        ["{foreign}", "not a manas checkpoint"],
    ),
    "missing $MANAS_CHECKPOINT": (("generate", "-p", "x"), b"", {"MANAS_CHECKPOINT": "{missing}"}, ["{missing}"]),
    "missing prompt file": (
        ("generate", "-c", "{good}", "--prompt-file", "{missing_prompt}"),
        b"",
        {},
        ["{missing_prompt}"],
    ),
    "non-UTF-8 prompt file": (
        ("inspect-cache", "-c", "{good}", "--prompt-file", "{latin1_prompt}"),
        b"",
        {},
        ["{latin1_prompt}", "UTF-8"],
    ),
    "invalid UTF-8 on stdin": (
        ("generate", "-c", "{good}"),
        "ROMEO: café".encode("latin-1"),
        {},
        ["standard input", "UTF-8"],
    ),
}


@pytest.mark.parametrize("case", RUN_TIME_ERRORS)
def test_run_time_failures_exit_1_with_one_error_line_naming_the_culprit(bad_files, case):
    args, stdin, env, names = RUN_TIME_ERRORS[case]

    def fill(text: str) -> str:
        return text.format(**bad_files)

    run = manas(*map(fill, args), *RUN_OPTIONS, stdin=stdin, **{k: fill(v) for k, v in env.items()})
    assert_one_error_line(run, 1, *map(fill, names))


USAGE_ERRORS = {
    "unknown option": (("generate", "--bogus"), "--bogus"),
    "unknown bench option": (("bench", "--bogus"), "--bogus"),
    "unknown inspect-cache option": (("inspect-cache", "--bogus"), "--bogus"),
    "unknown command": (("bogus",), "bogus"),
    "missing option value": (("generate", "-p"), "-p"),
    "negative temperature": (("generate", "-t", "-0.5"), "--temperature"),
    "top-p above 1": (("generate", "--top-p", "1.5"), "--top-p"),
    "top-p of 0": (("generate", "--top-p", "0"), "--top-p"),
    "top-k of 0": (("generate", "--top-k", "0"), "--top-k"),
    "no tokens": (("generate", "-n", "0"), "--max-tokens"),
    "no samples": (("generate", "--num-samples", "0"), "--num-samples"),
    "unknown overflow policy": (("generate", "--overflow", "sideways"), "--overflow"),
    "unknown device": (("generate", "--device", "tpu"), "--device"),
    "unknown dtype": (("inspect-cache", "--dtype", "int8"), "--dtype"),
    "no threads": (("generate", "--threads", "0"), "--threads"),
    "bench of no tokens": (("bench", "--tokens", "0"), "--tokens"),
    "negative inspect-cache tokens": (("inspect-cache", "--tokens", "-1"), "--tokens"),
    "both --prompt and --prompt-file": (
        ("generate", "-c", "{good}", "-p", "x", "--prompt-file", "{missing_prompt}"),
        "--prompt-file",
    ),
}


@pytest.mark.parametrize("case", USAGE_ERRORS)
def test_usage_errors_exit_2_with_one_error_line_naming_the_flag(bad_files, case):
    args, flag = USAGE_ERRORS[case]
    run = manas(*(arg.format(**bad_files) for arg in args))
    assert_one_error_line(run, 2, flag)


def test_debug_shows_the_traceback_before_the_error_line(bad_files):
    run = manas("--debug", "generate", *RUN_OPTIONS, "-c", bad_files["missing"], "-p", "x")
    assert run.returncode == 1
    assert run.err.startswith("Traceback (most recent call last):")
    assert run.err.splitlines()[-1].startswith("error: ") and bad_files["missing"] in run.err.splitlines()[-1]


# ---- help without torch --------------------------------------------------------------------------------------------

# Runs the real entry point with --help in a fresh interpreter, then fails if anything imported torch.
HELP_WITHOUT_TORCH = """
import sys
sys.argv = ["manas", *sys.argv[1:], "--help"]
from manas_cli.cli.process import main
try:
    main()
except SystemExit as exit:
    assert exit.code in (0, None), f"--help exited {exit.code}"
assert "torch" not in sys.modules, "--help imported torch"
"""
COMMANDS = sorted(typer.main.get_command(app).commands)


@pytest.mark.parametrize("command", ["", *COMMANDS], ids=["manas", *COMMANDS])
def test_help_answers_with_examples_without_importing_torch(command):
    done = subprocess.run(
        [sys.executable, "-c", HELP_WITHOUT_TORCH, *filter(None, [command])],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env=cli_env(),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr.decode()
    help_text = done.stdout.decode()
    assert help_text.startswith(f"Usage: manas {command}".rstrip() + " ")
    assert "Examples:" in help_text
    assert b"\x1b" not in done.stdout + done.stderr


def test_every_issue_command_is_registered():
    assert {"generate", "bench", "inspect-cache"} <= set(COMMANDS)


# ---- no escape codes on a pipe -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "what", ["generate --stats", "bench", "bench --sweep", "inspect-cache", "usage error", "run-time error"]
)
def test_no_escape_codes_reach_a_pipe(rope, bad_files, what):
    """TERM says the terminal colours (cli_env), yet stdout and stderr are pipes: plain text only."""
    bench = ("bench", "-c", rope.path, *RUN_OPTIONS, "--tokens", "16", "--prompt-tokens", "16", "--repeat", "1")
    inspect = ("inspect-cache", "-c", rope.path, *RUN_OPTIONS, "-p", "ROMEO:", "--tokens", "40")
    runs = {  # what -> (the run, whether it writes to stdout, to stderr)
        "generate --stats": (lambda: generate(rope, "-p", LONG_PROMPT, "-n", "8", "-t", "0", "--stats"), True, True),
        "bench": (lambda: manas(*bench), True, False),
        "bench --sweep": (lambda: manas(*bench, "--no-baseline", "--sweep"), True, False),
        "inspect-cache": (lambda: manas(*inspect), True, False),
        "usage error": (lambda: manas("generate", "--top-p", "2"), False, True),
        "run-time error": (lambda: manas("generate", "-c", bad_files["corrupt"], "-p", "x", *RUN_OPTIONS), False, True),
    }
    make_run, writes_stdout, writes_stderr = runs[what]
    run = make_run()
    assert (bool(run.stdout), bool(run.stderr)) == (writes_stdout, writes_stderr)
    assert b"\x1b" not in run.stdout
    assert b"\x1b" not in run.stderr


def test_llama_cpps_flags_mean_what_they_mean_there_or_point_to_manas_own(checkpoints):
    path = str(checkpoints["learned-mha"].path)
    plain = manas("generate", "-c", path, "-p", "ROMEO:", "-n", "6", "-t", "0").ok()
    offload = manas("generate", "-c", path, "-p", "ROMEO:", "-n", "6", "-t", "0", "-ngl", "99").ok()
    assert offload.out == plain.out and "-ngl" in offload.err and "--device" in offload.err
    assert manas("-c", path, "-p", "ROMEO:", "-n", "6", "-t", "0").ok().out == plain.out  # llama-cli's way
    hot = manas("generate", "-c", path, "-p", "ROMEO:", "-n", "2", "-t", "4").ok()
    assert "--threads 4" in hot.err and "--threads" not in plain.err
    for flag, manas_way in (
        ("-cnv", "manas chat"),
        ("-i", "manas chat"),
        ("--n-predict", "--max-tokens"),
        ("-r", "--stop"),
    ):
        run = manas("generate", "-c", path, "-p", "-i", flag, "x")
        assert run.returncode == 2 and manas_way in run.err and len(run.err.splitlines()) == 1, (flag, run.err)
    assert manas("generate", "-c", path, "-p", "-i", "-n", "2").returncode == 0  # a prompt "-i" is a prompt
