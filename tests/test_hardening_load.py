"""Hostile and damaged inputs on the loading side (issue 9): every one gets one `error:` line or a correct run, never
a traceback, and memory stays bounded by the file. The memory cases run the real CLI under an address-space limit,
so that a regression fails instead of swapping."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from cli_fixtures import BLOCK_SIZE, MANAS, RUN_OPTIONS, checkpoints, cli, cli_env, learned, rope  # noqa: F401
from manas_cli.engine.config import parameter_shapes
from manas_cli.formats.checkpoint import load_checkpoint
from manas_cli.formats.gpt2 import gpt2_name
from manas_cli.formats.tokenizer import bpe_spec, encode_ranks
from manas_cli.torch_engine.model import GPT, GPTConfig

ADDRESS_SPACE = 3 << 30  # far below what any of the refused claims would allocate
SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "shakespeare.safetensors"
BYTE_RANKS = {bytes([i]): i for i in range(256)}


def run(*args: str | Path, stdin: bytes = b"") -> subprocess.CompletedProcess:
    """The real CLI under the address-space limit."""
    return cli(*args, stdin=stdin, address_space=ADDRESS_SPACE)


def assert_one_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    err = result.stderr.decode()
    lines = err.strip().splitlines()
    assert result.returncode == 1, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert result.stdout == b""
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def read_parts(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(path, framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata()


def write_variant(
    path: Path,
    source: Path,
    *,
    config: dict | None = None,
    tokenizer: dict | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """source's checkpoint with config fields, the tokenizer spec or tensors replaced (a None tensor is removed)."""
    state, metadata = read_parts(source)
    if config:
        metadata["config"] = json.dumps(json.loads(metadata["config"]) | config)
    if tokenizer is not None:
        metadata["tokenizer"] = json.dumps(tokenizer)
    for name, tensor in (tensors or {}).items():
        if tensor is None:
            del state[name]
        else:
            state[name] = tensor
    path.write_bytes(save(state, metadata=metadata))
    return path


def generate_from(path: Path, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return run("generate", "-c", path, *RUN_OPTIONS, *args, stdin=stdin)


# ---- item 5: a prompt that tiktoken's regex engine cannot split ------------------------------------------------


@pytest.mark.parametrize("model", ["shipped", "tiny"])
def test_a_million_character_whitespace_run_generates(model, rope):
    path = SHIPPED if model == "shipped" else rope.path
    result = generate_from(path, "-n", "5", "-t", "0", stdin=b" " * 1_000_000 + b"\n")
    err = result.stderr.decode()
    assert result.returncode == 0, err
    assert "panicked" not in err and "Traceback" not in err
    (notice,) = err.splitlines()
    assert notice.startswith("notice: the prompt has 1000001 characters; encoding its last")


def test_a_long_prompt_keeps_exactly_the_tokens_of_the_whole_prompt(rope):
    """Encoding only the tail loses nothing: the window equals the last block_size tokens of the whole text."""
    text = (Path(__file__).resolve().parent / "data" / "tinyshakespeare-head.txt").read_text()[:30_000]
    result = generate_from(rope.path, "-p", text, "-n", "6", "-t", "0", "--json")
    assert result.returncode == 0, result.stderr.decode()
    assert "encoding its last" in result.stderr.decode()
    assert json.loads(result.stdout)["tokens"] == rope.reference(text, 6)[0]


# ---- item 6: tokenizers are validated when built ---------------------------------------------------------------


def spec_with(ranks: str | None = None, **changes) -> dict:
    return bpe_spec(BYTE_RANKS) | ({"ranks": ranks} if ranks is not None else {}) | changes


BAD_TOKENIZERS = {
    "duplicate-rank-id": (spec_with(encode_ranks(BYTE_RANKS) + "YWI= 5\n"), "rank 5 is already given on line 6"),
    "duplicate-bytes": (spec_with(encode_ranks(BYTE_RANKS) + "QQ== 300\n"), "token b'A' already has rank 65"),
    "empty-pattern": (spec_with(pat_str=""), "pat_str must be a non-empty regular expression"),
    "backreference-pattern": (spec_with(pat_str=r"(a+)\1b|."), "uses a backreference or a conditional"),
    "negative-rank": (spec_with(encode_ranks(BYTE_RANKS) + "YWI= -1\n"), "rank -1 is outside [0, 2^32)"),
    "rank-past-u32": (spec_with(encode_ranks(BYTE_RANKS) + f"YWI= {1 << 32}\n"), f"rank {1 << 32} is outside"),
    "null-ranks": (spec_with(ranks=None) | {"ranks": None}, "the BPE ranks must be the text of a .tiktoken file"),
    "special-id-not-integer": (spec_with(special_tokens={"<|endoftext|>": "256"}), "has id '256', not an integer"),
    "special-id-past-u32": (spec_with(special_tokens={"<|endoftext|>": 1 << 32}), "not an integer in [0, 2^32)"),
    "special-id-is-a-rank": (spec_with(special_tokens={"<|endoftext|>": 65}), "id 65, which is already the token b'A'"),
    "hole": (spec_with(special_tokens={"<|endoftext|>": 300}), "no token has id 256"),
}


@pytest.mark.parametrize("case", list(BAD_TOKENIZERS))
def test_checkpoint_tokenizer_is_validated_naming_the_file_and_entry(tmp_path, rope, case):
    spec, message = BAD_TOKENIZERS[case]
    path = write_variant(tmp_path / "bad.safetensors", rope.path, tokenizer=spec)
    assert_one_error(generate_from(path, "-p", "a", "-n", "2"), str(path), message)


def test_tokenizer_file_with_a_duplicate_rank_is_refused_by_convert_naming_it(tmp_path):
    (tmp_path / "dup.tiktoken").write_text(encode_ranks(BYTE_RANKS) + "YWI= 7\n")
    (tmp_path / "ckpt.pt").write_bytes(b"unused")
    result = run(
        "convert",
        tmp_path / "ckpt.pt",
        "--out",
        tmp_path / "o.safetensors",
        "--tokenizer-file",
        tmp_path / "dup.tiktoken",
    )
    assert_one_error(result, str(tmp_path / "dup.tiktoken"), "rank 7 is already given on line 8")


def test_meta_pkl_with_non_contiguous_ids_is_refused_by_convert(tmp_path):
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"stoi": {"a": 0, "b": 2}, "itos": {0: "a", 2: "b"}}))
    (tmp_path / "ckpt.pt").write_bytes(b"unused")
    result = run(
        "convert", tmp_path / "ckpt.pt", "--out", tmp_path / "o.safetensors", "--tokenizer-meta", tmp_path / "meta.pkl"
    )
    assert_one_error(result, str(tmp_path / "meta.pkl"), "no token has id 1")


