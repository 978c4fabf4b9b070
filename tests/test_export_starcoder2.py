"""`manas export --format hf` of rotary models: a Hugging Face Starcoder2 folder that transformers loads offline and
that computes and generates exactly as manas does, for every head layout, with and without biases; `manas convert`
reads it back to the same tensors, and refuses Starcoder2 options manas does not compute."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # every load below must come from the exported folder alone

import pytest
import torch

from cli_fixtures import RUN_OPTIONS
from conftest import make_model
from manas_cli.formats.checkpoint import load_checkpoint, save_checkpoint
from manas_cli.formats.tokenizer import build_encoding, decode_ranks, encode_ranks
from test_convert import assert_converted, assert_refused, run_manas

torch.set_num_threads(1)

VARIANTS = [(layout, bias) for layout in ("mha", "gqa", "mqa") for bias in (True, False)]
PROMPT = "the weather in the €uro zone"


def ranks_file(folder: Path, spec: dict) -> Path:
    """The spec's ranks as a .tiktoken file: convert --tokenizer-file then embeds the very same tokenizer."""
    path = folder / "tiny.tiktoken"
    path.write_text(encode_ranks(decode_ranks(spec["ranks"])))
    return path


@pytest.fixture(scope="module")
def gqa_export(tmp_path_factory, tiny_bpe_spec) -> tuple[Path, Path]:
    return export_rope_model(tmp_path_factory.mktemp("starcoder2"), tiny_bpe_spec, "gqa", True)


def export_rope_model(tmp_path: Path, spec: dict, layout: str, bias: bool) -> tuple[Path, Path]:
    encoding = build_encoding(spec)
    model = make_model("rope", layout, bias=bias, vocab_size=encoding.n_vocab, block_size=96, rope_base=500.0)
    checkpoint = tmp_path / "model.safetensors"
    save_checkpoint(checkpoint, model, spec)
    result = run_manas("export", checkpoint, "--format", "hf", "--out", tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    assert "Starcoder2" in result.stderr
    return checkpoint, tmp_path / "hf"


@pytest.mark.parametrize(("layout", "bias"), VARIANTS, ids=[f"{layout}-bias={bias}" for layout, bias in VARIANTS])
def test_rope_model_exports_as_starcoder2_that_computes_generates_and_converts_back_exactly(
    tmp_path, tiny_bpe_spec, layout, bias
):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Starcoder2ForCausalLM

    checkpoint, folder = export_rope_model(tmp_path, tiny_bpe_spec, layout, bias)
    manas_model = load_checkpoint(checkpoint).model
    hf_model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert isinstance(hf_model, Starcoder2ForCausalLM)
    assert hf_model.config.num_key_value_heads == manas_model.config.n_kv_head
    assert hf_model.model.layers[0].input_layernorm.eps == manas_model.config.norm_eps

    ids = torch.randint(0, manas_model.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, manas_model(ids), atol=1e-4, rtol=0)

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt_ids = build_encoding(tiny_bpe_spec).encode_ordinary(PROMPT)
    assert tokenizer(PROMPT)["input_ids"] == prompt_ids
    cli = run_manas("generate", "-c", checkpoint, *RUN_OPTIONS, "-p", PROMPT, "-n", "64", "-t", "0", "--json")
    assert cli.returncode == 0, cli.stderr
    manas_ids = json.loads(cli.stdout)["tokens"]
    eot = tokenizer.eos_token_id
    with torch.no_grad():
        prompt = torch.tensor([prompt_ids])
        hf_ids = hf_model.generate(prompt, do_sample=False, max_new_tokens=64, pad_token_id=eot)[0, len(prompt_ids) :]
    assert hf_ids.tolist()[: len(manas_ids)] == manas_ids  # manas leaves out the end-of-text that ends a sample
    assert len(manas_ids) == 64 or hf_ids[len(manas_ids)] == eot

    assert_converts_back_to_the_same_tensors(tmp_path, checkpoint, folder, tiny_bpe_spec, bias)


def assert_converts_back_to_the_same_tensors(tmp_path: Path, checkpoint: Path, folder: Path, spec: dict, bias: bool):
    ranks = ranks_file(tmp_path, spec)
    result = run_manas("convert", folder, "--tokenizer-file", ranks, "--out", tmp_path / "back.safetensors")
    assert_converted(result, tmp_path / "back.safetensors")
    assert "Hugging Face Starcoder2 folder" in result.stderr

    original, back = load_checkpoint(checkpoint), load_checkpoint(tmp_path / "back.safetensors")
    assert back.tokenizer_spec == original.tokenizer_spec
    # A bias=False model was exported with zero biases, so it comes back as bias=True with those zeros.
    assert back.model.config.to_dict() == original.model.config.to_dict() | {"bias": True}
    state = back.model.state_dict()
    for name, tensor in original.model.state_dict().items():
        assert torch.equal(state.pop(name), tensor), name
    assert all(name.endswith(".bias") and not tensor.any() for name, tensor in state.items())
    assert bool(state) != bias  # only a bias=False model has biases that were not its own


def test_starcoder2_config_carries_rope_base_eps_window_and_tied_embeddings(gqa_export):
    _, folder = gqa_export
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Starcoder2ForCausalLM"] and config["model_type"] == "starcoder2"
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 500.0
    assert config["sliding_window"] is None and config["tie_word_embeddings"] is True
    assert config["norm_epsilon"] == 1e-5 and config["hidden_act"] == "gelu_pytorch_tanh"
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["max_position_embeddings"]) == (
        4,
        2,
        96,
    )
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "model.layers.1.self_attn.k_proj.bias" in names


