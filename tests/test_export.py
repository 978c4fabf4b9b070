"""`manas export --format hf`: a Hugging Face GPT-2 folder that transformers loads offline and that computes, encodes
and generates exactly as the manas checkpoint does; what has no exact GPT-2 equivalent is refused."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # every load below must come from the exported folder alone

import pytest
import torch

from conftest import engine_of, make_model
from manas_cli.engine.generation import generate
from manas_cli.engine.sampling import Sampler
from manas_cli.formats.checkpoint import load_checkpoint, save_checkpoint
from manas_cli.formats.nanogpt import character_spec
from manas_cli.formats.tokenizer import bpe_spec, build_encoding, spec_from_tiktoken_file
from test_convert import GPT2_RANKS, VARIED_TEXT, assert_refused, run_manas

torch.set_num_threads(1)

HF_FILES = [
    "config.json",
    "generation_config.json",
    "merges.txt",
    "model.safetensors",
    "tokenizer_config.json",
    "vocab.json",
]
# The sha256 that tiktoken pins for OpenAI's original GPT-2 files (tiktoken_ext/openai_public.py).
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_FILE_URLS = {  # where tiktoken's named gpt2 encoding reads them from, and so what its cache is keyed by
    "merges.txt": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "vocab.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
}


@pytest.fixture(scope="module")
def gpt2_spec() -> dict:
    return spec_from_tiktoken_file(GPT2_RANKS)


@pytest.fixture(scope="module")
def gpt2_export(tmp_path_factory, gpt2_spec) -> tuple[Path, Path]:
    """(checkpoint, exported folder) of a tiny model that speaks GPT-2's tokenizer."""
    folder = tmp_path_factory.mktemp("gpt2")
    checkpoint = folder / "tiny-gpt2.safetensors"
    save_checkpoint(checkpoint, make_model(vocab_size=50257, block_size=96), gpt2_spec)
    result = run_manas("export", checkpoint, "--format", "hf", "--out", folder / "hf")
    assert result.returncode == 0, result.stderr
    return checkpoint, folder / "hf"