# ---- item 7: a reader racing an atomic replace -------------------------------------------------------------------


def write_marked(path: Path, n_layer: int, mark: float) -> None:
    """A checkpoint whose every weight is `mark`: a load mixing two files shows as a config/value mismatch."""
    config = GPTConfig(vocab_size=257, block_size=16, n_layer=n_layer, n_head=2, n_embd=16)
    tensors = {name: torch.full(shape, mark) for name, shape in parameter_shapes(config)}
    metadata = {
        "format": "manas-gpt",
        "format_version": "1",
        "config": json.dumps(config.to_dict()),
        "tokenizer": json.dumps(bpe_spec(BYTE_RANKS)),
    }
    path.write_bytes(save(tensors, metadata=metadata))


REPLACER = """
import os, sys, shutil
target, sources = sys.argv[1], sys.argv[2:]
i = 0
while not os.path.exists(target + ".stop"):
    shutil.copyfile(sources[i % 2], target + ".tmp")
    os.replace(target + ".tmp", target)
    i += 1
"""


def test_loads_racing_an_atomic_replace_always_read_one_whole_file(tmp_path):
    one, two, target = tmp_path / "one.safetensors", tmp_path / "two.safetensors", tmp_path / "model.safetensors"
    write_marked(one, n_layer=1, mark=1.0)
    write_marked(two, n_layer=3, mark=3.0)
    write_marked(target, n_layer=1, mark=1.0)
    writer = subprocess.Popen([sys.executable, "-c", REPLACER, str(target), str(one), str(two)])
    try:
        seen = set()
        for _ in range(150):
            model = load_checkpoint(target).model
            n_layer = model.config.n_layer
            assert all(torch.all(p == n_layer) for p in model.parameters())
            seen.add(n_layer)
        result = run("generate", "-c", target, *RUN_OPTIONS, "-p", "a", "-n", "2")
        assert result.returncode == 0, result.stderr.decode()
    finally:
        (tmp_path / "model.safetensors.stop").touch()
        writer.wait(timeout=60)
    assert seen == {1, 3}  # the race really happened


