"""The checkpoint format: a faithful round trip, atomic saves, and a named reason for every bad file."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import make_model
from manas_cli.errors import CheckpointError, ManasError
from manas_cli.files import atomic_write
from manas_cli.formats.checkpoint import load_checkpoint, save_checkpoint
from manas_cli.formats.header import read_metadata
from manas_cli.formats.tokenizer import build_encoding, end_of_text_id
from manas_cli.torch_engine.quantize import quantize_model


def test_round_trip_gives_identical_logits_and_tokenizer(tiny_model, tiny_bpe_spec, tmp_path):
    path = tmp_path / "model.safetensors"
    save_checkpoint(path, tiny_model, tiny_bpe_spec)
    checkpoint = load_checkpoint(path)
    loaded = checkpoint.model
    assert not loaded.training
    assert loaded.config == tiny_model.config
    idx = torch.randint(300, (2, tiny_model.config.block_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(idx), tiny_model(idx))
    assert checkpoint.tokenizer_spec == tiny_bpe_spec
    assert checkpoint.path == path
    text = "the théâtre costs 5 €"
    assert checkpoint.encoding.encode_ordinary(text) == build_encoding(tiny_bpe_spec).encode_ordinary(text)
    assert end_of_text_id(checkpoint.encoding) == 267


def test_a_header_whose_length_begins_as_a_pickle_does_is_still_read(tiny_model, tiny_bpe_spec, tmp_path):
    """A header of 640 + 65,536·k bytes is stored little-endian as 80 02 …, a pickle's first two bytes: the JSON
    that follows at byte 8 says it is safetensors (transformers wrote such a shard in this suite)."""
    path = tmp_path / "model.safetensors"
    save_checkpoint(path, tiny_model, tiny_bpe_spec, {"pad": ""})
    length = int.from_bytes(path.read_bytes()[:8], "little")
    target = length + (640 - length) % 65536
    save_checkpoint(path, tiny_model, tiny_bpe_spec, {"pad": "x" * (target - length)})
    assert path.read_bytes()[:2] == b"\x80\x02"
    assert load_checkpoint(path).model.config == tiny_model.config


def test_tied_lm_head_is_not_stored_and_is_tied_again_on_load(tiny_model, tiny_bpe_spec, tmp_path):
    path = tmp_path / "model.safetensors"
    save_checkpoint(path, tiny_model, tiny_bpe_spec)
    with safe_open(path, framework="pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names
    assert names == set(tiny_model.state_dict()) - {"lm_head.weight"}
    loaded = load_checkpoint(path).model
    assert loaded.lm_head.weight is loaded.token_embedding.weight
    with torch.no_grad():  # still tied after the load: training one trains the other
        loaded.token_embedding.weight[0, 0] = 42.0
    assert loaded.lm_head.weight[0, 0] == 42.0


LLAMA_FAMILY = dict(norm="rmsnorm", mlp="swiglu", ffn_hidden=96, bias=False, qkv_bias=True, tie_embeddings=False)


@pytest.mark.parametrize("weights", ["float32", "int8", "int4"])
def test_a_llama_family_model_round_trips_as_version_3_with_its_own_output_layer(weights, tiny_bpe_spec, tmp_path):
    """RMSNorm (no bias), a SwiGLU MLP of its own width, biases on q, k, v only, an untied output layer: stored
    under lm_head (quantized with the other matrices), the token embedding kept float (it is only looked up)."""
    model = make_model("rope", "gqa", **LLAMA_FAMILY)
    if weights != "float32":
        quantize_model(model, weights)
    path = tmp_path / "model.safetensors"
    save_checkpoint(path, model, tiny_bpe_spec)
    metadata = read_metadata(path)
    assert metadata["format_version"] == "3"
    assert metadata.get("quantization") == (None if weights == "float32" else weights)
    assert json.loads(metadata["config"]) == {**model.config.to_dict(), **LLAMA_FAMILY}
    with safe_open(path, framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("token_embedding.weight").dtype == torch.float32
        assert f.get_tensor("lm_head.weight").dtype == {"float32": torch.float32, "int8": torch.int8}.get(
            weights, torch.uint8
        )
    assert "blocks.0.ffn.gate.weight" in names and "blocks.0.attention.qkv.bias" in names
    assert not any(name.endswith(("output.bias", "ffn.up.bias", "norm.bias")) for name in names)
    loaded = load_checkpoint(path).model
    assert loaded.config == model.config
    assert loaded.lm_head.weight is not loaded.token_embedding.weight
    idx = torch.randint(300, (2, model.config.block_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))


def test_a_gpt2_block_is_still_written_as_version_1_without_the_family_fields(tiny_bpe_spec, tmp_path):
    """Files of GPT-2's block stay readable by earlier manas: no new field, the version they knew."""
    path = tmp_path / "model.safetensors"
    save_checkpoint(path, make_model("rope", "gqa"), tiny_bpe_spec)
    config = json.loads(read_metadata(path)["config"])
    assert read_metadata(path)["format_version"] == "1"
    assert not {"norm", "mlp", "ffn_hidden", "head_dim", "tie_embeddings", "qkv_bias"} & set(config)