def test_a_starcoder2_saved_by_transformers_converts_to_the_same_logits(tmp_path, tiny_bpe_spec):
    """Not only manas' own export: a Starcoder2ForCausalLM of manas' shape, as transformers saves it."""
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    torch.manual_seed(0)
    config = Starcoder2Config(
        vocab_size=build_encoding(tiny_bpe_spec).n_vocab,
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
    )
    hf_model = Starcoder2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in hf_model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1)  # transformers starts biases at zero, which would test nothing
    hf_model.save_pretrained(tmp_path / "hf")

    ranks = ranks_file(tmp_path, tiny_bpe_spec)
    result = run_manas("convert", tmp_path / "hf", "--tokenizer-file", ranks, "--out", tmp_path / "m.safetensors")
    assert_converted(result, tmp_path / "m.safetensors")
    model = load_checkpoint(tmp_path / "m.safetensors").model
    assert (model.config.position_encoding, model.config.n_kv_head, model.config.rope_base) == ("rope", 2, 500.0)
    ids = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf_model(ids).logits, atol=1e-4, rtol=0)


# ---- convert refusals ---------------------------------------------------------------------------------------------


CONFIG_REFUSALS = {
    "sliding_window": ({"sliding_window": 8}, "sliding_window=8 has no manas equivalent"),
    "rope_scaling": (
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}},
        "rope_parameters=",
    ),
    "no_bias": ({"use_bias": False}, "use_bias=False has no manas equivalent"),
    "untied": ({"tie_word_embeddings": False}, "tie_word_embeddings=False has no manas equivalent"),
    "field-of-the-wrong-type": ({"num_key_value_heads": "2"}, "num_key_value_heads must be an int, got '2'"),
}


@pytest.mark.parametrize("case", list(CONFIG_REFUSALS))
def test_convert_refuses_starcoder2_options_manas_does_not_compute(tmp_path, tiny_bpe_spec, gqa_export, case):
    changes, message = CONFIG_REFUSALS[case]
    folder = shutil.copytree(gqa_export[1], tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))

    ranks = ranks_file(tmp_path, tiny_bpe_spec)
    result = run_manas("convert", folder, "--tokenizer-file", ranks, "--out", tmp_path / "back.safetensors")
    assert_refused(result, message)
    assert not (tmp_path / "back.safetensors").exists()