# ---- item 8: NaN and infinite weights ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_at_load_naming_the_tensor(tmp_path, rope, value):
    state, _ = read_parts(rope.path)
    poisoned = state["blocks.1.ffn.up.weight"].clone()
    poisoned[3, 4] = value
    path = write_variant(tmp_path / "nan.safetensors", rope.path, tensors={"blocks.1.ffn.up.weight": poisoned})
    assert_one_error(generate_from(path, "-p", "a", "-n", "2"), str(path), "blocks.1.ffn.up.weight", "NaN or infinite")


# ---- item 11: memory bounded by the file -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("claim", "message"),
    [
        ({"n_layer": 10**6}, "missing tensor blocks.2.ln_attention.weight"),
        ({"vocab_size": 10**7}, "tensor token_embedding.weight has shape [320, 32], the config needs [10000000, 32]"),
        ({"block_size": 10**9}, "block_size must be at most 1048576"),
    ],
)
def test_a_small_file_claiming_a_huge_model_is_refused_without_allocating_it(tmp_path, learned, claim, message):
    path = write_variant(tmp_path / "claims.safetensors", learned.path, config=claim)
    assert_one_error(generate_from(path, "-p", "a", "-n", "2"), str(path), message)


def test_a_rope_block_size_no_tensor_backs_allocates_nothing(tmp_path, rope):
    """2^20 positions of rope tables per layer would not fit the limit; they grow with the positions used."""
    path = write_variant(tmp_path / "long.safetensors", rope.path, config={"block_size": 1 << 20})
    result = generate_from(path, "-p", "To be", "-n", "4", "-t", "0", "--json")
    assert result.returncode == 0, result.stderr.decode()
    assert json.loads(result.stdout)["tokens"] == rope.reference("To be", 4)[0]


def nanogpt_checkpoint(
    path: Path, *, block_size: int = 16, model_args: dict | None = None, legacy: bool = False, **tensors: torch.Tensor
) -> Path:
    """A nanoGPT ckpt.pt (bias-free, vocab 257) written by torch.save, as nanoGPT's train.py writes it."""
    config = GPTConfig(vocab_size=257, block_size=block_size, n_layer=1, n_head=2, n_embd=16, bias=False)
    state = {}
    for name, tensor in GPT(config).state_dict().items():
        gpt2 = "lm_head.weight" if name == "lm_head.weight" else "transformer." + gpt2_name(name)
        state[gpt2] = tensor
    args = dict(n_layer=1, n_head=2, n_embd=16, block_size=block_size, bias=False, vocab_size=257, dropout=0.0)
    state.update({f"transformer.{name}": tensor for name, tensor in tensors.items()})
    torch.save(
        {"model_args": args | (model_args or {}), "model": state}, path, _use_new_zipfile_serialization=not legacy
    )
    return path


def convert(src: Path, tmp_path: Path, *extra: str | Path) -> subprocess.CompletedProcess:
    (tmp_path / "bytes.tiktoken").write_text(encode_ranks(BYTE_RANKS))
    return run(
        "convert", src, "--out", tmp_path / "out.safetensors", "--tokenizer-file", tmp_path / "bytes.tiktoken", *extra
    )


def test_convert_refuses_a_nanogpt_block_size_its_tensors_do_not_back(tmp_path):
    src = nanogpt_checkpoint(tmp_path / "ckpt.pt", model_args={"block_size": 1 << 20})
    assert_one_error(
        convert(src, tmp_path), str(src), "position_embedding.weight has shape [16, 16], the config needs [1048576, 16]"
    )
    assert not (tmp_path / "out.safetensors").exists()


def test_convert_refuses_an_hf_n_positions_its_tensors_do_not_back(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=16, n_embd=16, n_layer=1, n_head=2)).save_pretrained(
        tmp_path / "hf"
    )
    config = json.loads((tmp_path / "hf" / "config.json").read_text()) | {"n_positions": 1 << 20}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert_one_error(
        convert(tmp_path / "hf", tmp_path),
        "position_embedding.weight has shape [16, 16], the config needs [1048576, 16]",
    )


# ---- item 12: a small ckpt.pt whose storage inflates -------------------------------------------------------------


def test_a_compressed_ckpt_pt_is_refused_before_anything_inflates(tmp_path):
    """A storage entry deflated from 256 MB of zeros (a few hundred KB): refused from the zip's directory alone."""
    plain = nanogpt_checkpoint(tmp_path / "plain.pt", extra=torch.zeros(4))
    src = tmp_path / "ckpt.pt"
    with zipfile.ZipFile(plain) as original, zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as bomb:
        names = original.namelist()
        storage = max((n for n in names if "/data/" in n), key=lambda n: int(n.rsplit("/", 1)[1]))
        for name in names:
            if name == storage:
                with bomb.open(name, "w", force_zip64=True) as f:
                    for _ in range(4):
                        f.write(bytes(64 << 20))
            else:
                bomb.writestr(name, original.read(name))
    assert src.stat().st_size < 2 << 20
    assert_one_error(convert(src, tmp_path), str(src), "is compressed inside the archive")


