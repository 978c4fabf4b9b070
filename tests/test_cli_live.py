"""What a terminal shows while `manas generate` runs, and what must never change for pipes: the live status line
and sample regions on a pseudo-terminal (rendered with pyte, a terminal emulator), stdout byte for byte, the
notice when the window fills, JSON lines that survive any line splitter, and `manas --version`."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pyte
import pytest
import torch

from cli_fixtures import (  # noqa: F401 (checkpoints and rope are fixtures)
    BLOCK_SIZE,
    MANAS,
    RUN_OPTIONS,
    checkpoints,
    cli_env,
    generate,
    manas,
    rope,
)
from conftest import needs_compiler
from manas_cli.formats.checkpoint import save_checkpoint
from manas_cli.formats.tokenizer import bpe_spec
from manas_cli.torch_engine.model import GPT, GPTConfig

COLUMNS, ROWS = 160, 50  # wide enough for the stats line on one row
END_FRAME = "\x1b[?2026l"  # the live display draws each frame as one synchronized update, ended by this
STATUS_ROW = re.compile(
    r"(\d+)/(\d+) tokens( × \d+)? · (- |[\d,.]+ )tok/s(?: per sample)? · re-prefills \d+ · "
    r"cache ▕.*▏ (\d+)/(\d+) · [\d,.]+ (B|KiB|MiB) logical, [\d,.]+ (B|KiB|MiB) allocated"
)
STATS_LINE = re.compile(r"prompt \d+ tokens · generated \d+( × \d+ samples)? · ttft .* · re-prefills (\d+) · cache .*")
NOTICE = "notice: the context window is full: each further token re-prefills all 32 positions"
NOTICE_WHOLE = NOTICE + ", exactly as crop-and-recompute; --overflow shift is faster but no longer identical to it"
PROMPT = "ROMEO:"
SINGLE = (*RUN_OPTIONS, "-p", PROMPT, "-t", "0")
N = "50"  # past the window (re-prefills), with too few tokens left then for the notice
SAMPLES = (*RUN_OPTIONS, "-p", PROMPT, "--seed", "5", "--num-samples", "3", "-n", "40")


@dataclass(frozen=True)
class TerminalRun:
    returncode: int
    stdout: bytes  # what the stdout terminal, pipe or file received (b"" when stdout shares stderr's terminal)
    stderr: bytes  # what stderr's terminal received (and stdout's, when they share it)


def open_terminal(columns: int = COLUMNS) -> tuple[int, int]:
    """A pseudo-terminal of columns × ROWS: (master, slave)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, columns, 0, 0))
    return master, slave


def read_all(master: int, into: bytearray) -> None:
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every slave is closed and all was read
            return
        if not chunk:
            return
        into += chunk


_terminal_runs: dict[tuple, TerminalRun] = {}


def on_terminal(*args: str | Path, stdout: str | Path = "terminal", columns: int = COLUMNS, **env: str) -> TerminalRun:
    """Run `manas generate -c <args>` with stderr on a pseudo-terminal of `columns` and stdout on another one
    ("terminal"), on the same one ("same"), on a pipe ("pipe") or in a file (a Path). Identical runs are reused
    between tests."""
    key = (args, stdout, columns, tuple(sorted(env.items())))
    if key in _terminal_runs:
        return _terminal_runs[key]
    err_master, err_slave = open_terminal(columns)
    masters, slaves, received = [err_master], [err_slave], [bytearray()]
    if stdout == "terminal":
        out_master, out_slave = open_terminal()
        masters.insert(0, out_master)
        slaves.append(out_slave)
        received.insert(0, bytearray())
    file = stdout.open("wb") if isinstance(stdout, Path) else None
    out_target = file or {"terminal": slaves[-1], "same": err_slave, "pipe": subprocess.PIPE}[stdout]
    process = subprocess.Popen(
        [*MANAS, "generate", "-c", *args],
        stdin=subprocess.DEVNULL,
        stdout=out_target,
        stderr=err_slave,
        env=cli_env(**env),
    )
    if file:
        file.close()
    for slave in slaves:
        os.close(slave)
    readers = [threading.Thread(target=read_all, args=pair) for pair in zip(masters, received)]
    for reader in readers:
        reader.start()
    piped = process.stdout.read() if stdout == "pipe" else b""
    process.wait(timeout=300)
    for reader in readers:
        reader.join(timeout=60)
    for master in masters:
        os.close(master)
    if file is not None:
        out = stdout.read_bytes()
    else:
        out = {"pipe": piped, "terminal": bytes(received[0]), "same": b""}[stdout]
    run = _terminal_runs[key] = TerminalRun(process.returncode, out, bytes(received[-1]))
    assert run.returncode == 0, run.stderr.decode(errors="replace")
    return run


