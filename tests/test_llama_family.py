"""Llama-family models (Llama, Qwen2, Mistral) from Hugging Face folders that transformers writes: `manas convert`
reads them (sharded or not, with their byte-level tokenizer.json), both engines compute transformers' logits, and
every option manas does not run, every folder whose parts disagree, is refused with one line naming it."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from conftest import native_model
from manas_cli.formats.checkpoint import load_checkpoint
from manas_cli.formats.convert import convert_checkpoint
from manas_cli.formats.header import open_checkpoint, read_metadata
from manas_cli.formats.huggingface import byte_level_bpe
from manas_cli.formats.tokenizer import build_encoding, encode_text, end_of_text_id
from test_convert import assert_converted, assert_refused, run_manas

torch.set_num_threads(1)

QWEN2_SPLIT = (  # tokenizer.QWEN2_PAT_STR, as Qwen2.5 writes it
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEXTS = [
    "Hello world, the theatre's 12345 seats  678\n\n  tabs\tand émigrés",
    "numbers 2024-12-03:  1 2   3\r\n\r\nend",
    "e\u0301 composed differently from \u00e9, and 'LL 'Ve it",
    "   leading spaces and trailing   ",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tokenizer_json(spec: dict, pre_tokenizer: str, bos: str | None = None) -> str:
    """A byte-level BPE tokenizer.json written by Hugging Face's own `tokenizers`, over the tiny spec's ranks (so its
    merges are a real BPE's), with one of the pre-tokenizers these families use."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    bpe = byte_level_bpe(build_encoding(spec), Path("tiny"))
    merges = [tuple(merge.split(" ")) for merge in bpe.merges]
    tokenizer = Tokenizer(models.BPE(vocab=bpe.tokens, merges=merges))
    tokenizer.pre_tokenizer = {
        "gpt2": pre_tokenizers.ByteLevel(add_prefix_space=False),
        "smollm2": pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        ),
        "qwen2": pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ),
    }[pre_tokenizer]
    if pre_tokenizer == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    if bos is not None:  # Llama 3's way: a template that begins every text with it
        from tokenizers import processors

        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    return tokenizer.to_str()


# The families, as transformers' config classes build them: a few layers of a small width, every option that
# changes the computation set as the real models set it.
SHAPE = dict(
    vocab_size=270,  # the tiny BPE's 267 tokens and SPECIALS: every id decodable, as the CLI samples
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=32.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
FAMILIES = {
    "smollm2": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=100000.0), "smollm2"),
    "tinyllama": ("LlamaConfig", dict(tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5), "gpt2"),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1000000.0), "qwen2"),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None), "gpt2"),
    "head-dim": ("LlamaConfig", dict(head_dim=32, attention_bias=True, mlp_bias=True), "gpt2"),
    # Qwen3: each query and key head RMS-normed, heads wider than hidden_size / heads (Qwen3-0.6B: 16 of 128 in 1,024)
    "qwen3": (
        "Qwen3Config",
        dict(tie_word_embeddings=True, head_dim=32, rope_parameters=dict(rope_theta=1e6)),
        "qwen2",
    ),
    # Llama 3.2's scaled rope as published; and one whose blend reaches the positions a test runs (8,192 does not)
    "llama3.2": ("LlamaConfig", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE), "gpt2"),
    "llama3-scaled": (
        "LlamaConfig",
        dict(rope_parameters=LLAMA3_ROPE | dict(factor=8.0, original_max_position_embeddings=64)),
        "gpt2",
    ),
    # Gemma 3: GeGLU, 1 + w norms, √d embedding, post norms, q/k norms, local layers with a window (8 here; 512 in
    # Gemma 3 270M) and a rope base of their own; heads of 32 in a 64-wide model (270M: 4 of 256 in 640)
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=3,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
        ),
        "gpt2",
    ),
    # Phi-4-mini: fused qkv_proj and gate_up_proj, three quarters of each head turned, LongRoPE's short factors and
    # attention factor (a context of 512 past an original 256); heads of 16 here (Phi-4-mini: 24 of 128)
    "phi4-mini": (
        "Phi3Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            original_max_position_embeddings=256,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=25000.0,
                partial_rotary_factor=0.75,
                short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                long_factor=[1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
                original_max_position_embeddings=256,
            ),
            tie_word_embeddings=False,
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
            sliding_window=None,
        ),
        "gpt2",
    ),
    # SmolLM3: no rope on every fourth layer (layer 3 of 4 here; 9 of SmolLM3-3B's 36), its rope base
    "smollm3": (
        "SmolLM3Config",
        dict(
            num_hidden_layers=4,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_theta=5e6),
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
        ),  # its defaults are ids of its 128k vocabulary
        "gpt2",
    ),
}


