"""The second hardening round: v1 files with tiktoken's own patterns load, nothing a user owns is replaced by
surprise, what a file claims cannot cost unbounded time or memory, and every failure is one `error:` line. Each
case runs the real CLI on files the test makes; memory cases under an address-space limit."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from cli_fixtures import MANAS, RUN_OPTIONS, checkpoints, cli, cli_env, learned, manas, rope  # noqa: F401 (fixtures)
from manas_cli.formats.tokenizer import GPT2_PAT_STR, bpe_spec, build_encoding, pattern_is_safe
from test_hardening_load import (
    assert_one_error,
    generate_from,
    read_parts,
    run,
    write_variant,
)
from test_hardening_writes import TINY_SHAPE, write_nanogpt

BYTE_RANKS = {bytes([i]): i for i in range(256)}

# The split patterns tiktoken ships (tiktoken_ext/openai_public.py): gpt2, r50k_base and p50k_base share the first.
TIKTOKEN_PATTERNS = {
    "r50k_base": r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""",
    "cl100k_base": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",  # noqa: E501
    "o200k_base": "|".join(
        [
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\p{N}{1,3}""",
            r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
            r"""\s*[\r\n]+""",
            r"""\s+(?!\S)""",
            r"""\s+""",
        ]
    ),
    "gpt2-as-manas-spells-it": GPT2_PAT_STR,
    "atomic-group": r"""(?>\p{L}+)|\s+|.""",
}


def one_error_line(result: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    err = result.stderr.decode()
    assert result.returncode == code, err
    (line,) = err.strip().splitlines()
    assert line.startswith("error: ") and "Traceback" not in err
    for fragment in fragments:
        assert fragment in line, line
    return line


# ---- the regression: v1 files with tiktoken's spelling of a pattern --------------------------------------------


@pytest.mark.parametrize("name", list(TIKTOKEN_PATTERNS))
def test_every_pattern_tiktoken_ships_is_accepted(name):
    pattern = TIKTOKEN_PATTERNS[name]
    assert pattern_is_safe(pattern)
    encoding = build_encoding(bpe_spec(BYTE_RANKS, pat_str=pattern))
    assert encoding.decode(encoding.encode_ordinary("Hello, world! 123  \n")) == "Hello, world! 123  \n"


@pytest.mark.parametrize(
    "pattern",
    [
        TIKTOKEN_PATTERNS["r50k_base"],
        TIKTOKEN_PATTERNS["r50k_base"].rsplit("|", 2)[0],  # a prefix of it
    ],
)
def test_a_v1_checkpoint_with_tiktokens_spelling_of_gpt2s_pattern_loads_and_generates(tmp_path, rope, pattern):
    _, metadata = read_parts(rope.path)
    spec = json.loads(metadata["tokenizer"]) | {"pat_str": pattern}
    path = write_variant(tmp_path / "v1.safetensors", rope.path, tokenizer=spec)
    assert read_parts(path)[1]["format_version"] == "1"
    result = generate_from(path, "-p", "ROMEO: is it so", "-n", "8", "-t", "0", "--json")
    assert result.returncode == 0, result.stderr.decode()
    assert json.loads(result.stdout)["tokens"] == rope.reference("ROMEO: is it so", 8)[0]


@pytest.mark.parametrize("pattern", [r"(a+)\1b|.", r"(?P<x>a)(?P=x)|.", r"(?<x>a)\k<x>|.", r"(a)?(?(1)b|c)|."])
def test_backreferences_and_conditionals_are_refused(tmp_path, rope, pattern):
    spec = bpe_spec(BYTE_RANKS, pat_str=pattern)
    path = write_variant(tmp_path / "bad.safetensors", rope.path, tokenizer=spec)
    assert_one_error(generate_from(path, "-p", "a", "-n", "2"), str(path), "backreference or a conditional")


# ---- data loss 1: --force replaces regular files only ---------------------------------------------------------


def special_file(path: Path, kind: str) -> Path:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        server.close()
    else:  # a character device like /dev/null, made where the test may make one
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    return path


def commands_writing(out: Path, rope_path: Path, text: Path, folder: Path) -> dict[str, list]:
    nanogpt = write_nanogpt(folder)
    return {
        "quantize": ["quantize", rope_path, "--out", out],
        "convert": ["convert", *nanogpt, "--out", out],
        "train": ["train", text, "--out", out, "--steps", "1", *TINY_SHAPE],
        "train-tokenizer-only": ["train", text, "--out", out, "--tokenizer-only", "--vocab-size", "300"],
        "export-gguf": ["export", rope_path, "--format", "gguf", "--out", out],
    }


@pytest.mark.parametrize("command", ["quantize", "convert", "train", "train-tokenizer-only", "export-gguf"])
def test_force_never_replaces_a_fifo(tmp_path, rope, shakespeare, command):
    text = tmp_path / "text.txt"
    text.write_text(shakespeare[:20_000])
    out = special_file(tmp_path / "out", "fifo")
    args = commands_writing(out, rope.path, text, tmp_path)[command]
    one_error_line(run(*args, "--force"), 1, str(out), "a pipe, not a regular file")
    assert stat.S_ISFIFO(os.lstat(out).st_mode)


@pytest.mark.parametrize("kind", ["socket", "device"])
def test_force_never_replaces_a_socket_or_a_device(tmp_path, rope, kind):
    if kind == "device" and os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    out = special_file(tmp_path / "out", kind)
    one_error_line(run("quantize", rope.path, "--out", out, "--force"), 1, str(out), "not a regular file")
    mode = os.lstat(out).st_mode
    assert stat.S_ISSOCK(mode) if kind == "socket" else stat.S_ISCHR(mode)


def test_force_never_replaces_a_fifo_inside_an_hf_export_folder(tmp_path, learned):
    out = tmp_path / "hf"
    out.mkdir()
    special_file(out / "config.json", "fifo")
    one_error_line(run("export", learned.path, "--out", out, "--force"), 1, "config.json", "a pipe")
    assert stat.S_ISFIFO(os.lstat(out / "config.json").st_mode)


# ---- data loss 2 and 3: every file a command reads is an input ---------------------------------------------------


@pytest.mark.parametrize("spelling", ["same-name", "another-spelling", "hard-link"])
def test_quantize_never_writes_over_its_input_even_with_force(tmp_path, rope, spelling):
    source = tmp_path / "m.safetensors"
    source.write_bytes(rope.path.read_bytes())
    out = {"same-name": source, "another-spelling": tmp_path / "." / "m.safetensors", "hard-link": tmp_path / "link"}[
        spelling
    ]
    if spelling == "hard-link":
        os.link(source, out)
    one_error_line(run("quantize", source, "--out", out, "--force"), 1, "is the input file")
    assert source.read_bytes() == rope.path.read_bytes()


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "pytorch_model.bin"])
def test_convert_never_writes_over_a_file_of_its_source_folder(tmp_path, exported, name):
    folder = exported("learned", tmp_path / "hf")
    if name == "pytorch_model.bin":
        torch.save({}, folder / name)
    before = (folder / name).read_bytes()
    one_error_line(run("convert", folder, "--out", folder / name, "--force"), 1, "is the input file")
    assert (folder / name).read_bytes() == before


def test_export_never_writes_over_its_checkpoint_in_the_out_folder(tmp_path, rope):
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(rope.path.read_bytes())
    one_error_line(run("export", folder / "model.safetensors", "--out", folder, "--force"), 1, "is the input file")
    assert (folder / "model.safetensors").read_bytes() == rope.path.read_bytes()


# ---- 4, 5, 6: bounded time and memory ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, knob",
    [
        (["generate", "-p", "a", "--num-samples", str(2**70)], "--num-samples"),
        (["generate", "-p", "a", "--num-samples", str(10**9)], "--num-samples"),
        (["bench", "--batch", "10000000", "--tokens", "2"], "--batch"),
    ],
)
def test_a_request_the_machine_cannot_hold_is_refused_with_its_size(rope, args, knob):
    line = one_error_line(run(*args, "-c", rope.path, *RUN_OPTIONS), 1, knob, "GiB", "free")
    assert "this run needs about" in line


def test_a_prompt_longer_than_the_window_is_benched_at_the_window(rope):
    result = run(
        "bench",
        "-c",
        rope.path,
        *RUN_OPTIONS,
        "--prompt-tokens",
        str(10**9),
        "--tokens",
        "2",
        "--repeat",
        "1",
        "--no-baseline",
        "--json",
    )
    assert result.returncode == 0, result.stderr.decode()
    assert json.loads(result.stdout)["tests"][0]["name"] == "pp32"


def test_a_static_cache_holds_what_the_run_needs_not_the_claimed_window(tmp_path, rope):
    path = write_variant(tmp_path / "huge-window.safetensors", rope.path, config={"block_size": 2**20})
    result = run(
        "inspect-cache", "-c", path, *RUN_OPTIONS, "--cache", "static", "-p", "ROMEO:", "--tokens", "3", "--json"
    )
    assert result.returncode == 0, result.stderr.decode()
    report = json.loads(result.stdout)
    assert report["storage_bytes"] == report["logical_bytes"] == report["bytes_per_position"] * report["positions"]
    assert generate_from(path, "--cache", "static", "-p", "ROMEO:", "-n", "3").returncode == 0


@pytest.mark.parametrize("threads", ["0", "1000000", str(2**70)])
def test_threads_out_of_range_is_a_usage_error_naming_the_range(rope, threads):
    result = run("generate", "-c", rope.path, "-p", "a", "--threads", threads)
    assert result.returncode == 2, result.stderr.decode()
    assert "1 <= threads <= 256" in result.stderr.decode() and "Traceback" not in result.stderr.decode()


# ---- 7: long generations keep only the window -------------------------------------------------------------------


def test_a_streamed_sample_keeps_none_of_its_text():
    from manas_cli.streaming import TextStream

    encoding = build_encoding(bpe_spec(BYTE_RANKS))
    stream = TextStream(encoding, None, (), record=False)
    printed = "".join(stream.feed(ord("a")) for _ in range(100_000))
    assert printed == "a" * 100_000 and stream.count == 100_000
    assert stream.text == "" and stream.tokens == []


def test_a_generation_many_windows_long_streams_every_token(rope):
    result = generate_from(rope.path, "-p", "ROMEO:", "-n", "3000", "--overflow", "shift", "--seed", "1", "--stats")
    assert result.returncode == 0, result.stderr.decode()
    generated = int(result.stderr.decode().split("generated ")[1].split()[0])
    assert generated > 4 * 32 and "re-prefills 0 " not in result.stderr.decode()  # many windows (block_size 32)


# ---- 8: non-finite values that appear after loading -----------------------------------------------------------------


def test_a_float64_weight_that_overflows_float32_is_refused_naming_it(tmp_path, rope):
    state, _ = read_parts(rope.path)
    huge = state["blocks.0.ffn.up.weight"].double()
    huge[0, 0] = 1e300
    path = write_variant(tmp_path / "f64.safetensors", rope.path, tensors={"blocks.0.ffn.up.weight": huge})
    assert_one_error(generate_from(path, "-p", "a", "-n", "2"), "blocks.0.ffn.up.weight", "float32")
    for args in (["--format", "hf", "--out", tmp_path / "hf"], ["--format", "gguf", "--out", tmp_path / "m.gguf"]):
        assert_one_error(run("export", path, *args), "NaN or infinite")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("scale", [1e300, 3e38])
def test_an_int8_scale_whose_rows_overflow_is_refused_naming_it(tmp_path, rope, scale):
    quantized = tmp_path / "int8.safetensors"
    assert run("quantize", rope.path, "--out", quantized).returncode == 0
    state, _ = read_parts(quantized)
    scales = state["blocks.1.ffn.down.scales"].double()
    scales[2] = scale
    path = write_variant(tmp_path / "bad.safetensors", quantized, tensors={"blocks.1.ffn.down.scales": scales})
    assert_one_error(generate_from(path, "-p", "a", "-n", "2"), "blocks.1.ffn.down.scales", "NaN or infinite")


def test_finite_weights_whose_logits_overflow_are_an_error_not_nul_bytes(tmp_path, rope):
    state, _ = read_parts(rope.path)
    path = write_variant(
        tmp_path / "loud.safetensors",
        rope.path,
        tensors={"final_norm.weight": torch.full_like(state["final_norm.weight"], 3e38)},
    )
    line = assert_one_error(generate_from(path, "-p", "ROMEO:", "-n", "5", "--json"), "NaN or infinite logits")
    assert "--dtype float32" in line


# ---- 9, 10, 11, 12: wrong results without an error ------------------------------------------------------------------


def test_a_special_token_spelled_like_an_ordinary_token_is_refused_on_export(tmp_path, learned):
    _, metadata = read_parts(learned.path)
    spec = json.loads(metadata["tokenizer"])
    eot = spec["special_tokens"].pop("<|endoftext|>")
    spec["special_tokens"]["Ġt"] = eot  # " t" in GPT-2's byte alphabet, one of the tiny BPE's merges
    path = write_variant(tmp_path / "alias.safetensors", learned.path, tokenizer=spec)
    assert_one_error(run("export", path, "--out", tmp_path / "hf"), "'Ġt'", "spelled like ordinary token")


def overlapping_header_file(path: Path, source: Path, moved: str, onto: str) -> Path:
    """source with tensor `moved`'s byte range pointed at `onto`'s (same size)."""
    data = source.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    header[moved]["data_offsets"] = header[onto]["data_offsets"]
    text = json.dumps(header).encode()  # data offsets count from the header's end: its length may change
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length :])
    return path


def test_overlapping_tensor_data_is_refused_naming_both(tmp_path, rope):
    path = overlapping_header_file(
        tmp_path / "overlap.safetensors", rope.path, "blocks.0.ln_ffn.weight", "blocks.0.ln_attention.weight"
    )
    assert_one_error(
        generate_from(path, "-p", "a", "-n", "2"), "blocks.0.ln_attention.weight", "blocks.0.ln_ffn.weight", "overlap"
    )


@pytest.fixture(scope="module")
def exported(checkpoints, tmp_path_factory):
    """A copy of a tiny checkpoint's Hugging Face export (GPT-2 for 'learned', Starcoder2 for 'rope'), exported
    once per module: the tests change their copies."""
    folders = {}

    def copy(name: str, to: Path) -> Path:
        if name not in folders:
            folders[name] = tmp_path_factory.mktemp("exported") / name
            checkpoint = checkpoints["learned-mha" if name == "learned" else "rope-gqa"]
            assert run("export", checkpoint.path, "--out", folders[name]).returncode == 0
        shutil.copytree(folders[name], to)
        return to

    return copy


def convert_back(folder: Path, checkpoint, tmp_path: Path) -> subprocess.CompletedProcess:
    """`manas convert` of an exported folder, with the checkpoint's own BPE ranks as the tokenizer file."""
    ranks = tmp_path / "ranks.tiktoken"
    ranks.write_text(json.loads(read_parts(checkpoint.path)[1]["tokenizer"])["ranks"])
    return run("convert", folder, "--out", tmp_path / "back.safetensors", "--tokenizer-file", ranks)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32])