def screen(data: bytes, columns: int = COLUMNS) -> list[str]:
    """The rows a terminal shows after receiving data, trailing blanks dropped."""
    emulator = pyte.Screen(columns, ROWS)
    pyte.ByteStream(emulator).feed(data)
    rows = [row.rstrip() for row in emulator.display]
    while rows and not rows[-1]:
        rows.pop()
    return rows


def frames(data: bytes, columns: int = COLUMNS) -> list[list[str]]:
    """The screen after each frame the live display drew (the last update it sends erases it)."""
    ends = [match.end() for match in re.finditer(re.escape(END_FRAME.encode()), data)]
    return [screen(data[:end], columns) for end in ends[:-1]]


def status_rows(rows: list[str]) -> list[re.Match]:
    return [match for row in rows if (match := STATUS_ROW.fullmatch(row))]


def decoded_rows(text: str) -> list[str]:
    """The rows a terminal shows for plain text whose lines are narrower than it."""
    assert all(len(line) < COLUMNS for line in text.split("\n"))
    return [line.rstrip() for line in text.split("\n")]


# ---- the live status line ---------------------------------------------------------------------------------------


def test_the_live_line_shows_the_run_on_stderr_and_gives_way_to_the_stats_line(rope):
    run = on_terminal(rope.path, *SINGLE, "-n", N)
    drawn = frames(run.stderr)
    assert drawn, "no live frame was drawn"
    progress = [status_rows(rows) for rows in drawn]
    assert all(len(matches) == 1 for matches in progress)  # one status line in every frame, nothing else
    tokens = [int(matches[0].group(1)) for matches in progress]
    assert tokens == sorted(tokens) and tokens[-1] == int(N)  # counts up to the end
    assert {matches[0].group(2) for matches in progress} == {N}
    assert {matches[0].group(6) for matches in progress} == {str(BLOCK_SIZE)}
    final = screen(run.stderr)
    assert len(final) == 1 and STATS_LINE.fullmatch(final[0])  # the live line is gone; today's stats line stays


def test_stdout_on_a_terminal_is_byte_for_byte_the_same_with_and_without_the_live_line(rope):
    live = on_terminal(rope.path, *SINGLE, "-n", N)
    plain = on_terminal(rope.path, *SINGLE, "-n", N, "--no-stats")
    piped = generate(rope, "-p", PROMPT, "-t", "0", "-n", N).ok()
    assert plain.stderr == b""
    assert live.stdout == plain.stdout == piped.stdout.replace(b"\n", b"\r\n")  # the terminal's own \n -> \r\n
    assert b"\x1b" not in live.stdout


def test_on_one_terminal_the_text_scrolls_above_the_live_line_and_ends_as_without_it(rope):
    """stdout and stderr on the same terminal: every frame shows the text so far above one status line, and the
    final screen is the plain decode and the stats line."""
    piped = generate(rope, "-p", PROMPT, "-t", "0", "-n", N).ok()
    expected = decoded_rows(piped.out.removesuffix("\n"))
    run = on_terminal(rope.path, *SINGLE, "-n", N, stdout="same")
    drawn = frames(run.stderr)
    assert drawn
    for rows in drawn:
        *text, status = rows
        assert STATUS_ROW.fullmatch(status)
        assert "\n".join(expected).startswith("\n".join(text))
    *text, stats = screen(run.stderr)
    assert text == expected and STATS_LINE.fullmatch(stats)
    without = screen(on_terminal(rope.path, *SINGLE, "-n", N, "--no-stats", stdout="same").stderr)
    assert without == "\n".join(expected).rstrip("\n").split("\n")  # (screen() drops the trailing blank rows)