def hf_folder(folder: Path, spec: dict, family: str, shard: bool = False, **changes) -> torch.nn.Module:
    """A random model of the family saved as transformers saves it, with a tokenizer.json and generation config."""
    import transformers

    config_class, options, pre_tokenizer = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**SHAPE, **options, **changes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    return saved_random(model, folder, spec, pre_tokenizer, shard)


def saved_random(model: torch.nn.Module, folder: Path, spec: dict, pre_tokenizer: str, shard: bool = False):
    """A model built by transformers, its weights randomized wider than the init's 0.02 (so the logits are far from
    uniform), saved as transformers saves it with a tokenizer.json and a generation config."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            scale = 0.15 if parameter.dim() == 2 else 0.1
            parameter.add_(torch.randn_like(parameter) * scale)
    model.save_pretrained(folder, max_shard_size="200KB" if shard else "5GB")
    (folder / "tokenizer.json").write_text(tokenizer_json(spec, pre_tokenizer))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 269}))  # <|im_end|>
    return model


def converted(tmp_path: Path, folder: Path, through_the_cli: bool = False) -> Path:
    """The folder as a manas checkpoint: by the library's convert_checkpoint in this process (most tests use the
    checkpoint; a `manas convert` process would import torch again for each), or through the real CLI."""
    out = tmp_path / "model.safetensors"
    if through_the_cli:
        assert_converted(run_manas("convert", folder, "--out", out), out)
    else:
        convert_checkpoint(folder, out)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_a_llama_family_folder_converts_and_both_engines_compute_transformers_logits(
    tmp_path, tiny_bpe_spec, native_library, family
):
    hf_model = hf_folder(tmp_path / "hf", tiny_bpe_spec, family, shard=family == "qwen2")
    if family == "qwen2":
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    out = converted(tmp_path, tmp_path / "hf", through_the_cli=True)
    assert read_metadata(out)["format_version"] == "3"
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(ids).logits
    scale = expected.abs().max()
    with torch.no_grad():
        assert ((load_checkpoint(out).model(ids) - expected).abs().max() / scale) <= 1e-4
    native = native_model(open_checkpoint(out), native_library, float_activations=True)
    from conftest import all_logits

    assert ((all_logits(native, ids) - expected).abs().max() / scale) <= 1e-4


@pytest.mark.parametrize("pre_tokenizer", ["gpt2", "smollm2", "qwen2"])
def test_tokenizer_json_splits_as_hugging_faces_tokenizers_does(tmp_path, tiny_bpe_spec, pre_tokenizer):
    """GPT-2's split, SmolLM2's digits before it, Qwen2's own regex with NFC: the ids of Hugging Face's tokenizer."""
    from tokenizers import Tokenizer

    from manas_cli.formats.tokenizer import spec_from_tokenizer_json

    text = tokenizer_json(tiny_bpe_spec, pre_tokenizer)
    encoding = build_encoding(spec_from_tokenizer_json(text, "tokenizer.json"))
    hf = Tokenizer.from_str(text)
    for sample in TEXTS:
        assert encode_text(encoding, sample) == hf.encode(sample, add_special_tokens=False).ids, sample


def test_the_folders_end_of_text_token_ends_generation(tmp_path, tiny_bpe_spec):
    hf_folder(tmp_path / "hf", tiny_bpe_spec, "qwen2")
    checkpoint = load_checkpoint(converted(tmp_path, tmp_path / "hf"))
    assert end_of_text_id(checkpoint.encoding) == 269
    assert checkpoint.tokenizer_spec["end_of_text"] == "<|im_end|>"


def test_a_sentencepiece_style_tokenizer_is_refused_by_name(tmp_path, tiny_bpe_spec):
    hf_folder(tmp_path / "hf", tiny_bpe_spec, "tinyllama")
    tokenizer = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps(tokenizer))
    out = tmp_path / "model.safetensors"
    assert_refused(run_manas("convert", tmp_path / "hf", "--out", out), "SentencePiece-style BPE")
    assert not out.exists()


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def index_of(folder: Path) -> Path:
    return folder / "model.safetensors.index.json"


def missing_shard(folder: Path) -> None:
    next(folder.glob("model-00002-*.safetensors")).unlink()


def shard_outside_the_folder(folder: Path) -> None:
    index = json.loads(index_of(folder).read_text())
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    index_of(folder).write_text(json.dumps(index))


def index_names_a_tensor_no_shard_holds(folder: Path) -> None:
    index = json.loads(index_of(folder).read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = index["weight_map"]["model.norm.weight"]
    index_of(folder).write_text(json.dumps(index))


BAD_FOLDERS = [
    (lambda f: edit_json(f / "config.json", hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (
        lambda f: edit_json(f / "config.json", intermediate_size=128),
        "ffn.gate.weight has shape [160, 64], the config needs [128, 64]",
    ),
    (lambda f: edit_json(f / "config.json", num_hidden_layers=3), "missing tensor for blocks.2"),
    (lambda f: edit_json(f / "config.json", rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope_scaling"),
    (lambda f: edit_json(f / "config.json", model_type="mistral", sliding_window=64), "sliding_window=64"),
    (lambda f: edit_json(f / "config.json", model_type="gemma"), "model_type is 'gemma'"),
    (lambda f: edit_json(f / "config.json", attention_bias=True), "attention_bias=True with mlp_bias=False"),
    (missing_shard, "which is missing from"),
    (shard_outside_the_folder, "'../elsewhere.safetensors', which is not a file in"),
    (index_names_a_tensor_no_shard_holds, "model.layers.9.mlp.up_proj.weight is placed in"),
]


@pytest.mark.parametrize(("damage", "message"), BAD_FOLDERS, ids=[message for _, message in BAD_FOLDERS])
def test_a_folder_whose_parts_disagree_is_refused_naming_the_file_and_field(tmp_path, tiny_bpe_spec, damage, message):
    folder = tmp_path / "hf"
    hf_folder(folder, tiny_bpe_spec, "smollm2", shard=True)
    damage(folder)
    out = tmp_path / "model.safetensors"
    assert_refused(run_manas("convert", folder, "--out", out), message)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_llama_family_weights_never_come_from_a_pickle(tmp_path, tiny_bpe_spec):
    folder = tmp_path / "hf"
    hf_folder(folder, tiny_bpe_spec, "smollm2")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    assert_refused(run_manas("convert", folder, "--out", tmp_path / "m.safetensors"), "a pickle is never read")


# ---- the window: --ctx, crop-and-recompute past it -------------------------------------------------------------------

CTX = 16
PROMPT = "the theatre in the city"
SAMPLERS = {"greedy": ("-t", "0"), "seeded": ("-t", "0.9", "--top-k", "40", "--seed", "7")}


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory, tiny_bpe_spec) -> dict[str, Path]:
    """A SmolLM2-shaped folder converted, and its int8 and int4 copies (`manas quantize`)."""
    folder = tmp_path_factory.mktemp("llama")
    hf_folder(folder / "hf", tiny_bpe_spec, "smollm2")
    files = {"float32": converted(folder, folder / "hf")}
    for bits, name in ((8, "int8"), (4, "int4")):
        files[name] = folder / f"{name}.safetensors"
        assert_converted(
            run_manas("quantize", files["float32"], "--bits", str(bits), "--out", files[name]), files[name]
        )
    return files


def crop_and_recompute(path: Path, engine: str, prompt: str, tokens: int, seed: int | None, **sampling) -> list[int]:
    """nanoGPT's generate with the window cut to CTX: the whole model over the last CTX tokens at every step."""
    from manas_cli.engine.generation import generate_reference
    from manas_cli.engine.sampling import Sampler
    from manas_cli.models import ModelOptions, open_model

    loaded = open_model(ModelOptions(checkpoint=path, engine=engine, ctx=CTX, threads=1))
    runner, eot = loaded.engine, end_of_text_id(loaded.checkpoint.encoding)
    assert runner.config.block_size == CTX
    sampler = Sampler(generator=runner.generator(seed) if seed is not None else None, seed=seed or 0, **sampling)
    ids = encode_text(loaded.checkpoint.encoding, prompt)
    out = []
    for step in generate_reference(runner, [ids], sampler, tokens, eot):
        if step.tokens[0] == eot:
            break
        out.append(step.tokens[0])
    return out