def test_starcoder2_convert_refuses_non_float_q_k_v(tmp_path, rope, exported, dtype):
    folder = exported("rope", tmp_path / "sc2")
    state, metadata = read_parts(folder / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.weight"
    state[name] = state[name].to(dtype)
    (folder / "model.safetensors").write_bytes(save(state, metadata=metadata))
    assert_one_error(convert_back(folder, rope, tmp_path), name, "not a real floating-point")


@pytest.mark.parametrize("poison", ["nan-in-a-weight", "float64-1e300-norm"])
def test_convert_never_writes_what_the_loader_refuses(tmp_path, poison):
    args = write_nanogpt(tmp_path)
    checkpoint = torch.load(args[0], weights_only=True)
    state = checkpoint["model"]
    if poison == "nan-in-a-weight":
        state["transformer.h.0.attn.c_attn.weight"][5, 5] = float("nan")
    else:
        state["transformer.ln_f.weight"] = state["transformer.ln_f.weight"].double().fill_(1e300)
    torch.save(checkpoint, args[0])
    out = tmp_path / "out.safetensors"
    assert_one_error(run("convert", *args, "--out", out), "NaN or infinite")
    assert not out.exists()


# ---- 13, 14: closed streams and repeated signals ---------------------------------------------------------------------


def close_stderr() -> None:
    os.close(2)


def test_a_closed_stderr_changes_nothing_but_silence(tmp_path, rope):
    result = subprocess.run(
        [*MANAS, "generate", "-c", rope.path, *RUN_OPTIONS, "-p", "ROMEO:", "-n", "5", "--json", "--stats"],
        capture_output=False,
        stdout=subprocess.PIPE,
        env=cli_env(),
        preexec_fn=close_stderr,
        timeout=120,
    )
    assert result.returncode == 0
    assert json.loads(result.stdout)["generated_tokens"] == 5
    convert = subprocess.run(
        [*MANAS, "convert", *write_nanogpt(tmp_path), "--out", tmp_path / "c.safetensors"],
        stdout=subprocess.PIPE,
        env=cli_env(),
        preexec_fn=close_stderr,
        timeout=120,
    )
    assert convert.returncode == 0 and convert.stdout == b""
    assert (tmp_path / "c.safetensors").is_file()


def test_a_second_signal_during_the_clean_up_loses_nothing(rope):
    process = subprocess.Popen(
        [
            *MANAS,
            "generate",
            "-c",
            rope.path,
            *RUN_OPTIONS,
            "-p",
            "ROMEO:",
            "-n",
            "1000000",
            "--num-samples",
            "3",
            "--json",
            "--stats",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # Loaded and generating once the window is full (a tiny model decodes a token in about a millisecond): the
    # notice says so, and the signals come while the rows decode past it.
    notice = process.stderr.readline()
    for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):
        process.send_signal(sig)
    stdout, stderr = process.communicate(timeout=60)
    stderr = notice + stderr
    assert process.returncode == 130, stderr.decode()
    records = [json.loads(line) for line in stdout.decode().splitlines()]
    assert len(records) == 3 and all(r["generated_tokens"] > 0 for r in records)
    reasons = [r["finish_reason"] for r in records]  # a random tiny model may draw <|endoftext|> before the signal
    assert "interrupted" in reasons and set(reasons) <= {"interrupted", "end_of_text"}, reasons
    # no traceback of a signal arriving during the clean-up; the notice that the window filled, and the stats
    notice, stats = stderr.decode().splitlines()
    assert notice.startswith("notice: the context window is full") and "--overflow shift" in notice
    assert stats.startswith("prompt 6 tokens · generated")


# ---- 15: tiktoken's panics ----------------------------------------------------------------------------------------


def test_training_text_with_a_million_space_run_trains(tmp_path, shakespeare):
    text = tmp_path / "spaces.txt"
    text.write_text(shakespeare[:20_000] + " " * 1_000_000 + shakespeare[20_000:40_000])
    result = run("train", text, "--out", tmp_path / "m.safetensors", "--steps", "1", *TINY_SHAPE)
    err = result.stderr.decode()
    assert result.returncode == 0, err
    assert "panicked" not in err


# ---- 16: malformed header JSON ------------------------------------------------------------------------------------


def raw_safetensors(path: Path, header: bytes) -> Path:
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    return path


@pytest.mark.parametrize(
    "header, fragment",
    [
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
        (b'{"t": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 0]}}', "not JSON"),
        (
            json.dumps(
                {
                    "__metadata__": {
                        "format": "manas-gpt",
                        "format_version": "1",
                        "config": "{}",
                        "tokenizer": {"kind": "bpe"},
                    }
                }
            ).encode(),
            "'tokenizer' is a dict, not a string",
        ),
    ],
    ids=["deep-nesting", "5000-digit-integer", "non-string-metadata"],
)
def test_a_malformed_header_names_the_file(tmp_path, header, fragment):
    path = raw_safetensors(tmp_path / "bad.safetensors", header)
    assert_one_error(generate_from(path, "-p", "a"), str(path), fragment)


def test_deeply_nested_config_metadata_names_the_file(tmp_path, rope):
    _, metadata = read_parts(rope.path)
    state, _ = read_parts(rope.path)
    metadata["config"] = "[" * 100_000 + "]" * 100_000
    path = tmp_path / "deep.safetensors"
    path.write_bytes(save(state, metadata=metadata))
    assert_one_error(generate_from(path, "-p", "a"), str(path), "invalid config")


# ---- 17: messages ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model, field, value", [("rope", "rope_base", 1e300), ("learned", "norm_eps", 5e-324)])
def test_gguf_refuses_a_float_it_cannot_store(tmp_path, checkpoints, model, field, value):
    source = checkpoints["rope-gqa" if model == "rope" else "learned-mha"].path
    path = write_variant(tmp_path / "odd.safetensors", source, config={field: value})
    assert_one_error(run("export", path, "--format", "gguf", "--out", tmp_path / "m.gguf"), field, "float32")


def test_a_megabyte_special_token_is_named_as_such(tmp_path, rope):
    spec = bpe_spec(BYTE_RANKS, special_tokens={"<" + "x" * 1_000_000 + ">": 256})
    path = write_variant(tmp_path / "big.safetensors", rope.path, tokenizer=spec)
    assert_one_error(generate_from(path, "-p", "a"), "special token", "1,000,002 characters")


def test_an_out_name_of_250_characters_is_written(tmp_path, rope):
    out = tmp_path / ("q" * 238 + ".safetensors")
    result = run("quantize", rope.path, "--out", out)
    assert result.returncode == 0, result.stderr.decode()
    assert out.is_file() and [p.name for p in tmp_path.iterdir()] == [out.name]


def test_export_into_a_link_to_an_empty_folder_writes_there(tmp_path, learned):
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    result = run("export", learned.path, "--out", tmp_path / "link")
    assert result.returncode == 0, result.stderr.decode()
    assert (tmp_path / "empty" / "config.json").is_file() and (tmp_path / "link").is_symlink()


def test_a_random_ckpt_message_is_ours_not_torchs(tmp_path):
    """Random bytes are no pickle nor zip: said in one sentence of manas's, not torch's weights_only paragraph."""
    (tmp_path / "ckpt.pt").write_bytes(b"\x00" + os.urandom(4096))
    (tmp_path / "tok.tiktoken").write_text(
        "".join(f"{__import__('base64').b64encode(bytes([i])).decode()} {i}\n" for i in range(256))
    )
    line = assert_one_error(
        run(
            "convert",
            tmp_path / "ckpt.pt",
            "--out",
            tmp_path / "o.safetensors",
            "--tokenizer-file",
            tmp_path / "tok.tiktoken",
        ),
        "not a readable PyTorch checkpoint",
    )
    assert "weights_only" not in line and line.endswith("or its model.safetensors")


def test_a_starcoder2_config_without_hidden_size_names_it(tmp_path, rope, exported):
    folder = exported("rope", tmp_path / "sc2")
    config = json.loads((folder / "config.json").read_text())
    del config["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config))
    assert_one_error(convert_back(folder, rope, tmp_path), "lacks hidden_size")


def test_a_broken_gguf_install_says_to_reinstall(tmp_path, rope):
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "__init__.py").write_text("raise RuntimeError('numpy ABI mismatch')\n")
    env = cli_env(PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    result = cli("export", rope.path, "--format", "gguf", "--out", tmp_path / "m.gguf", env=env)
    assert_one_error(result, "fails to import", "numpy ABI mismatch", "reinstall")