def test_stdout_in_a_file_is_unchanged_and_free_of_escape_codes_under_the_live_line(rope, tmp_path):
    piped = generate(rope, "-p", PROMPT, "-t", "0", "-n", N).ok()
    run = on_terminal(rope.path, *SINGLE, "-n", N, stdout=tmp_path / "out.txt")
    assert run.stdout == piped.stdout
    assert b"\x1b" not in run.stdout
    assert frames(run.stderr) and all(len(status_rows(rows)) == 1 for rows in frames(run.stderr))
    assert STATS_LINE.fullmatch(*screen(run.stderr))


def test_no_live_line_when_stdout_is_a_pipe_whose_reader_may_write_to_the_terminal(rope):
    """`manas generate | head` or `| tee`: the live region would erase or garble what the reader writes to the same
    terminal, so stderr gets only today's stats line, and stdout today's bytes."""
    piped = generate(rope, "-p", PROMPT, "-t", "0", "-n", N).ok()
    run = on_terminal(rope.path, *SINGLE, "-n", N, stdout="pipe")
    assert run.stdout == piped.stdout
    assert STATS_LINE.fullmatch(run.stderr.decode().removesuffix("\r\n"))


@pytest.mark.parametrize(
    "flags, env, expected",
    [
        ((), {"TERM": "dumb"}, ["notice", "stats"]),
        (("--no-stats",), {}, ["notice"]),
        (("--quiet",), {}, []),
    ],
    ids=["TERM=dumb", "--no-stats", "--quiet"],
)
def test_no_live_line_on_a_dumb_terminal_without_stats_or_when_quiet(rope, flags, env, expected):
    run = on_terminal(rope.path, *SINGLE, "-n", "80", *flags, **env)
    assert b"\x1b" not in run.stderr  # no frame, no colour, no cursor movement
    rows = [row.rstrip() for row in run.stderr.decode().replace("\r\n", "\n").splitlines()]
    assert all(len(row) < COLUMNS for row in rows)  # wrapped at words by manas, not cut by the terminal
    messages: list[str] = []
    for row in rows:  # a message starts with its kind; its wrapped rows continue it
        if row.startswith(("notice:", "prompt ")):
            messages.append(row)
        else:
            messages[-1] += " " + row
    kinds = ["stats" if STATS_LINE.fullmatch(message) else message.split(":")[0] for message in messages]
    assert kinds == expected
    assert all(message == NOTICE_WHOLE for message in messages if message.startswith("notice"))
    assert run.stdout == on_terminal(rope.path, *SINGLE, "-n", "80").stdout


# ---- the notice when recompute mode starts re-prefilling ---------------------------------------------------------


@pytest.mark.parametrize(
    "flags, noticed",
    [
        (("-n", "80"), True),
        (("-n", N), False),  # re-prefills, but fewer than 32 tokens are left when they start
        (("-n", "80", "--overflow", "shift"), False),
    ],
    ids=["recompute-80", "recompute-50", "shift-80"],
)
def test_a_notice_says_why_recompute_mode_slows_once_the_window_is_full(rope, flags, noticed):
    run = on_terminal(rope.path, *SINGLE, *flags)
    final = screen(run.stderr)
    assert (final[0].startswith(NOTICE)) == noticed
    assert int(STATS_LINE.fullmatch(final[-1]).group(2)) > 0  # every case re-prefills
    assert len(final) == (3 if noticed else 1)  # the notice, wrapped once, above the stats line
    if noticed:  # shown in the live region from the moment the window filled, then kept above the stats line
        shown = [" ".join(rows) for rows in frames(run.stderr)]
        assert any(
            NOTICE in rows and "--overflow shift is faster but no longer identical to it" in rows for rows in shown
        )


