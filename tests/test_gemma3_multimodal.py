"""Gemma 3 4B and up as published (issue 71): Gemma3ForConditionalGeneration, a language model beside a vision
tower, whose global layers' rope scales linearly (a factor of 8 in 4B) while its local layers' rope does not. manas
converts the language model alone, and runs it from that checkpoint and from the GGUF it exports (llama.cpp's
gemma3 with rope.scaling.type linear): greedy text and scores are transformers' (the multimodal model, given text
only) on both engines, and the export goes back to transformers."""

from __future__ import annotations

import json

import pytest
import torch

from cli_fixtures import RUN_OPTIONS, manas
from conftest import needs_compiler
from manas_cli.formats.checkpoint import load_checkpoint
from manas_cli.formats.tokenizer import encode_text
from test_cli_errors import assert_one_error_line
from test_llama_family import CTX, FAMILIES, PROMPT, SHAPE, converted, crop_and_recompute, saved_random
from test_new_families import TEXT, assert_llama_simple_writes_manas_text, transformers_greedy

gguf = pytest.importorskip("gguf")

# Gemma 3 1B's test layout (two local layers of three, a window of 8), its global layer's rope scaled as 4B's
GEMMA3 = FAMILIES["gemma3"][1]
TEXT_CONFIG = (
    SHAPE
    | GEMMA3
    | dict(
        rope_parameters=GEMMA3["rope_parameters"]
        | {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
    )
)
VISION_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                     patch_size=14)  # fmt: skip


