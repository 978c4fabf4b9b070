"""Hardening IV (issue 32): the fifth hostile round's cases, each through the real CLI or a real server on a loopback
port. The native core's cases run on `--engine native` (the default on the CPU) beside `--engine torch`, which must
refuse or run the same files alike."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import openai
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from cli_fixtures import RUN_OPTIONS, checkpoints, manas, rope  # noqa: F401
from conftest import make_model, needs_compiler
from test_native import dequantized_reference
from manas_cli.engine.quantize import Int4Linear, Int8Linear, quantizable, quantize_groups, quantize_rows
from manas_cli.engine.native import NativeGPT
from manas_cli.formats.checkpoint import load_checkpoint, save_checkpoint
from manas_cli.formats.header import open_checkpoint
from manas_cli.formats.tokenizer import bpe_spec

BYTE_SPEC = bpe_spec({bytes([i]): i for i in range(256)})


def assert_one_error(run, *fragments: str) -> str:
    lines = run.err.strip().splitlines()
    assert run.returncode == 1, run.err
    assert len(lines) == 1 and lines[0].startswith("error: "), run.err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def quantized_file(path: Path, kind: str, group_size: int = 32, **config) -> Path:
    """A random tiny model of `config` with every linear layer quantized, int4 in groups of `group_size`."""
    model = make_model("rope", "gqa", vocab_size=264, **config)
    with torch.no_grad():
        for name in quantizable(model):
            linear = model.get_submodule(name)
            layer = (Int8Linear(*quantize_rows(linear.weight), linear.bias) if kind == "int8" else
                     Int4Linear(*quantize_groups(linear.weight, group_size), linear.bias))
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, layer)
    save_checkpoint(path, model, BYTE_SPEC)
    return path


def rewrite_header(source: Path, target: Path, change) -> Path:
    """source with its safetensors header passed through change(header) (the data bytes as they were)."""
    data = source.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + length])
    change(header)
    encoded = json.dumps(header).encode()
    target.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length :])
    return target


def run_model(path: Path, engine: str, *args: str):
    return manas("generate", "-c", path, *RUN_OPTIONS, "--engine", engine, "-p", "ab", *args)


# ---- item 1: every tensor's byte extent, checked before any pointer reaches C ----------------------------------


@needs_compiler
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("tensor", ["blocks.0.ffn.up.weight", "lm_head.scales", "blocks.1.ln_ffn.weight"])
def test_a_tensor_whose_bytes_are_fewer_than_its_shape_is_refused_on_both_engines(tmp_path, kind, tensor):
    source = quantized_file(tmp_path / "source.safetensors", kind)
    name = "token_embedding.scales" if tensor == "lm_head.scales" else tensor

    def empty(header):
        begin = header[name]["data_offsets"][0]
        header[name]["data_offsets"] = [begin, begin]

    lying = rewrite_header(source, tmp_path / "lying.safetensors", empty)
    for engine in ("native", "torch"):
        for command in (("generate", "-p", "ab", "-n", "3"), ("score", "-"), ("inspect-cache",)):
            run = manas(command[0], "-c", lying, *RUN_OPTIONS, "--engine", engine, *command[1:], stdin=b"abcdef")
            assert_one_error(run, name, "0 bytes of data")


# ---- item 2: int4 in every group size the format allows --------------------------------------------------------


@pytest.mark.parametrize("n_embd, group_size", [(32, 32), (64, 64), (40, 40), (32, 16), (32, 2), (16, 16), (48, 48),
                                                (96, 32), (80, 20)])
def test_int4_of_any_group_size_runs_on_the_core(native_library, tmp_path, n_embd, group_size):
    """The core's int4 product equals x · Wᵀ over the dequantized weights (torch's engine rounds its activations to
    bfloat16, so its greedy tokens part from both after a few steps on a random model); the mapped file and the
    torch model's own tensors give the core the same bits; the CLI runs the file."""
    path = quantized_file(tmp_path / f"int4-{group_size}.safetensors", "int4", group_size, n_embd=n_embd)
    model = load_checkpoint(path).model
    ids = torch.randint(264, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = dequantized_reference(model)(ids)
    got = NativeGPT(model, native_library)(ids)
    assert ((got - expected).abs().max() / expected.abs().max()).item() <= 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert torch.equal(NativeGPT(open_checkpoint(path), native_library)(ids), got)
    run = run_model(path, "native", "-n", "40", "-t", "0", "--json").ok().json()
    assert run["engine"] == "native" and run["generated_tokens"] > 0


# ---- item 3: integers the core would narrow ---------------------------------------------------------------------


@needs_compiler
def test_a_top_k_beyond_32_bits_is_no_filter_on_both_engines(rope):
    args = ("-p", "ROMEO:", "-n", "12", "-t", "0.9", "--seed", "5", "--json")
    for engine in ("native", "torch"):
        unfiltered = manas("generate", "-c", rope.path, *RUN_OPTIONS, "--engine", engine, *args).ok().json()
        huge = manas("generate", "-c", rope.path, *RUN_OPTIONS, "--engine", engine, *args,
                     "--top-k", str(2**32 + 1)).ok().json()
        assert huge["tokens"] == unfiltered["tokens"]
    greedy = manas("generate", "-c", rope.path, *RUN_OPTIONS, *args[:4], "-t", "0", "--json").ok().json()
    assert huge["tokens"] != greedy["tokens"]  # 2^32 + 1 wrapped to 1 was greedy


@needs_compiler
def test_a_repeat_window_beyond_32_bits_is_the_whole_window(rope):
    args = ("-p", "ROMEO: ROMEO: ROMEO:", "-n", "12", "-t", "0", "--repetition-penalty", "3", "--json")
    whole = manas("generate", "-c", rope.path, *RUN_OPTIONS, *args, "--repeat-last-n", "-1").ok().json()
    huge = manas("generate", "-c", rope.path, *RUN_OPTIONS, *args, "--repeat-last-n", str(2**32)).ok().json()
    none = manas("generate", "-c", rope.path, *RUN_OPTIONS, *args, "--repeat-last-n", "0").ok().json()
    assert huge["tokens"] == whole["tokens"] != none["tokens"]


@needs_compiler
def test_threads_up_to_the_flags_limit_run_on_the_core(rope):
    run = manas("generate", "-c", rope.path, "--threads", "100", "-p", "ROMEO:", "-n", "5", "-t", "0", "--json")
    assert run.ok().json()["engine"] == "native"
    over = manas("generate", "-c", rope.path, "--threads", "257", "-p", "ROMEO:", "-n", "5")
    assert over.returncode == 2 and "1 <= threads <= 256" in over.err


# ---- item 6: one request's failure is its own -----------------------------------------------------------------


@pytest.fixture(scope="module")
def loud_at_10(checkpoints, tmp_path_factory) -> Path:
    """A learned-position model whose position 10 row is 3e38: a request that reaches position 10 has infinite
    logits there, one that stops before it does not."""
    source = checkpoints["learned-mha"].path
    tensors, metadata = _read(source)
    tensors["position_embedding.weight"][10] = 3e38
    path = tmp_path_factory.mktemp("loud") / "loud.safetensors"
    path.write_bytes(save(tensors, metadata=metadata))
    return path


def _read(path: Path):
    with safe_open(path, framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata()


def test_a_jsonl_request_whose_logits_overflow_gets_its_error_record_and_the_rest_go_on(loud_at_10):
    lines = [{"prompt": "ab", "max_tokens": 4, "temperature": 0}, {"prompt": "ab", "max_tokens": 20},
             {"prompt": "cd", "max_tokens": 4, "temperature": 0}, {"prompt": "ef", "max_tokens": 3}]
    stdin = "".join(json.dumps(line) + "\n" for line in lines).encode()
    run = manas("generate", "-c", loud_at_10, *RUN_OPTIONS, "--jsonl", stdin=stdin)
    records = run.json_lines()
    assert run.returncode == 1 and [record["id"] for record in records] == [1, 2, 3, 4]
    assert "NaN or infinite logits at position 10" in records[1]["error"] and records[1]["line"] == 2
    assert [len(records[i]["tokens"]) for i in (0, 2, 3)] == [4, 4, 3]
    assert "1 of 4 lines failed" in run.err and "Traceback" not in run.err


def test_a_request_whose_logits_overflow_gets_an_error_and_the_server_goes_on(loud_at_10):
    from test_serve import running_server

    with running_server(loud_at_10, "--batch-size", "4") as live:
        client = live.client()
        with pytest.raises(openai.InternalServerError, match="position 10"):
            client.completions.create(model=live.model, prompt="ab", max_tokens=20)
        stream = client.completions.create(model=live.model, prompt="ab", max_tokens=20, stream=True, n=2)
        with pytest.raises(openai.APIError, match="position 10"):
            list(stream)
        for _ in range(3):
            answer = client.completions.create(model=live.model, prompt="ab", max_tokens=4, temperature=0)
            assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 4
        assert live.health()["status"] == "ok"
