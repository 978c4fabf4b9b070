"""The third hardening round (issue 23): nothing a pipeline sends loses a record, wrong results become errors, input
is read with a bound, and the messages say what happened. Each case runs the real CLI on files the test makes."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import resource
import select
import signal
import struct
import subprocess
import termios
import threading
from pathlib import Path

import pytest
import torch

from cli_fixtures import MANAS, RUN_OPTIONS, checkpoints, cli, cli_env, learned, manas, rope  # noqa: F401 (fixtures)
from manas_cli.errors import TokenizerError
from manas_cli.formats.tokenizer import bytes_to_unicode, spec_from_hf_files
from test_hardening_load import assert_one_error, read_parts, write_variant

ROOT = Path(__file__).resolve().parents[1]
GOOD = json.dumps({"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0})


def jsonl_run(checkpoint: Path, data: bytes, *args: str | Path) -> subprocess.CompletedProcess:
    return cli("generate", "-c", checkpoint, *RUN_OPTIONS, "--jsonl", *args, stdin=data)


def records(done: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(line) for line in done.stdout.decode().splitlines()]


# ---- 1: a stop string that matches in --jsonl ---------------------------------------------------------------------


@pytest.mark.parametrize("stop_flag", [False, True])
def test_jsonl_requests_ended_by_a_stop_string_get_their_records(rope, stop_flag):
    """The issue's pipeline: the second request stops at its first 'e'; with --stop, every request does."""
    lines = [{"prompt": "ROMEO:", "max_tokens": 100, "seed": 1}, {"prompt": "ROMEO:", "max_tokens": 100, "seed": 7}]
    if not stop_flag:
        lines[1]["stop"] = ["e"]
    done = jsonl_run(
        rope.path, "".join(json.dumps(line) + "\n" for line in lines).encode(), *(["--stop", "e"] if stop_flag else [])
    )
    assert done.returncode == 0, done.stderr.decode()
    first, second = records(done)
    assert (first["id"], second["id"]) == (1, 2)
    assert second["finish_reason"] == "stop" and "e" not in second["text"]
    assert (first["finish_reason"] == "stop") == stop_flag


# ---- 2: lines that are not UTF-8, and where lines end ---------------------------------------------------------------


@pytest.mark.parametrize("route", ["stdin", "prompt-file"])
def test_a_line_that_is_not_utf8_gets_an_error_record_and_the_others_go_on(rope, tmp_path, route):
    data = "\n".join([GOOD, GOOD]).encode() + b'\n{"prompt": "caf\xe9"}\n' + "\n".join([GOOD] * 3).encode() + b"\n"
    if route == "stdin":
        done = jsonl_run(rope.path, data)
    else:
        (tmp_path / "in.jsonl").write_bytes(data)
        done = jsonl_run(rope.path, b"", "--prompt-file", tmp_path / "in.jsonl")
    assert done.returncode == 1
    out = records(done)
    assert [record["id"] for record in out] == [1, 2, 3, 4, 5, 6]
    assert out[2]["line"] == 3 and "not UTF-8" in out[2]["error"]
    assert all(record["tokens"] == rope.reference("ROMEO:", 4)[0] for index, record in enumerate(out) if index != 2)


@pytest.mark.parametrize("route", ["stdin", "prompt-file"])
def test_lines_end_at_newline_only_so_line_numbers_are_seds(rope, tmp_path, route):
    """A bare carriage return inside a line is JSON whitespace, not a line end: line 3's error says line 3."""
    data = (GOOD.replace(",", ",\r", 1) + "\n" + GOOD + "\n{broken\n" + GOOD + "\n").encode()
    if route == "stdin":
        done = jsonl_run(rope.path, data)
    else:
        (tmp_path / "in.jsonl").write_bytes(data)
        done = jsonl_run(rope.path, b"", "--prompt-file", tmp_path / "in.jsonl")
    out = records(done)
    assert len(out) == 4 and out[2] == {"id": 3, "line": 3, "error": out[2]["error"]}
    assert out[2]["error"].startswith("not JSON")
    sed = subprocess.run(["sed", "-n", "3p"], input=data, capture_output=True).stdout
    assert sed == b"{broken\n"