def export_round_trip(tmp_path: Path, model, spec: dict):
    """Save a manas checkpoint, export it through the CLI, load it back with transformers' Auto classes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    save_checkpoint(tmp_path / "model.safetensors", model, spec)
    result = run_manas("export", tmp_path / "model.safetensors", "--format", "hf", "--out", tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == HF_FILES
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left
    checkpoint = load_checkpoint(tmp_path / "model.safetensors")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    return checkpoint, hf_model, AutoTokenizer.from_pretrained(tmp_path / "hf")


@pytest.mark.parametrize(
    "overrides", [{}, {"bias": False, "gelu_approximate": "none"}], ids=["gpt2-like", "no-bias-exact-gelu"]
)
def test_export_loads_in_transformers_with_identical_logits_and_greedy_text(tmp_path, tiny_bpe_spec, overrides):
    vocab_size = build_encoding(tiny_bpe_spec).n_vocab  # every id the model can pick decodes
    model = make_model(vocab_size=vocab_size, block_size=96, **overrides)
    checkpoint, hf_model, hf_tokenizer = export_round_trip(tmp_path, model, tiny_bpe_spec)
    model, encoding = checkpoint.model, checkpoint.encoding

    ids = torch.randint(0, model.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, model(ids), atol=1e-5, rtol=0)

    prompt_text = "the weather in the €uro zone"
    prompt_ids = encoding.encode_ordinary(prompt_text)
    assert hf_tokenizer(prompt_text)["input_ids"] == prompt_ids
    prompt = torch.tensor([prompt_ids])
    eot = hf_tokenizer.eos_token_id
    manas_ids = [s.tokens[0] for s in generate(engine_of(model), prompt, Sampler(temperature=0.0), 64, eot_id=eot)]
    with torch.no_grad():
        hf_ids = hf_model.generate(prompt, do_sample=False, max_new_tokens=64, pad_token_id=eot)[0, len(prompt_ids) :]
    assert hf_ids.tolist() == manas_ids
    assert hf_tokenizer.decode(hf_ids) == encoding.decode(manas_ids)


def test_gpt2_config_names_the_context_length_n_ctx_too_as_llama_cpps_converter_reads_it(gpt2_export):
    config = json.loads((gpt2_export[1] / "config.json").read_text())
    assert config["model_type"] == "gpt2"
    assert config["n_ctx"] == config["n_positions"] == 96


def test_exported_gpt2_tokenizer_is_openais_original_and_encodes_like_tiktoken(gpt2_export, gpt2_spec, shakespeare):
    from transformers import AutoTokenizer

    _, folder = gpt2_export
    # merges derived from the ranks in rank order rebuild GPT-2's published files byte for byte
    assert hashlib.sha256((folder / "merges.txt").read_bytes()).hexdigest() == GPT2_VOCAB_BPE_SHA256
    assert hashlib.sha256((folder / "vocab.json").read_bytes()).hexdigest() == GPT2_ENCODER_JSON_SHA256

    tokenizer, encoding = AutoTokenizer.from_pretrained(folder), build_encoding(gpt2_spec)
    for text in (VARIED_TEXT, shakespeare[:20_000]):
        ids = encoding.encode_ordinary(text)
        assert tokenizer(text)["input_ids"] == ids
        assert tokenizer.decode(ids) == text
    assert tokenizer("Hello world")["input_ids"] == [15496, 995]
    assert tokenizer.eos_token_id == 50256
    config = json.loads((folder / "generation_config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == 50256


def test_convert_records_tiktokens_named_gpt2_encoding_when_it_is_cached(tmp_path, gpt2_export, monkeypatch):
    """tiktoken caches its downloads by the sha1 of their URL; with GPT-2's files there (here: the export's, which
    are OpenAI's originals), convert of a folder without its own tokenizer files needs no --tokenizer-file and
    records the named encoding. The round trip export → convert gives back the same weights, and the named encoding
    exports as the embedded one did."""
    checkpoint, exported = gpt2_export
    folder = tmp_path / "weights-only"  # config and weights, no vocab.json or merges.txt
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((exported / name).read_bytes())
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    for name, url in GPT2_FILE_URLS.items():
        (cache / hashlib.sha1(url.encode()).hexdigest()).write_bytes((exported / name).read_bytes())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))  # here and in the CLI's subprocesses
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # a port that refuses: no download can stand in
    monkeypatch.setenv("NO_PROXY", "")

    result = run_manas("convert", folder, "--out", tmp_path / "back.safetensors")
    assert result.returncode == 0, result.stderr
    back, original = load_checkpoint(tmp_path / "back.safetensors"), load_checkpoint(checkpoint)
    assert back.tokenizer_spec == {"kind": "tiktoken", "encoding": "gpt2"}
    for (name, tensor), (other_name, other) in zip(
        back.model.state_dict().items(), original.model.state_dict().items()
    ):
        assert name == other_name and torch.equal(tensor, other)

    result = run_manas("export", tmp_path / "back.safetensors", "--out", tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    for name in ("vocab.json", "merges.txt", "model.safetensors"):
        assert (tmp_path / "hf" / name).read_bytes() == (exported / name).read_bytes()


def shakespeare_character_spec(text: str) -> dict:
    chars = sorted(set(text))
    return character_spec(
        {"stoi": {c: i for i, c in enumerate(chars)}, "itos": dict(enumerate(chars))}, Path("meta.pkl")
    )


def test_character_level_model_exports_with_a_tokenizer_that_encodes_each_character(tmp_path, shakespeare):
    text = shakespeare[:5000]  # plain ASCII, as nanoGPT's shakespeare_char
    spec = shakespeare_character_spec(text)
    vocab_size = build_encoding(spec).n_vocab
    checkpoint, hf_model, tokenizer = export_round_trip(
        tmp_path, make_model(vocab_size=vocab_size, block_size=64), spec
    )

    ids = checkpoint.encoding.encode_ordinary(text)
    assert len(ids) == len(text)
    assert tokenizer(text)["input_ids"] == ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id is None and len(tokenizer) == vocab_size  # no invented <|endoftext|>
    with torch.no_grad():
        window = torch.tensor([ids[:64]])
        torch.testing.assert_close(hf_model(window).logits, checkpoint.model(window), atol=1e-5, rtol=0)


def test_force_overwrites_our_files_and_removes_ones_that_would_shadow_them(tmp_path, gpt2_export):
    checkpoint, folder = gpt2_export
    out = tmp_path / "hf"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")  # transformers would prefer it to vocab.json + merges.txt
    (out / "config.json").write_text("{}")
    (out / "README.md").write_text("my notes")

    assert_refused(run_manas("export", checkpoint, "--out", out), "is not empty: pass --force")
    result = run_manas("export", checkpoint, "--out", out, "--force")

    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted([*HF_FILES, "README.md"])
    assert (out / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    assert (out / "README.md").read_text() == "my notes"


# ---- refusals ---------------------------------------------------------------------------------------------------


def byte_ranks() -> dict[bytes, int]:
    return {bytes([i]): i for i in range(256)}


REFUSALS = {
    "rope-with-exact-gelu": (
        lambda: (make_model("rope", gelu_approximate="none"), bpe_spec(byte_ranks())),
        "Starcoder2's MLP computes GELU's tanh approximation",
    ),
    "grouped-query-with-learned-positions": (
        lambda: (make_model("learned", "gqa"), bpe_spec(byte_ranks())),
        "grouped-query attention (n_kv_head=2 < n_head=4) with learned positions has no exact equivalent",
    ),
    "token-that-no-merge-builds": (
        lambda: (make_model(), bpe_spec(byte_ranks() | {b"abc": 256})),
        "token b'abc' (id 256) is not the merge of two earlier tokens",
    ),
    "multi-byte-characters-of-a-character-vocabulary": (
        lambda: (make_model(), shakespeare_character_spec("café au lait")),
        "token b'\\xc3\\xa9' (id 8) is not the merge of two earlier tokens",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_export_refuses_what_gpt2_cannot_compute_or_encode_exactly(tmp_path, case):
    build, message = REFUSALS[case]
    save_checkpoint(tmp_path / "model.safetensors", *build())

    assert_refused(
        run_manas("export", tmp_path / "model.safetensors", "--format", "hf", "--out", tmp_path / "hf"), message
    )

    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # nothing written, no staging left


def test_export_refuses_an_out_path_that_is_a_file(tmp_path, gpt2_export):
    (tmp_path / "hf").write_text("not a folder")
    assert_refused(run_manas("export", gpt2_export[0], "--out", tmp_path / "hf"), "is a file: name a folder")


def test_export_of_a_file_that_is_not_a_manas_checkpoint_points_to_convert(tmp_path, gpt2_export):
    _, folder = gpt2_export
    result = run_manas("export", folder / "model.safetensors", "--out", tmp_path / "hf")
    assert_refused(result, "not a manas checkpoint")
    assert "manas convert" in result.stderr


# ---- any split pattern exports ----

SPLIT_TEXTS = ["Hello world! It's 2024-12-06: 12345 numbers,\n\n  spaces   and 'LL 'Ve it", "日本語のテキスト 🎉 café"]


@pytest.mark.parametrize("pattern", ["llama3", "whitespace"])
def test_a_tokenizer_of_any_split_pattern_exports_to_the_same_ids(tmp_path, pattern):
    """Llama 3's split (llama.cpp's llama-bpe) and another regex: the Hugging Face export's tokenizer.json splits by
    it and gives manas' ids; Llama 3's goes to GGUF as llama-bpe, which manas reads back to the same ids."""
    from transformers import AutoTokenizer

    from manas_cli.formats.tokenizer import LLAMA3_PAT_STR, encode_text

    ranks = byte_ranks() | {b"th": 256, b"the": 257, b" t": 258, b" the": 259, b"in": 260, b"12": 261, b"123": 262}
    spec = bpe_spec(ranks, pat_str=LLAMA3_PAT_STR if pattern == "llama3" else r"\S+|\s+")
    save_checkpoint(tmp_path / "model.safetensors", make_model("rope"), spec)
    assert (
        run_manas("export", tmp_path / "model.safetensors", "--format", "hf", "--out", tmp_path / "hf").returncode == 0
    )
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    encoding = build_encoding(spec)
    for text in SPLIT_TEXTS:
        assert exported(text, add_special_tokens=False)["input_ids"] == encode_text(encoding, text)
    if pattern == "llama3":
        gguf = pytest.importorskip("gguf")
        done = run_manas("export", tmp_path / "model.safetensors", "--format", "gguf", "--out", tmp_path / "m.gguf")
        assert done.returncode == 0, done.stderr
        assert gguf.GGUFReader(tmp_path / "m.gguf").fields["tokenizer.ggml.pre"].contents() == "llama-bpe"
        for text in SPLIT_TEXTS:
            back = run_manas("tokenize", "-c", tmp_path / "m.gguf", "--no-special", text)
            assert [int(i) for i in back.stdout.split()] == encode_text(encoding, text)