@pytest.fixture(scope="module")
def gemma_4b(tmp_path_factory, tiny_bpe_spec) -> dict:
    """transformers' multimodal model, its folder converted, and that checkpoint exported as an f32 GGUF."""
    import transformers

    folder = tmp_path_factory.mktemp("gemma3-4b")
    config = transformers.Gemma3Config(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG, mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = saved_random(transformers.Gemma3ForConditionalGeneration(config).eval(), folder / "hf", tiny_bpe_spec,
                         "gpt2")  # fmt: skip
    checkpoint = converted(folder, folder / "hf", through_the_cli=True)
    exported = folder / "model.gguf"
    manas("export", checkpoint, "--format", "gguf", "--outtype", "f32", "--out", exported).ok()
    return {"hf": model, "folder": folder / "hf", "checkpoint": checkpoint, "gguf": exported}


def test_the_language_model_converts_alone_its_global_layers_rope_scaled(gemma_4b):
    config = load_checkpoint(gemma_4b["checkpoint"]).model.config
    assert config.rope_factors == [8.0] * 16 and config.local_rope_base == 10000.0 and config.window_layers == [0, 1]
    assert [config.rope_factors_of(layer) for layer in range(3)] == [None, None, [8.0] * 16]
    reader = gguf.GGUFReader(gemma_4b["gguf"])
    assert reader.fields["gemma3.rope.scaling.factor"].contents() == 8.0
    assert reader.fields["gemma3.rope.scaling.type"].contents() == "linear"
    assert not [t.name for t in reader.tensors if "rope" in t.name or "vision" in t.name or "mm" in t.name]


@needs_compiler
@pytest.mark.parametrize("engine", ["native", "torch"])
@pytest.mark.parametrize("source", ["checkpoint", "gguf"])
def test_greedy_text_is_the_multimodal_models_for_64_tokens_on_both_engines(gemma_4b, source, engine):
    env = {} if engine == "native" else {"MANAS_ENGINE": "torch"}
    run = manas("generate", "-m", gemma_4b[source], *RUN_OPTIONS, "-p", PROMPT, "-n", "64", "-t", "0", "--json", **env)
    record = run.ok().json()
    assert record["engine"] == engine
    ids = encode_text(load_checkpoint(gemma_4b["checkpoint"]).encoding, PROMPT)
    expected = transformers_greedy(gemma_4b["hf"], ids, 64)
    assert record["tokens"] == expected[: len(record["tokens"])] and len(record["tokens"]) >= 32


@needs_compiler
@pytest.mark.parametrize("source", ["checkpoint", "gguf"])
def test_a_score_is_the_multimodal_models_within_1e_4_nats_per_token(gemma_4b, source, tmp_path):
    """The text is longer than the window and than 64 positions, where a rope scaled by 8 turns 8 times slower."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    record = manas("score", str(text), "-m", gemma_4b[source], *RUN_OPTIONS, "--json").ok().json()
    ids = encode_text(load_checkpoint(gemma_4b["checkpoint"]).encoding, TEXT)
    with torch.no_grad():
        expected = gemma_4b["hf"](torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert abs(record["nats_per_token"] - expected) <= 1e-4


@needs_compiler
@pytest.mark.parametrize("source", ["checkpoint", "gguf"])
def test_seeded_generation_past_the_window_equals_crop_and_recompute(gemma_4b, source):
    run = manas("generate", "-m", gemma_4b[source], *RUN_OPTIONS, "-p", PROMPT, "-n", "40", "--ctx", str(CTX), "-t",
                "0.9", "--top-k", "40", "--seed", "7", "--json")  # fmt: skip
    record = run.ok().json()
    assert record["engine"] == "native" and record["re_prefills"] > 0
    assert record["tokens"] == crop_and_recompute(gemma_4b[source], "native", PROMPT, 40, 7, temperature=0.9, top_k=40)


@needs_compiler
def test_llama_cpp_greedy_text_on_the_exported_gguf_is_manas_generate(gemma_4b):
    """llama.cpp scales the global layers' rope alone too (its gemma3's rope_freq_scale_train_swa is 1)."""
    assert_llama_simple_writes_manas_text(gemma_4b)


def test_export_hf_gives_transformers_the_language_model(gemma_4b, tmp_path):
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM

    manas("export", gemma_4b["checkpoint"], "--format", "hf", "--out", tmp_path / "back").ok()
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is Gemma3ForCausalLM
    ids = torch.randint(0, 270, (1, 80), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, gemma_4b["hf"](ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.pop("text_config"), "needs a text_config object"),
        (lambda c: c["text_config"].update(model_type="llama"), "text_config.model_type is 'llama'"),
        (
            lambda c: c["text_config"]["rope_parameters"]["sliding_attention"].update(rope_type="linear", factor=2.0),
            "rope_parameters.sliding_attention",
        ),
        (
            lambda c: c["text_config"]["rope_parameters"]["full_attention"].update(rope_type="yarn"),
            "rope_parameters.full_attention",
        ),
    ],
)
def test_a_config_manas_cannot_run_is_one_error_line(gemma_4b, tmp_path, edit, message):
    folder = tmp_path / "hf"
    folder.mkdir()
    for path in gemma_4b["folder"].iterdir():
        (folder / path.name).symlink_to(path)
    config = json.loads((gemma_4b["folder"] / "config.json").read_text())
    edit(config)
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    assert_one_error_line(manas("convert", folder, "--out", tmp_path / "out.safetensors"), 1, message)
    assert not (tmp_path / "out.safetensors").exists()


def test_a_tensor_under_both_layouts_names_is_one_error_line(gemma_4b, tmp_path):
    """transformers 4.50's language_model.model.* and 4.52's model.language_model.* name the same tensor: a file
    holding both is refused, not read as whichever came last."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    for path in gemma_4b["folder"].iterdir():
        if path.name != "model.safetensors":
            (folder / path.name).symlink_to(path)
    tensors = load_file(gemma_4b["folder"] / "model.safetensors")
    tensors["model.language_model.norm.weight"] = tensors["language_model.model.norm.weight"].clone()
    save_file(tensors, folder / "model.safetensors")
    message = "both the language model's model.norm.weight"
    assert_one_error_line(manas("convert", folder, "--out", tmp_path / "out.safetensors"), 1, message)
    assert not (tmp_path / "out.safetensors").exists()


# Gemma 3 27B scales attention by 1/√query_pre_attn_scalar (168, beside heads of 128), where the others use their
# head size; llama.cpp knows it by its 62 layers and takes n_embd / n_head. Shrunk: scalars of 48 and, at 62
# layers, 64 / 4 = 16, beside heads of 32.
LAYERS_27B = 62