# Each engine and weight type is its own path through the re-prefill; the sampler is not part of it (it reads the
# logits, whichever way the window was computed), so the seeded sampler runs on every path and greedy on each engine.
PAST_THE_WINDOW = [(e, w, "seeded") for e in ("native", "torch") for w in ("float32", "int8", "int4")]
PAST_THE_WINDOW += [(e, "float32", "greedy") for e in ("native", "torch")]


@pytest.mark.parametrize("engine, weights, sampler", PAST_THE_WINDOW)
def test_generation_past_a_ctx_window_equals_crop_and_recompute(llama_files, native_library, engine, weights, sampler):
    path = llama_files[weights]
    flags = SAMPLERS[sampler]
    env = {} if engine == "native" else {"MANAS_ENGINE": "torch"}
    run = run_manas("generate", "-c", path, "-p", PROMPT, "-n", "48", "--ctx", str(CTX), *flags, "--json", env=env)
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout)
    assert record["engine"] == engine and record["re_prefills"] > 0
    settings = {"temperature": 0.0} if sampler == "greedy" else {"temperature": 0.9, "top_k": 40}
    seed = 7 if sampler == "seeded" else None
    assert record["tokens"] == crop_and_recompute(path, engine, PROMPT, 48, seed, **settings)


def test_greedy_past_the_window_is_transformers_own_crop_and_recompute(tmp_path, tiny_bpe_spec):
    """An independent reference: transformers' model over the last CTX tokens, step after step."""
    hf_model = hf_folder(tmp_path / "hf", tiny_bpe_spec, "qwen2")
    out = converted(tmp_path, tmp_path / "hf")
    run = run_manas("generate", "-c", out, "-p", PROMPT, "-n", "40", "--ctx", str(CTX), "-t", "0", "--json")
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout)
    ids = encode_text(load_checkpoint(out).encoding, PROMPT)
    expected = []
    with torch.no_grad():
        for _ in range(len(record["tokens"])):
            token = hf_model(torch.tensor([ids[-CTX:]])).logits[0, -1].argmax().item()
            ids.append(token)
            expected.append(token)
    assert record["tokens"] == expected