def test_an_endless_line_gets_an_error_record_without_filling_memory(rope):
    """A line over --jsonl's 8 MiB cap is refused as it streams in; the next line is served."""
    data = b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}\n' + GOOD.encode() + b"\n"
    done = jsonl_run(rope.path, data)
    over, good = records(done)
    assert over["line"] == 1 and "over 8 MiB" in over["error"]
    assert good["tokens"] == rope.reference("ROMEO:", 4)[0]


# ---- 3: a client that waits for its answer --------------------------------------------------------------------------


def read_line_within(stream, seconds: float) -> bytes:
    """One line from a pipe, or b"" if none came within the time (a hang shows as an empty result, not a stuck test)."""
    received = b""
    while not received.endswith(b"\n"):
        ready, _, _ = select.select([stream], [], [], seconds)
        if not ready:
            return b""
        chunk = os.read(stream.fileno(), 65536)
        if not chunk:
            return received
        received += chunk
    return received


def test_jsonl_answers_each_request_while_stdin_stays_open(rope):
    """A coprocess: write one request, wait for its record, write the next; the batch never waits to fill."""
    process = subprocess.Popen(
        [*MANAS, "generate", "-c", rope.path, *RUN_OPTIONS, "--jsonl"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
    )
    try:
        answers = []
        for number in (1, 2):
            process.stdin.write((GOOD + "\n").encode())
            process.stdin.flush()
            answers.append(read_line_within(process.stdout, 120))
        process.stdin.close()
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
    assert [json.loads(answer)["id"] for answer in answers] == [1, 2]


# ---- 4: terminals of no size, and too small a terminal ------------------------------------------------------------


def on_pty(
    args: list, columns: int, rows: int, stdout_file: Path | None = None, resize_to: tuple | None = None, **env: str
) -> tuple[int, bytes]:
    """Run manas with stderr (and stdout, unless stdout_file) on a pseudo-terminal of columns × rows, resized once
    mid-run if asked; (exit code, what the terminal received)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    out = stdout_file.open("wb") if stdout_file else slave
    process = subprocess.Popen(
        [*MANAS, *map(str, args)], stdin=subprocess.DEVNULL, stdout=out, stderr=slave, env=cli_env(**env)
    )
    os.close(slave)
    received = bytearray()

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            received.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    if resize_to is not None:
        while b"\x1b[?2026l" not in received:  # the region is up
            assert process.poll() is None, bytes(received).decode(errors="replace")
            threading.Event().wait(0.05)
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", resize_to[1], resize_to[0], 0, 0))
        process.send_signal(signal.SIGWINCH)
    code = process.wait(timeout=300)
    reader.join(timeout=60)
    os.close(master)
    return code, bytes(received)


LIVE_RUN = ["-p", "ROMEO:", "-t", "0", "-n", "25"]  # within the window: no notice


@pytest.mark.parametrize("environment", [{}, {"COLUMNS": "100", "LINES": "30"}])
def test_a_terminal_of_0x0_gets_the_text_and_a_live_display(rope, tmp_path, environment):
    piped = manas("generate", "-c", rope.path, *RUN_OPTIONS, *LIVE_RUN).ok().out
    code, terminal = on_pty(
        ["generate", "-c", rope.path, *RUN_OPTIONS, *LIVE_RUN], 0, 0, tmp_path / "out.txt", **environment
    )
    assert code == 0, terminal.decode(errors="replace")
    assert (tmp_path / "out.txt").read_text() == piped
    assert b"\x1b[?2026l" in terminal  # the region was drawn, at the fallback size
    assert b"Traceback" not in terminal and b"error:" not in terminal


@pytest.mark.parametrize("size", [(20, 5), (10, 3)])
def test_a_tiny_terminal_shows_no_live_region_and_leaves_no_fragments(rope, size):
    piped = manas("generate", "-c", rope.path, *RUN_OPTIONS, *LIVE_RUN).ok().out
    code, terminal = on_pty(["generate", "-c", rope.path, *RUN_OPTIONS, *LIVE_RUN], *size)
    assert code == 0, terminal.decode(errors="replace")
    assert b"\x1b[?2026h" not in terminal  # no frame drawn, so none to leave behind in the scrollback
    text = terminal.decode().replace("\r\n", "\n")
    text = re.sub(r"\x1b\[\?25[lh]", "", text)  # the cursor hidden and shown again
    assert text.startswith(piped)
    assert re.fullmatch(r"prompt \d+ tokens · generated 25 · .*", " ".join(text[len(piped) :].split()))  # wrapped


def test_a_shrink_below_the_smallest_size_ends_the_display_and_the_text_goes_on(rope, tmp_path):
    args = ["generate", "-c", rope.path, *RUN_OPTIONS, "-p", "ROMEO:", "-t", "0", "-n", "4000", "--overflow", "shift"]
    code, terminal = on_pty(args, 160, 50, tmp_path / "out.txt", resize_to=(20, 5))
    assert code == 0, terminal.decode(errors="replace")
    cleared = terminal.rindex(b"\x1b[2J")  # the region's old rows, wherever the resize put them, are cleared
    assert b"\x1b[?2026h" not in terminal[cleared:]  # and no frame is drawn after
    assert re.search(r"prompt \d+ tokens · generated 4000 ", " ".join(terminal[cleared:].decode().split()))
    reference = manas("generate", "-c", rope.path, *RUN_OPTIONS, *args[3:]).ok().out
    assert (tmp_path / "out.txt").read_text() == reference


# ---- 5: logits that overflow after the prompt --------------------------------------------------------------------


@pytest.fixture(scope="module")
def loud_at_10(learned, tmp_path_factory) -> Path:
    """A learned-position model whose position 10 row is 3e38: finite in the file, infinite in the sum."""
    state, _ = read_parts(learned.path)
    rows = state["position_embedding.weight"].clone()
    rows[10] = 3e38
    path = tmp_path_factory.mktemp("loud") / "loud.safetensors"
    return write_variant(path, learned.path, tensors={"position_embedding.weight": rows})


def test_logits_that_overflow_after_the_prompt_are_an_error_naming_the_position(loud_at_10):
    done = cli("generate", "-c", loud_at_10, *RUN_OPTIONS, "-p", "ROMEO:", "-n", "20", "-t", "0")
    err = done.stderr.decode()
    assert done.returncode == 1 and "NaN or infinite logits at position 10" in err, err
    assert b"\x00" not in done.stdout and "Traceback" not in err


def test_score_refuses_logits_that_overflow_naming_the_position(loud_at_10, tmp_path):
    (tmp_path / "t.txt").write_text("ROMEO: what light through yonder window breaks? It is the east.")
    done = cli("score", tmp_path / "t.txt", "-c", loud_at_10, *RUN_OPTIONS, "--json")
    # the whole window runs at once, and attention carries the overflow back to earlier positions too
    assert_one_error(done, "NaN or infinite logits at position")


# ---- 6: numbers JSON cannot hold ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_jsonl_refuses_numbers_that_are_not_json(rope, value):
    done = jsonl_run(rope.path, (f'{{"prompt": "a", "id": {value}}}\n' + GOOD + "\n").encode())

    def refuse(name: str):
        raise AssertionError(f"{name} in a record")

    # every line is strict JSON (Python's json.loads would take NaN)
    bad, good = [json.loads(line, parse_constant=refuse) for line in done.stdout.decode().splitlines()]
    assert bad["line"] == 1 and "not JSON" in bad["error"] and bad["id"] == 1
    assert good["id"] == 2


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_temperature_must_be_a_finite_number(rope, value):
    done = manas("generate", "-c", rope.path, *RUN_OPTIONS, "-p", "a", "-t", value)
    expected = "temperature must be a finite number >= 0" if value == "-1" else f"'{value}' is not a finite number"
    assert done.returncode == 2 and expected in done.err and "'--temperature'" in done.err


# ---- 7, 9, 17: tokenizer files that tokenize otherwise, or cost memory out of proportion -----------------------------


def hf_files(merges: list[str], extra: dict[str, int] | None = None) -> tuple[str, str]:
    """A byte-level vocab.json (the 256 byte aliases, then each merge's token in order) and its merges.txt."""
    vocab = {alias: index for index, alias in enumerate(bytes_to_unicode().values())}
    for merge in merges:
        vocab["".join(merge.split(" "))] = len(vocab)
    vocab |= extra or {}
    return json.dumps(vocab), "#version: 0.2\n" + "\n".join(merges) + "\n"


def test_merges_that_tiktoken_would_apply_otherwise_are_refused_naming_the_line():
    """`b c`, `a b`, `ab c`: Hugging Face tokenizes "abc" as a + bc; tiktoken's ranks would join a + bc."""
    with pytest.raises(
        TokenizerError,
        match=r"line 4 of merges.txt builds 'abc' from 'ab' \+ 'c', but by rank "
        r"tiktoken builds it from 'a' \+ 'bc'",
    ):
        spec_from_hf_files(*hf_files(["b c", "a b", "ab c"]), "tiny")
    spec_from_hf_files(*hf_files(["a b", "b c", "ab c"]), "tiny")  # here both build ab first: accepted


def test_a_merge_of_a_part_no_merge_builds_is_refused():
    with pytest.raises(TokenizerError, match="line 2 of merges.txt merges 'xy', which no earlier merge builds"):
        spec_from_hf_files(*hf_files(["xy z"], {"<xy>": 257, "xy": 258}), "tiny")


def test_a_vocab_whose_unbuilt_tokens_are_not_special_is_refused():
    with pytest.raises(TokenizerError, match=r"token 'hello' \(id 257\) is longer than a byte, but no merge builds it"):
        spec_from_hf_files(*hf_files(["a b"], {"hello": 257}), "tiny")
    spec = spec_from_hf_files(*hf_files(["a b"], {"<|endoftext|>": 257}), "tiny")
    assert spec["special_tokens"] == {"<|endoftext|>": 257}


def test_added_tokens_a_folder_lists_are_special_tokens(tmp_path):
    """A GPT-2 folder's added tokens need not look like <markers>: added_tokens.json and tokenizer_config.json say
    which they are."""
    vocab, merges = hf_files(["a b"], {"[PAD]": 257, "[SEP]": 258})
    for name, text in (
        ("vocab.json", vocab),
        ("merges.txt", merges),
        ("added_tokens.json", '{"[PAD]": 257}'),
        ("tokenizer_config.json", '{"added_tokens_decoder": {"258": {"content": "[SEP]"}}}'),
    ):
        (tmp_path / name).write_text(text)
    manas("tokenizer", tmp_path, "--out", tmp_path / "t.tiktoken").ok()
    assert "[PAD]" in manas("tokenizer", tmp_path, "--out", tmp_path / "t.tiktoken", "--force").ok().err
    (tmp_path / "added_tokens.json").unlink()
    done = cli("tokenizer", tmp_path, "--out", tmp_path / "u.tiktoken")
    assert_one_error(done, "token '[PAD]' (id 257) is longer than a byte, but no merge builds it")


def test_the_tokenizer_command_refuses_a_vocab_of_unbuilt_tokens_instead_of_dropping_them(tmp_path):
    vocab, merges = hf_files(["a b"], {f"word{index}": 257 + index for index in range(1000)})
    (tmp_path / "vocab.json").write_text(vocab)
    (tmp_path / "merges.txt").write_text(merges)
    done = cli("tokenizer", tmp_path, "--out", tmp_path / "t.tiktoken")
    assert_one_error(done, "no merge builds it and it is not a special token")
    assert not (tmp_path / "t.tiktoken").exists()


def test_a_checkpoint_with_100000_special_tokens_is_refused(rope, tmp_path):
    _, metadata = read_parts(rope.path)
    spec = json.loads(metadata["tokenizer"])
    first = max(spec["special_tokens"].values()) + 1
    spec["special_tokens"] |= {f"<|s{index}|>": first + index for index in range(100_000)}
    path = write_variant(
        tmp_path / "many.safetensors", rope.path, tokenizer=spec, config={"vocab_size": first + 100_000}
    )
    done = cli("generate", "-c", path, *RUN_OPTIONS, "-p", "a", "-n", "1")
    assert_one_error(done, "100,001 special tokens; at most 4,096 are allowed")


@pytest.fixture(scope="module")
def tokenizer_json_folder(learned, tmp_path_factory) -> Path:
    """The learned model exported to Hugging Face, its vocab.json and merges.txt replaced by the tokenizer.json
    that transformers 5 saves alone."""
    folder = tmp_path_factory.mktemp("tj") / "gpt2"
    manas("export", learned.path, "--out", folder).ok()
    vocab = json.loads((folder / "vocab.json").read_text())
    merges = [line for line in (folder / "merges.txt").read_text().splitlines() if not line.startswith("#version")]
    tokenizer = {
        "version": "1.0",
        "added_tokens": [{"id": vocab["<|endoftext|>"], "content": "<|endoftext|>", "special": True}],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "vocab": vocab, "merges": [line.split(" ") for line in merges]},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "vocab.json").unlink()
    (folder / "merges.txt").unlink()
    return folder


def test_convert_reads_a_folder_with_only_tokenizer_json(learned, tokenizer_json_folder, tmp_path):
    back = tmp_path / "back.safetensors"
    converted = manas("convert", tokenizer_json_folder, "--out", back).ok()
    assert "tokenizer.json" in converted.err
    args = ("--threads", "1", "-p", "ROMEO: café", "-n", "12", "-t", "0", "--json")
    assert (
        manas("generate", "-c", back, *args).ok().json()["tokens"]
        == manas("generate", "-c", learned.path, *args).ok().json()["tokens"]
    )


def test_a_tokenizer_json_of_another_kind_is_refused_naming_it(tokenizer_json_folder, tmp_path):
    folder = tmp_path / "other"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((tokenizer_json_folder / name).read_bytes())
    tokenizer = json.loads((tokenizer_json_folder / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁"}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    done = cli("convert", folder, "--out", tmp_path / "o.safetensors")
    assert_one_error(done, "pre-tokenizer is 'Metaspace'")


# ---- 8: endless input -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["score"],
        ["score", "/dev/zero"],
        ["generate", "-n", "1"],
        ["generate", "--prompt-file", "/dev/zero", "-n", "1"],
    ],
)
def test_endless_input_is_refused_at_the_cap(rope, command):
    """/dev/zero never ends: read whole, it would take all memory (and the test would time out)."""
    with open("/dev/zero", "rb") as zero:
        done = subprocess.run(
            [*MANAS, *command, "-c", rope.path, *RUN_OPTIONS],
            stdin=zero,
            capture_output=True,
            env=cli_env(),
            timeout=120,
        )
    line = assert_one_error(done, "is over 64 MiB, the most manas reads as one text")
    assert ("manas score" in line) == (command[0] == "score")


def test_train_refuses_endless_text_at_the_cap(tmp_path):
    done = cli("train", "/dev/zero", "--out", tmp_path / "m.safetensors")
    assert_one_error(done, "training text /dev/zero is over 64 MiB")


def test_out_of_memory_advice_names_the_commands_own_flags(tmp_path):
    """train with batches its address space cannot hold: the advice names train's flags, not generate's."""
    text = tmp_path / "t.txt"
    text.write_text((ROOT / "tests" / "data" / "tinyshakespeare-head.txt").read_text()[:30_000])

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    done = subprocess.run(
        [
            *MANAS,
            "train",
            text,
            "--out",
            tmp_path / "m.safetensors",
            "--threads",
            "1",
            "--batch-size",
            "20000",
            "--steps",
            "1",
            "--n-layer",
            "1",
            "--n-embd",
            "32",
            "--n-head",
            "2",
            "--n-kv-head",
            "1",
            "--block-size",
            "64",
            "--vocab-size",
            "300",
        ],
        capture_output=True,
        env=cli_env(),
        timeout=300,
        preexec_fn=limited,
    )
    err = done.stderr.decode().strip().splitlines()
    assert done.returncode == 1 and err[-1].startswith("error: out of memory: lower --batch-size, --block-size"), err
    assert "--num-samples" not in err[-1] and not (tmp_path / "m.safetensors").exists()


# ---- 10, 11, 12, 13: messages and small mends ------------------------------------------------------------------------


def test_a_pytorch_checkpoint_given_to_generate_says_convert_it(tmp_path):
    torch.save({"model": {"w": torch.zeros(2)}, "model_args": {}}, tmp_path / "ckpt.pt")
    done = cli("generate", "-c", tmp_path / "ckpt.pt", "-p", "a")
    assert_one_error(done, "this is a PyTorch checkpoint", f"manas convert {tmp_path / 'ckpt.pt'} --out")


def test_garbage_given_to_convert_is_said_to_be_no_pytorch_checkpoint(tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint at all\n" * 100)
    done = cli(
        "convert",
        tmp_path / "ckpt.pt",
        "--out",
        tmp_path / "o.safetensors",
        "--tokenizer-file",
        ROOT / "tests" / "data" / "gpt2.tiktoken",
    )
    line = assert_one_error(done, "neither the zip archive torch.save writes nor a pickle")
    assert "weights_only" not in line and "PyTorch 2.6" not in line


def test_score_with_stride_equal_to_the_window_scores_k_windows_and_one_token(rope, tmp_path):
    """k·window + 1 tokens: the last window holds one token, which has nothing before it to be scored from."""
    text = (ROOT / "tests" / "data" / "tinyshakespeare-head.txt").read_text()
    counts = {n: len(rope.encoding.encode_ordinary(text[:n])) for n in range(50, 3000)}
    length, windows = next((n, (count - 1) // 32) for n, count in counts.items() if count % 32 == 1 and count > 32)
    (tmp_path / "t.txt").write_text(text[:length])
    report = manas("score", tmp_path / "t.txt", "-c", rope.path, *RUN_OPTIONS, "--stride", "32", "--json").ok().json()
    assert report["tokens"] == windows * 31  # each window's first token is not scored


def test_an_output_name_over_255_bytes_is_refused_before_any_work(rope, tmp_path):
    long = tmp_path / ("m" * 300 + ".gguf")
    for command in (["export", rope.path, "--format", "gguf", "--out", long], ["quantize", rope.path, "--out", long]):
        done = cli(*command)
        assert_one_error(done, "the file name is 305 bytes long, and a name may have at most 255")


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB file system, where one is allowed (root in a container that may mount); skipped elsewhere."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", folder], capture_output=True).returncode:
        pytest.skip("cannot mount a small file system here")
    yield folder
    subprocess.run(["umount", folder], check=True)


def test_a_full_disk_says_the_disk_is_full_and_leaves_nothing(small_disk):
    shipped = ROOT / "checkpoints" / "shakespeare.safetensors"  # 18 MB: more than the disk holds
    done = cli("export", shipped, "--format", "gguf", "--out", small_disk / "m.gguf")
    if b"gguf" in done.stderr and b"pip install" in done.stderr:
        pytest.skip("the gguf extra is not installed")
    assert_one_error(done, "the disk is full", "free some space")
    assert list(small_disk.iterdir()) == []


def test_a_file_size_limit_says_so_and_leaves_nothing(rope, tmp_path):
    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))  # the int8 file is 45 KB

    done = subprocess.run(
        [*MANAS, "quantize", rope.path, "--out", tmp_path / "q.safetensors"],
        capture_output=True,
        env=cli_env(),
        timeout=120,
        preexec_fn=limited,
    )
    assert_one_error(done, "larger than this process may write", "ulimit -f")
    assert list(tmp_path.iterdir()) == []