@pytest.fixture(scope="module")
def scaled_attention(tmp_path_factory, tiny_bpe_spec) -> dict:
    from test_llama_family import hf_folder

    models = {}
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    for name, changes in {
        "scalar-48": dict(query_pre_attn_scalar=48),
        "27b-layers": dict(num_hidden_layers=LAYERS_27B, query_pre_attn_scalar=16,
                           layer_types=(kinds * 11)[:LAYERS_27B]),
    }.items():  # fmt: skip
        folder = tmp_path_factory.mktemp(name)
        hf = hf_folder(folder / "hf", tiny_bpe_spec, "gemma3", **changes)
        models[name] = {"hf": hf, "checkpoint": converted(folder, folder / "hf"), "folder": folder}
    exported = models["27b-layers"]["folder"] / "model.gguf"
    manas("export", models["27b-layers"]["checkpoint"], "--format", "gguf", "--outtype", "f32", "--out", exported).ok()
    models["27b-layers"]["gguf"] = exported
    return models


@needs_compiler
@pytest.mark.parametrize("engine", ["native", "torch"])
@pytest.mark.parametrize("model, source", [("scalar-48", "checkpoint"), ("27b-layers", "gguf")])
def test_an_attention_scalar_gives_transformers_greedy_text_on_both_engines(scaled_attention, model, source, engine):
    model = scaled_attention[model]
    assert load_checkpoint(model["checkpoint"]).model.config.attention_scalar in (48.0, 16.0)
    env = {} if engine == "native" else {"MANAS_ENGINE": "torch"}
    run = manas("generate", "-m", model[source], *RUN_OPTIONS, "-p", PROMPT, "-n", "64", "-t", "0", "--json", **env)
    ids = encode_text(load_checkpoint(model["checkpoint"]).encoding, PROMPT)
    expected = transformers_greedy(model["hf"], ids, 64)
    tokens = run.ok().json()["tokens"]
    assert tokens == expected[: len(tokens)] and len(tokens) >= 32


@needs_compiler
def test_an_attention_scalar_scores_as_transformers_and_exports_back(scaled_attention, tmp_path):
    from transformers import AutoModelForCausalLM

    model = scaled_attention["scalar-48"]
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    record = manas("score", str(text), "-m", model["checkpoint"], *RUN_OPTIONS, "--json").ok().json()
    ids = encode_text(load_checkpoint(model["checkpoint"]).encoding, TEXT)
    with torch.no_grad():
        expected = model["hf"](torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert abs(record["nats_per_token"] - expected) <= 1e-4
    manas("export", model["checkpoint"], "--format", "hf", "--out", tmp_path / "back").ok()
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert back.config.query_pre_attn_scalar == 48
    with torch.no_grad():
        torch.testing.assert_close(back(torch.tensor([ids])).logits, model["hf"](torch.tensor([ids])).logits,
                                   atol=1e-4, rtol=0)  # fmt: skip


def test_an_attention_scalar_llama_cpp_would_not_run_is_refused_by_gguf_export(scaled_attention, tmp_path):
    run = manas("export", scaled_attention["scalar-48"]["checkpoint"], "--format", "gguf", "--out", tmp_path / "m.gguf")
    assert_one_error_line(run, 1, "llama.cpp scales this model's attention by 1/√32, not 1/√48")
    assert not (tmp_path / "m.gguf").exists()


@needs_compiler
def test_llama_cpp_greedy_text_on_a_62_layer_gemma3_gguf_is_manas_generate(scaled_attention):
    assert_llama_simple_writes_manas_text(scaled_attention["27b-layers"])


def test_a_gemma3_gguf_whose_logits_are_capped_is_one_error_line(gemma_4b, tmp_path):
    """llama.cpp caps a gemma3 file's logits where final_logit_softcapping is set (Gemma 2's idea): manas, which does
    not, refuses the file rather than write other text."""
    import numpy as np

    from test_real_models import copy_fields

    source = gguf.GGUFReader(gemma_4b["gguf"])
    path = tmp_path / "capped.gguf"
    writer = gguf.GGUFWriter(path, "gemma3")
    copy_fields(writer, source.fields)
    writer.add_float32("gemma3.final_logit_softcapping", 30.0)
    for tensor in source.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data).reshape([int(n) for n in reversed(tensor.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_one_error_line(manas("generate", "-m", path, "-p", "a", "-n", "1"), 1, "final_logit_softcapping")