def test_on_the_text_s_own_terminal_without_the_live_line_the_notice_waits_for_the_end_of_the_text(rope):
    piped = generate(rope, "-p", PROMPT, "-t", "0", "-n", "80").ok()
    *text, notice_head, notice_tail = screen(
        on_terminal(rope.path, *SINGLE, "-n", "80", "--no-stats", stdout="same").stderr
    )
    assert text == decoded_rows(piped.out.removesuffix("\n"))
    notice = notice_head + " " + notice_tail  # wrapped at a word
    assert notice.startswith(NOTICE) and notice.endswith("no longer identical to it")


def test_inspect_cache_explains_the_re_prefills_it_reports(rope):
    run = manas("inspect-cache", "-c", rope.path, *RUN_OPTIONS, "-p", PROMPT, "--tokens", "40").ok()
    assert "re-prefills at sequence positions" in run.out
    assert f"each further token re-prefills all {BLOCK_SIZE} positions, exactly as crop-and-recompute" in run.out


# ---- several samples -----------------------------------------------------------------------------------------------


def test_several_samples_grow_together_in_their_own_regions_then_print_as_today(rope):
    texts = [record["text"] for record in generate(rope, *SAMPLES[len(RUN_OPTIONS) :], "--json").ok().json_lines()]
    run = on_terminal(rope.path, *SAMPLES)
    drawn = frames(run.stderr)
    assert drawn
    for rows in drawn:
        headers = [index for index, row in enumerate(rows) if row.startswith("── sample ")]
        assert [rows[index].split(" · ")[0] for index in headers] == [f"── sample {n}" for n in (1, 2, 3)]
        assert STATUS_ROW.fullmatch(rows[-1]) and STATUS_ROW.fullmatch(rows[-1]).group(3) == " × 3"
        for sample, (start, end) in enumerate(zip(headers, [*headers[1:], len(rows) - 1])):
            shown = "\n".join(rows[start + 1 : end])
            assert shown in "\n".join(decoded_rows(texts[sample]))
    # The final frame ends each sample's region with the sample's last rows, as many as the screen gives it (a
    # text that starts with a newline has one row more than its lines show, and may not fit whole).
    *regions, _ = drawn[-1]
    headers = [index for index, row in enumerate(regions) if row.startswith("── sample ")]
    for text, start, end in zip(texts, headers, [*headers[1:], len(regions)]):
        shown = regions[start + 1 : end]
        assert shown and shown == decoded_rows(text)[-len(shown) :]
    plain = on_terminal(rope.path, *SAMPLES, "--no-stats")
    assert run.stdout == plain.stdout  # stdout as today: each sample at the end, apart by a rule
    assert STATS_LINE.fullmatch(" ".join(screen(run.stderr)))  # the stats line alone, wrapped at words


# ---- JSON lines ---------------------------------------------------------------------------------------------------

# Characters that JSON allows raw inside a string but that str.splitlines() (and other splitters) take as line ends.
LINE_SEPARATORS = ("\u0085", "\u2028", "\u2029")


@pytest.fixture(scope="module")
def separators_checkpoint(tmp_path_factory):
    """A model that writes nothing but NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR: its BPE has a token for each,
    and its final LayerNorm (weight 0, bias v) makes every position's hidden state v, whose logits through the tied
    embedding are 20 for those three tokens and 0 for all others."""
    pieces = [character.encode("utf-8") for character in LINE_SEPARATORS]
    ranks = {bytes([i]): i for i in range(256)}
    for token in (b"\xe2\x80", *pieces):
        ranks[token] = len(ranks)
    config = GPTConfig(vocab_size=len(ranks) + 1, block_size=16, n_layer=1, n_head=2, n_embd=8)
    model = GPT(config).eval()
    hidden = torch.ones(config.n_embd)
    with torch.no_grad():
        model.final_norm.weight.zero_()
        model.final_norm.bias.copy_(hidden)
        model.token_embedding.weight.zero_()
        for piece in pieces:
            model.token_embedding.weight[ranks[piece]] = hidden * 20 / hidden.square().sum()
    path = tmp_path_factory.mktemp("separators") / "separators.safetensors"
    save_checkpoint(path, model, bpe_spec(ranks))
    return path