def test_metadata_names_the_format_version_config_and_tokenizer(tiny_bpe_spec, tmp_path):
    model = make_model("rope", "gqa")
    path = tmp_path / "model.safetensors"
    save_checkpoint(path, model, tiny_bpe_spec, {"training": json.dumps({"step": 7, "val_loss": 3.5})})
    metadata = read_metadata(path)
    assert metadata["format"] == "manas-gpt"
    assert metadata["format_version"] == "1"
    assert json.loads(metadata["config"]) == model.config.to_dict()
    assert json.loads(metadata["tokenizer"]) == tiny_bpe_spec
    assert json.loads(metadata["training"]) == {"step": 7, "val_loss": 3.5}


def test_model_without_biases_stores_no_bias_tensors_and_round_trips(tiny_bpe_spec, tmp_path):
    model = make_model("rope", "gqa", bias=False)
    path = tmp_path / "model.safetensors"
    save_checkpoint(path, model, tiny_bpe_spec)
    with safe_open(path, framework="pt") as f:
        assert not [name for name in f.keys() if name.endswith(".bias")]
    idx = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(load_checkpoint(path).model(idx), model(idx))


def test_rotary_tables_are_rebuilt_on_load(tiny_bpe_spec, tmp_path):
    model = make_model("rope", "mqa")
    path = tmp_path / "model.safetensors"
    save_checkpoint(path, model, tiny_bpe_spec)
    loaded = load_checkpoint(path).model
    for original, block in zip(model.blocks, loaded.blocks):
        assert torch.equal(block.attention.cos, original.attention.cos)
        assert torch.equal(block.attention.sin, original.attention.sin)


def test_load_converts_to_the_requested_dtype(tiny_bpe_spec, tmp_path):
    path = tmp_path / "model.safetensors"
    save_checkpoint(path, make_model("rope", "gqa"), tiny_bpe_spec)
    model = load_checkpoint(path, dtype=torch.bfloat16).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).dtype == torch.bfloat16


# ---- bad files: each names what is wrong ---------------------------------------------------------------------------


def valid_tensors_and_metadata(spec: dict, **config_overrides) -> tuple[dict, dict]:
    model = make_model("learned", "gqa", **config_overrides)
    tensors = {name: t.contiguous() for name, t in model.state_dict().items() if name != "lm_head.weight"}
    metadata = {
        "format": "manas-gpt",
        "format_version": "1",
        "config": json.dumps(model.config.to_dict()),
        "tokenizer": json.dumps(spec),
    }
    return tensors, metadata


def save_valid(path, spec, **config_overrides):
    tensors, metadata = valid_tensors_and_metadata(spec, **config_overrides)
    save_file(tensors, path, metadata=metadata)


def missing_file(path, spec):
    pass


def not_safetensors(path, spec):
    path.write_text("this is a text file, not a checkpoint\n")


def truncated(path, spec):
    save_valid(path, spec)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def corrupt_header(path, spec):
    save_valid(path, spec)
    data = bytearray(path.read_bytes())
    data[8:40] = b"#" * 32  # the JSON header starts after its 8-byte length
    path.write_bytes(bytes(data))


def plain_safetensors(path, spec):
    tensors, _ = valid_tensors_and_metadata(spec)
    save_file(tensors, path)  # what nanoGPT- or Hugging Face-style exports look like: no manas metadata


def other_format(path, spec):
    tensors, metadata = valid_tensors_and_metadata(spec)
    save_file(tensors, path, metadata={**metadata, "format": "pt"})