def test_ctx_comes_from_the_environment_and_never_exceeds_the_models_window(llama_files):
    path = llama_files["float32"]
    run = run_manas("inspect-cache", "-c", path, "-p", PROMPT, "--json", env={"MANAS_CTX": "100000"})
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["block_size"] == SHAPE["max_position_embeddings"]  # capped at the model's
    run = run_manas("inspect-cache", "-c", path, "-p", PROMPT, "--json", env={"MANAS_CTX": "16"})
    assert json.loads(run.stdout)["block_size"] == 16
    run = run_manas("generate", "-c", path, "-p", PROMPT, "-n", "30", "-t", "0", "--json", env={"MANAS_CTX": "8"})
    assert json.loads(run.stdout)["re_prefills"] > 0
    bad = run_manas("generate", "-c", path, "-p", PROMPT, "--ctx", "0")
    assert bad.returncode == 2 and "--ctx" in bad.stderr


# ---- export back: Hugging Face and GGUF ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["tinyllama", "qwen2", "smollm2", "head-dim"])
def test_export_hf_gives_transformers_the_same_model_and_tokenizer(tmp_path, tiny_bpe_spec, family):
    """Llama or Qwen2 as they came; a tokenizer of GPT-2's split as vocab.json and merges.txt, SmolLM2's digits and
    Qwen2's regex (with NFC) as a tokenizer.json that Hugging Face's fast tokenizer runs to the same ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model = hf_folder(tmp_path / "hf", tiny_bpe_spec, family)
    out = converted(tmp_path, tmp_path / "hf")
    result = run_manas("export", out, "--format", "hf", "--out", tmp_path / "back")
    assert result.returncode == 0, result.stderr
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(hf_model)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf_model(ids).logits, atol=1e-4, rtol=0)
    tokenizer, encoding = AutoTokenizer.from_pretrained(tmp_path / "back"), load_checkpoint(out).encoding
    for sample in TEXTS:
        assert tokenizer(sample, add_special_tokens=False)["input_ids"] == encode_text(encoding, sample), sample
    assert (tmp_path / "back" / "tokenizer.json").exists() == (family in ("qwen2", "smollm2"))


@pytest.mark.parametrize("family, architecture, pre", [("tinyllama", "llama", "gpt-2"), ("qwen2", "qwen2", "qwen2")])
def test_export_gguf_writes_llama_cpps_llama_and_qwen2(tmp_path, tiny_bpe_spec, family, architecture, pre):
    """llama.cpp's llama rotates interleaved pairs (manas' layout: Hugging Face's q and k permuted back, as
    convert_hf_to_gguf.py does), its qwen2 the halves (Hugging Face's, as it is)."""
    gguf = pytest.importorskip("gguf")
    from manas_cli.formats.rotary_layout import from_rotate_half

    hf_model = hf_folder(tmp_path / "hf", tiny_bpe_spec, family)
    out = converted(tmp_path, tmp_path / "hf")
    result = run_manas("export", out, "--format", "gguf", "--outtype", "f32", "--out", tmp_path / "m.gguf")
    assert result.returncode == 0, result.stderr
    reader = gguf.GGUFReader(tmp_path / "m.gguf")

    def field(name: str):
        value = reader.fields[name]
        return value.contents() if hasattr(value, "contents") else value.parts[value.data[0]].tolist()

    assert field("general.architecture") == architecture
    assert field(f"{architecture}.feed_forward_length") == SHAPE["intermediate_size"]
    assert field(f"{architecture}.attention.layer_norm_rms_epsilon") == pytest.approx(hf_model.config.rms_norm_eps)
    assert field("tokenizer.ggml.pre") == pre
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    q = hf_model.model.layers[0].self_attn.q_proj.weight.detach()
    expected = from_rotate_half(q, SHAPE["num_attention_heads"]) if architecture == "llama" else q
    assert torch.equal(tensors["blk.0.attn_q.weight"].reshape(q.shape), expected)
    assert ("output.weight" in tensors) == (not hf_model.config.tie_word_embeddings)


def test_a_tokenizer_that_begins_every_prompt_with_a_bos_keeps_doing_so_in_manas_and_its_exports(
    tmp_path, tiny_bpe_spec
):
    """Llama 3's tokenizer.json adds <|begin_of_text|> by a template: manas prepends it to every prompt, and the
    Hugging Face and GGUF exports say so."""
    from transformers import AutoTokenizer

    from manas_cli.requests import encode_prompt

    hf_folder(tmp_path / "hf", tiny_bpe_spec, "tinyllama")
    (tmp_path / "hf" / "tokenizer.json").write_text(tokenizer_json(tiny_bpe_spec, "qwen2", bos="<|im_start|>"))
    out = converted(tmp_path, tmp_path / "hf")
    checkpoint = load_checkpoint(out)
    assert checkpoint.tokenizer_spec["bos"] == "<|im_start|>"
    ids = encode_prompt(checkpoint, TEXTS[0])
    assert ids[0] == 268 and ids[1:] == encode_text(checkpoint.encoding, TEXTS[0])
    assert run_manas("export", out, "--format", "hf", "--out", tmp_path / "back").returncode == 0
    assert AutoTokenizer.from_pretrained(tmp_path / "back")(TEXTS[0])["input_ids"] == ids
    gguf = pytest.importorskip("gguf")
    assert run_manas("export", out, "--format", "gguf", "--out", tmp_path / "m.gguf").returncode == 0
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    assert fields["tokenizer.ggml.add_bos_token"].contents() is True
    assert fields["tokenizer.ggml.bos_token_id"].contents() == 268


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_folders_chat_template_is_kept_and_renders_the_ids_transformers_gives(tmp_path, tiny_bpe_spec):
    """Qwen2.5-Instruct's way: tokenizer_config.json's chat_template, stored in the checkpoint; the messages' ids are
    transformers' apply_chat_template's (its special tokens as themselves), and serve answers chat with it."""
    pytest.importorskip("jinja2")
    from transformers import AutoTokenizer

    from manas_cli.chat import parse_messages, render_prompt

    hf_folder(tmp_path / "hf", tiny_bpe_spec, "qwen2")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    out = converted(tmp_path, tmp_path / "hf")
    checkpoint = load_checkpoint(out)
    assert checkpoint.metadata["chat_template"] == CHATML
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[2]}]
    expected = AutoTokenizer.from_pretrained(tmp_path / "hf").apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert render_prompt(CHATML, parse_messages(messages), checkpoint.encoding).ids == expected
    assert expected.count(268) == 3  # <|im_start|>, one id each time