def test_generated_line_separators_stay_inside_one_json_line(separators_checkpoint):
    run = manas(
        "generate",
        "-c",
        separators_checkpoint,
        *RUN_OPTIONS,
        "-p",
        "x",
        "-n",
        "30",
        "-t",
        "1",
        "--seed",
        "0",
        "--num-samples",
        "2",
        "--json",
    ).ok()
    lines = run.out.splitlines()
    assert len(lines) == 2
    records = [json.loads(line) for line in lines]
    for record in records:
        assert len(record["text"]) == 30
        assert set(record["text"]) == set(LINE_SEPARATORS)  # the test really produced all three
    text = manas(
        "generate",
        "-c",
        separators_checkpoint,
        *RUN_OPTIONS,
        "-p",
        "x",
        "-n",
        "30",
        "-t",
        "1",
        "--seed",
        "0",
        "--num-samples",
        "2",
    ).ok()
    assert text.out == "\n\n".join(record["text"] for record in records) + "\n"  # text mode writes them raw


def test_inspect_cache_json_stays_one_line_when_the_path_holds_a_line_separator(separators_checkpoint, tmp_path):
    odd = tmp_path / "model\u2028one\u0085two.safetensors"
    odd.write_bytes(separators_checkpoint.read_bytes())
    run = manas("inspect-cache", "-c", odd, *RUN_OPTIONS, "-p", "x", "--json").ok()
    (line,) = run.out.splitlines()
    assert json.loads(line)["checkpoint"] == str(odd)


# ---- --version ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_package_metadata_without_importing_torch(flag):
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "manas_cli", flag], capture_output=True, env=cli_env(), timeout=60
    )
    assert done.returncode == 0
    assert done.stdout.decode() == f"manas {version('manas-cli')}\n"
    imported = [line.split("|")[-1].strip() for line in done.stderr.decode().splitlines()]
    assert "manas_cli.cli.app" in imported  # -X importtime really listed the imports
    assert not [name for name in imported if name.split(".")[0] == "torch"]


# ---- a live line that fits, and tells the recent rate ---------------------------------------------------------------


@pytest.mark.parametrize("columns", [40, 80, 200])
@pytest.mark.parametrize("samples", [1, 3])
def test_the_status_row_never_wraps_whatever_the_width(rope, columns, samples):
    run = on_terminal(rope.path, *SINGLE, "-n", "60", "--num-samples", str(samples), "--seed", "3", columns=columns)
    drawn = frames(run.stderr, columns)
    assert drawn
    for rows in drawn:
        assert re.match(r"\d+/60 tokens", rows[-1]), rows  # the status row starts the bottom row: it did not wrap
        assert len(rows[-1]) < columns
        assert not any(row.startswith(("· ", "tok/s", "cache", "re-prefills")) for row in rows)  # no wrapped tail
    if columns == 200:  # room for every field
        assert all(STATUS_ROW.fullmatch(rows[-1]) for rows in drawn)


def test_several_samples_say_per_sample_live_and_total_at_the_end(rope):
    run = on_terminal(rope.path, *SAMPLES)
    assert all("tok/s per sample" in rows[-1] for rows in frames(run.stderr))
    final = " ".join(screen(run.stderr))
    assert "× 3 samples" in final and "decode" in final and "tok/s total" in final