def future_version(path, spec):
    tensors, metadata = valid_tensors_and_metadata(spec)
    save_file(tensors, path, metadata={**metadata, "format_version": "4"})


def missing_tensor(path, spec):
    tensors, metadata = valid_tensors_and_metadata(spec)
    del tensors["blocks.1.ffn.down.weight"]
    save_file(tensors, path, metadata=metadata)


def unexpected_tensor(path, spec):
    tensors, metadata = valid_tensors_and_metadata(spec)
    tensors["blocks.2.ffn.up.weight"] = torch.zeros(128, 32)
    save_file(tensors, path, metadata=metadata)


def stored_lm_head(path, spec):
    tensors, metadata = valid_tensors_and_metadata(spec)
    tensors["lm_head.weight"] = tensors["token_embedding.weight"].clone()
    save_file(tensors, path, metadata=metadata)


def wrongly_shaped_tensor(path, spec):
    tensors, metadata = valid_tensors_and_metadata(spec)
    tensors["blocks.0.attention.qkv.weight"] = torch.zeros(96, 32)  # MHA's width in a GQA checkpoint
    save_file(tensors, path, metadata=metadata)


def tokenizer_larger_than_vocab(path, spec):
    save_valid(path, spec, vocab_size=260)  # the tokenizer has 268 tokens


def invalid_config(path, spec):
    tensors, metadata = valid_tensors_and_metadata(spec)
    config = json.loads(metadata["config"])
    save_file(tensors, path, metadata={**metadata, "config": json.dumps({**config, "n_kv_head": 3})})


def unknown_config_field(path, spec):
    tensors, metadata = valid_tensors_and_metadata(spec)
    config = json.loads(metadata["config"])
    save_file(tensors, path, metadata={**metadata, "config": json.dumps({**config, "n_experts": 8})})


def config_not_json(path, spec):
    tensors, metadata = valid_tensors_and_metadata(spec)
    save_file(tensors, path, metadata={**metadata, "config": "{vocab_size: 300"})


def family_fields_in_version_1(path, spec):
    tensors, metadata = valid_tensors_and_metadata(spec, norm="rmsnorm")
    save_file({k: t for k, t in tensors.items() if not k.endswith("norm.bias")}, path, metadata=metadata)


def gpt2_block_in_version_3(path, spec):
    tensors, metadata = valid_tensors_and_metadata(spec)
    save_file(tensors, path, metadata={**metadata, "format_version": "3"})


def unknown_norm(path, spec):
    tensors, metadata = valid_tensors_and_metadata(spec)
    config = {**json.loads(metadata["config"]), "norm": "batchnorm"}
    save_file(tensors, path, metadata={**metadata, "format_version": "3", "config": json.dumps(config)})


def unknown_tokenizer_kind(path, spec):
    tensors, metadata = valid_tensors_and_metadata(spec)
    save_file(tensors, path, metadata={**metadata, "tokenizer": json.dumps({"kind": "sentencepiece"})})


def damaged_ranks(path, spec):
    tensors, metadata = valid_tensors_and_metadata(spec)
    save_file(tensors, path, metadata={**metadata, "tokenizer": json.dumps({**spec, "ranks": "not-base64!! 0\n"})})


BAD_FILES = [
    (missing_file, "no such checkpoint file"),
    (not_safetensors, "not a readable safetensors file"),
    (truncated, "not a readable safetensors file.*truncated or corrupt"),
    (corrupt_header, "not a readable safetensors file.*truncated or corrupt"),
    (plain_safetensors, "not a manas checkpoint.*`manas convert` imports nanoGPT and Hugging Face GPT-2"),
    (other_format, "not a manas checkpoint.*manas convert"),
    (future_version, "unsupported format_version '4'.*reads 1"),
    (missing_tensor, r"missing tensor blocks\.1\.ffn\.down\.weight \(expected shape \[32, 128\]\)"),
    (unexpected_tensor, r"unexpected tensor blocks\.2\.ffn\.up\.weight"),
    (stored_lm_head, r"unexpected tensor lm_head\.weight"),
    (
        wrongly_shaped_tensor,
        r"tensor blocks\.0\.attention\.qkv\.weight has shape \[96, 32\], the config needs \[64, 32\]",
    ),
    (tokenizer_larger_than_vocab, "tokenizer has 268 tokens but the model's vocab_size is 260"),
    (invalid_config, r"invalid config: n_head \(4\) must be divisible by n_kv_head \(3\)"),
    (unknown_config_field, "invalid config: unknown config field.*n_experts"),
    (config_not_json, "invalid config"),
    (family_fields_in_version_1, "format_version 1 with Llama-family config fields.*needs format_version 3"),
    (gpt2_block_in_version_3, "format_version 3 with a GPT-2 block's config"),
    (unknown_norm, "invalid config: norm must be one of layernorm, rmsnorm, got 'batchnorm'"),
    (unknown_tokenizer_kind, "unknown tokenizer kind 'sentencepiece'"),
    (damaged_ranks, "line 1 of the BPE ranks"),
]