def test_resuming_training_from_an_int4_file_calls_it_int4(rope, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text((ROOT / "tests" / "data" / "tinyshakespeare-head.txt").read_text()[:20_000])
    out = tmp_path / "int4.safetensors"
    manas("quantize", rope.path, "--bits", "4", "--out", out).ok()
    done = cli("train", text, "--out", out, "--resume", "--steps", "1")
    assert_one_error(done, "is an int4 checkpoint: training needs float weights")


def test_a_huge_repeat_last_n_is_the_whole_window_without_a_warning(rope):
    args = (
        "generate",
        "-c",
        rope.path,
        *RUN_OPTIONS,
        "-p",
        "ROMEO:",
        "-n",
        "20",
        "-t",
        "0",
        "--repetition-penalty",
        "1.3",
        "--json",
    )
    huge = manas(*args, "--repeat-last-n", str(10**30)).ok()
    assert huge.err == ""
    assert huge.json()["tokens"] == manas(*args, "--repeat-last-n", "-1").ok().json()["tokens"]


# ---- 14: a fresh clone passes its own tests --------------------------------------------------------------------------


def test_the_tests_read_nothing_outside_the_repository():
    """Every data path the tests name is under tests/data: the data folder beside a checkout is not in a clone.
    (The spellings are built from parts so that this file does not name that folder itself.)"""
    outside = "/".join(["..", "sha" + "red"])
    spellings = ("parents[" + "2]", '"sha' + 'red" / "data"', outside)
    for source in (ROOT / "tests").glob("*.py"):
        text = source.read_text()
        assert not any(spelling in text for spelling in spellings), source.name
    assert {path.name for path in (ROOT / "tests" / "data").iterdir()} >= {
        "SOURCES.md",
        "gpt2.tiktoken",
        "tinyshakespeare-head.txt",
        "tinyshakespeare-held-out.txt",
    }


# ---- 15, 16, 19: bench's default, the window notice in scripts, the jsonl cache field --------------------------------


def test_the_default_bench_fits_the_window(rope):
    report = manas("bench", "-c", rope.path, *RUN_OPTIONS, "--repeat", "1", "--json").ok().json()
    assert [test["name"] for test in report["tests"]] == ["pp16", "tg16", "tg16 no-cache"]  # block_size 32
    assert report["re_prefills"] == 0


def test_a_prompt_longer_than_the_window_is_said_to_be_cropped(rope):
    done = manas(
        "bench",
        "-c",
        rope.path,
        *RUN_OPTIONS,
        "--repeat",
        "1",
        "--prompt-tokens",
        "300",
        "--tokens",
        "1",
        "--no-baseline",
        "--json",
    ).ok()
    assert done.err.splitlines() == [
        "notice: --prompt-tokens 300 is more than the model's block_size: prefilling 32, the whole window"
    ]
    assert done.json()["tests"][0]["name"] == "pp32"


def test_past_the_window_a_script_is_told_once_why_it_slows(rope):
    args = ("generate", "-c", rope.path, *RUN_OPTIONS, "-p", "ROMEO:", "-n", "200", "-t", "0")
    err = manas(*args).ok().err.splitlines()
    assert len(err) == 1 and err[0].startswith("notice: the context window is full") and "--overflow shift" in err[0]
    assert manas(*args, "--quiet").ok().err == ""
    assert manas(*args, "--overflow", "shift").ok().err == ""


def test_jsonl_records_report_their_cache(rope):
    done = jsonl_run(rope.path, b'{"prompt": "ROMEO:", "max_tokens": 5}\n')
    (record,) = records(done)
    alone = manas("generate", "-c", rope.path, *RUN_OPTIONS, "-p", "ROMEO:", "-n", "5", "--json").ok().json()
    assert record["cache"]["positions"] == alone["cache"]["positions"]
    assert set(record["cache"]) == set(alone["cache"])


def readme_pipeline_commands() -> list[str]:
    """The shell lines of the README's Pipelines section, in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Pipelines", 1)[1].split("\n## ", 1)[0]
    return [line for block in re.findall(r"```bash\n(.*?)```", section, re.S) for line in block.splitlines() if line]


def test_every_readme_pipeline_example_runs_as_written(tmp_path):
    if subprocess.run(["sh", "-c", "command -v jq"], capture_output=True).returncode:
        pytest.skip("the README's examples use jq, which is not installed")
    commands = readme_pipeline_commands()
    assert len(commands) >= 6
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = cli_env(PATH=f"{Path(MANAS[0]).parent}{os.pathsep}{os.environ['PATH']}", MANAS_THREADS="1")
    for command in commands:
        done = subprocess.run(
            ["bash", "-o", "pipefail", "-c", command], cwd=tmp_path, capture_output=True, env=env, timeout=300
        )
        assert done.returncode == 0, f"{command}\n{done.stderr.decode()}"
        assert b"error:" not in done.stderr and b"null" not in done.stdout, command