def test_the_live_rate_is_the_last_seconds_not_the_running_average():
    from manas_cli.cli.live import RecentRate

    rate, steps, now = RecentRate(), 0, 0.0
    for _ in range(500):  # 5 s at 100 tokens/s, then the window fills: 10 tokens/s
        steps, now = steps + 1, now + 0.01
        rate.update(steps, now)
    for _ in range(12):  # 1.2 s later
        steps, now = steps + 1, now + 0.1
        shown = rate.update(steps, now)
    assert shown == pytest.approx(10, rel=0.15)  # the running average would still say (500 + 12) / 6.2 = 83
    assert RecentRate().update(0, 1.0) is None  # no decode step yet: no rate


def test_a_one_token_prompt_is_one_token_not_one_tokens(rope):
    final = screen(on_terminal(rope.path, *RUN_OPTIONS, "-p", "", "-n", "3", "--no-stats").stderr)
    run = on_terminal(rope.path, *RUN_OPTIONS, "-p", "", "-t", "0", "-n", "3")
    assert " ".join(screen(run.stderr)).startswith("prompt 1 token · generated 3")
    assert final == []


def test_a_resize_mid_run_redraws_the_region_whole_and_leaves_no_stale_row(rope, tmp_path):
    """The terminal narrows from 160 to 60 columns while the region is up: manas gets SIGWINCH, clears the screen,
    and every frame after fits the new width; at the end no status row is left anywhere."""
    master, slave = open_terminal()
    process = subprocess.Popen(
        [*MANAS, "generate", "-c", rope.path, *SINGLE, "-n", "8000", "--overflow", "shift"],
        stdin=subprocess.DEVNULL,
        stdout=(tmp_path / "out.txt").open("wb"),
        stderr=slave,
        env=cli_env(),
    )
    os.close(slave)
    received = bytearray()
    reader = threading.Thread(target=read_all, args=(master, received))
    reader.start()
    while END_FRAME.encode() not in received:  # the region is up
        assert process.poll() is None, bytes(received).decode(errors="replace")
        threading.Event().wait(0.05)
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, 60, 0, 0))
    process.send_signal(signal.SIGWINCH)
    assert process.wait(timeout=300) == 0
    reader.join(timeout=60)
    os.close(master)
    data = bytes(received)
    cleared = data.index(b"\x1b[2J")
    emulator = pyte.Screen(COLUMNS, ROWS)
    stream = pyte.ByteStream(emulator)
    stream.feed(data[:cleared])
    emulator.resize(ROWS, 60)
    start = cleared
    for end in [m.end() for m in re.finditer(re.escape(END_FRAME.encode()), data) if m.end() > cleared][:-1]:
        stream.feed(data[start:end])
        start = end
        rows = [row.rstrip() for row in emulator.display if row.strip()]
        assert re.match(r"\d+/8000 tokens", rows[-1]) and len(rows[-1]) < 60
        assert sum(bool(re.match(r"\d+/8000 tokens", row)) for row in rows) == 1  # no stale status row
    stream.feed(data[start:])
    final = [row.rstrip() for row in emulator.display if row.strip()]
    assert not any(re.match(r"\d+/8000 tokens", row) for row in final) and STATS_LINE.fullmatch(" ".join(final))


@needs_compiler
def test_a_first_run_on_a_terminal_says_it_is_compiling_the_core_before_it_does(rope, tmp_path):
    cache = tmp_path / "cache"
    run = on_terminal(rope.path, *SINGLE, "-n", "4", "--engine", "native", XDG_CACHE_HOME=str(cache))
    # a transient spinner names the step while it runs; the line after it stays
    assert run.stderr.index(b"compiling the native core") < run.stderr.index(b"compiled the native core in")
    rows = screen(run.stderr)
    assert [row for row in rows if row.startswith("compiled the native core in")] and "compiling" not in str(rows)
    again = on_terminal(rope.path, *SINGLE, "-n", "5", "--engine", "native", XDG_CACHE_HOME=str(cache))
    assert "compiling" not in "\n".join(screen(again.stderr))