@pytest.mark.parametrize(("write_bad_file", "message"), BAD_FILES, ids=[f.__name__ for f, _ in BAD_FILES])
def test_loading_a_bad_file_names_the_file_and_what_is_wrong(write_bad_file, message, tiny_bpe_spec, tmp_path):
    path = tmp_path / "bad.safetensors"
    write_bad_file(path, tiny_bpe_spec)
    with pytest.raises(CheckpointError, match=message) as raised:
        load_checkpoint(path)
    assert str(raised.value).startswith(str(path))
    assert "\n" not in str(raised.value)  # the CLI prints it as one line
    assert isinstance(raised.value, ManasError)


def test_the_bad_file_builders_start_from_a_loadable_checkpoint(tiny_bpe_spec, tmp_path):
    """Guards the cases above: without the one defect each introduces, the file loads."""
    path = tmp_path / "good.safetensors"
    save_valid(path, tiny_bpe_spec)
    assert load_checkpoint(path).model.config.n_kv_head == 2


def test_save_refuses_a_tokenizer_larger_than_the_vocabulary(tiny_bpe_spec, tmp_path):
    path = tmp_path / "model.safetensors"
    with pytest.raises(CheckpointError, match="268 tokens but the model's vocab_size is 260"):
        save_checkpoint(path, make_model(vocab_size=260), tiny_bpe_spec)
    assert list(tmp_path.iterdir()) == []


# ---- atomic saves --------------------------------------------------------------------------------------------------


def test_failed_save_leaves_no_file_behind(tiny_bpe_spec, tmp_path):
    path = tmp_path / "model.safetensors"
    with pytest.raises(TypeError):  # safetensors refuses non-string metadata while writing
        save_checkpoint(path, make_model(), tiny_bpe_spec, {"training": 5})
    assert list(tmp_path.iterdir()) == []


def test_failed_save_leaves_the_previous_checkpoint_intact(tiny_bpe_spec, tmp_path):
    path = tmp_path / "model.safetensors"
    save_checkpoint(path, make_model(seed=0), tiny_bpe_spec)
    before = path.read_bytes()
    with pytest.raises(TypeError):
        save_checkpoint(path, make_model(seed=1), tiny_bpe_spec, {"training": 5})
    assert path.read_bytes() == before
    assert list(tmp_path.iterdir()) == [path]
    load_checkpoint(path)


@pytest.mark.parametrize("interruption", [OSError("disk full"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_write_interrupted_half_way_keeps_the_old_file(tmp_path, interruption):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"old complete contents")

    def write_half_then_fail(temporary: str) -> None:
        assert Path(temporary).parent == tmp_path  # same folder, so the final rename is atomic
        Path(temporary).write_bytes(b"new conte")
        raise interruption

    with pytest.raises(type(interruption)):
        atomic_write(path, write_half_then_fail, overwrite=True)
    assert path.read_bytes() == b"old complete contents"
    assert list(tmp_path.iterdir()) == [path]


def test_successful_save_replaces_the_previous_checkpoint(tiny_bpe_spec, tmp_path):
    path = tmp_path / "model.safetensors"
    save_checkpoint(path, make_model(seed=0), tiny_bpe_spec)
    newer = make_model(seed=1)
    save_checkpoint(path, newer, tiny_bpe_spec)
    assert torch.equal(load_checkpoint(path).model.token_embedding.weight, newer.token_embedding.weight)
    assert list(tmp_path.iterdir()) == [path]


def test_saved_checkpoint_is_an_ordinary_file_not_a_private_temporary_one(tiny_bpe_spec, tmp_path):
    path = tmp_path / "model.safetensors"
    umask = os.umask(0o022)
    try:
        save_checkpoint(path, make_model("rope", "gqa"), tiny_bpe_spec)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