# ---- item 13: complex tensors; no library warning on stderr ------------------------------------------------------


def test_convert_refuses_complex_weights_naming_the_tensor(tmp_path):
    src = nanogpt_checkpoint(
        tmp_path / "ckpt.pt", **{"h.0.mlp.c_fc.weight": torch.randn(64, 16, dtype=torch.complex64)}
    )
    assert_one_error(
        convert(src, tmp_path), str(src), "blocks.0.ffn.up.weight is torch.complex64, not a real floating-point"
    )


def test_a_legacy_raw_pickle_ckpt_converts_with_nothing_from_torch_on_stderr(tmp_path):
    src = nanogpt_checkpoint(tmp_path / "ckpt.pt", legacy=True)
    assert not zipfile.is_zipfile(src)
    result = convert(src, tmp_path)
    assert result.returncode == 0, result.stderr.decode()
    assert "Warning" not in result.stderr.decode()
    bad = nanogpt_checkpoint(tmp_path / "bad.pt", legacy=True, model_args={"n_embd": 32})
    assert_one_error(convert(bad, tmp_path, "--force"), str(bad), "the config needs")


# ---- items 14 and 16: strict config types, named fields ----------------------------------------------------------


def test_a_string_bias_in_a_checkpoint_config_is_refused_naming_the_field(tmp_path, rope):
    path = write_variant(tmp_path / "bias.safetensors", rope.path, config={"bias": "false"})
    assert_one_error(generate_from(path, "-p", "a", "-n", "2"), str(path), "bias must be a bool, got 'false'")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("bias", "false", "model_args.bias must be a bool, got 'false'"),
        ("n_layer", True, "model_args.n_layer must be an int, got True"),
        ("dropout", "0.1", "model_args.dropout must be a float, got '0.1'"),
    ],
)
def test_nanogpt_model_args_types_are_strict(tmp_path, field, value, message):
    src = nanogpt_checkpoint(tmp_path / "ckpt.pt", model_args={field: value})
    assert_one_error(convert(src, tmp_path), str(src), message)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("layer_norm_epsilon", "abc", "layer_norm_epsilon must be a float, got 'abc'"),
        ("n_embd", None, "n_embd must be an int, got None"),
        ("n_layer", 1.0, "n_layer must be an int, got 1.0"),
    ],
)
def test_hf_config_types_are_strict_naming_the_config_file(tmp_path, field, value, message):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=16, n_embd=16, n_layer=1, n_head=2)).save_pretrained(
        tmp_path / "hf"
    )
    config = json.loads((tmp_path / "hf" / "config.json").read_text()) | {field: value}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert_one_error(convert(tmp_path / "hf", tmp_path), str(tmp_path / "hf" / "config.json"), message)


def test_random_bytes_as_ckpt_pt_are_not_a_pytorch_checkpoint(tmp_path):
    src = tmp_path / "ckpt.pt"
    src.write_bytes(os.urandom(4096))
    line = assert_one_error(convert(src, tmp_path), str(src), "not a readable PyTorch checkpoint")
    assert "run code" not in line


# ---- item 15: integer and bool tensors in a float checkpoint -----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool])
def test_non_float_tensors_are_refused_naming_the_file_and_tensor(tmp_path, rope, dtype):
    state, _ = read_parts(rope.path)
    name = "blocks.0.attention.qkv.weight"
    path = write_variant(tmp_path / "int.safetensors", rope.path, tensors={name: state[name].to(dtype)})
    header_dtype = {torch.int8: "I8", torch.bool: "BOOL"}[dtype]
    assert_one_error(generate_from(path, "-p", "a", "-n", "2"), str(path), f"tensor {name} is {header_dtype}")


def test_parameter_shapes_are_the_models_own():
    for config in (
        GPTConfig(
            vocab_size=50,
            block_size=8,
            n_layer=2,
            n_head=4,
            n_kv_head=2,
            n_embd=16,
            position_encoding="rope",
            bias=False,
        ),
        GPTConfig(vocab_size=50, block_size=8, n_layer=2, n_head=4, n_embd=16),
    ):
        model_shapes = [
            (name, tuple(t.shape)) for name, t in GPT(config).state_dict().items() if name != "lm_head.weight"
        ]
        assert list(parameter_shapes(config)) == model_shapes
