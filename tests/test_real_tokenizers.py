"""Real tokenizers (issue 57): SmolLM2-135M-Instruct's published vocabulary, which has no token for 21 of the 256
bytes (Hugging Face's tokenizer drops such a byte), converts, and manas encodes every text to the ids Hugging
Face's `tokenizers` gives, through `manas tokenize` and through a converted model's prompts and chat template;
greedy generation on a model with that vocabulary equals transformers'."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cli_fixtures import DATA, RUN_OPTIONS, manas

tokenizers = pytest.importorskip("tokenizers")

SMOLLM2 = DATA / "smollm2"  # data/SOURCES.md
MISSING_BYTES = [4, 6, 19, 20, 22, 29, 192, 193, 241, 242, *range(245, 256)]
# Every kind of text: scripts, combining marks, emoji sequences, digits, whitespace runs, and the characters whose
# bytes SmolLM2 has no token for (control characters; U+40000 and U+80000 begin with the bytes F1 and F2).
MULTILINGUAL = (
    "Hello, world! 日本語のテキスト、中文字符、한국어 텍스트; مرحبا بالعالم — שלום עולם; नमस्ते; ελληνικά; кириллица.\n"
    "café naïve e\u0301 Ångström 👨‍👩‍👧‍👦 🏳️‍🌈 👍🏽 🎉 12345 3.14159 2024-12-06\n"
    "\x04\x06\x13\x14\x16\x1d control \x00\x01\x1b[31mred\x1b[0m\x7f \U00040000 \U00080001 x\n\n\t  trailing   \r\n"
)


def texts() -> dict[str, str]:
    return {
        "shakespeare": (DATA / "tinyshakespeare-head.txt").read_text(encoding="utf-8"),
        "multilingual": MULTILINGUAL,
    }


def reference_ids(text: str) -> list[int]:
    tokenizer = tokenizers.Tokenizer.from_file(str(SMOLLM2 / "tokenizer.json"))
    return tokenizer.encode(text, add_special_tokens=False).ids


def smollm2_folder(folder: Path, spec: dict) -> None:
    """A SmolLM2-shaped random model as transformers saves it, with SmolLM2's real tokenizer and chat template."""
    from test_llama_family import hf_folder

    hf_folder(folder, spec, "smollm2", vocab_size=49152)
    shutil.copyfile(SMOLLM2 / "tokenizer.json", folder / "tokenizer.json")
    shutil.copyfile(SMOLLM2 / "tokenizer_config.json", folder / "tokenizer_config.json")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))  # <|im_end|>


def test_the_vocabulary_lacks_the_bytes_the_data_notes_say():
    vocab = json.loads((SMOLLM2 / "tokenizer.json").read_text())["model"]["vocab"]
    from manas_cli.formats.tokenizer import bytes_to_unicode

    assert [byte for byte, alias in bytes_to_unicode().items() if alias not in vocab] == MISSING_BYTES


@pytest.mark.parametrize("name", ["shakespeare", "multilingual"])
def test_tokenize_gives_hugging_faces_ids_from_the_tokenizer_json_and_the_converted_model(smollm2, name):
    text = texts()[name]
    expected = reference_ids(text)
    for source in (SMOLLM2 / "tokenizer.json", smollm2[1]):
        run = manas("tokenize", "-c", source, "--no-special", stdin=text.encode())
        assert [int(token) for token in run.ok().out.split()] == expected


def test_special_tokens_in_a_text_are_parsed_as_hugging_face_parses_them(smollm2):
    text = "<|im_start|>user\nHi \x04 there<|im_end|>\n"
    tokenizer = tokenizers.Tokenizer.from_file(str(SMOLLM2 / "tokenizer.json"))
    record = manas("tokenize", "-c", smollm2[1], text, "--json").ok().json()
    assert record["ids"] == tokenizer.encode(text, add_special_tokens=False).ids
    assert record["pieces"][0] == "<|im_start|>" and "".join(record["pieces"]) == text.replace("\x04", "")


def test_greedy_generation_on_the_real_vocabulary_equals_transformers(smollm2):
    import torch
    from transformers import AutoModelForCausalLM

    folder, model = smollm2
    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    for prompt in ("The capital of France is", "日本語 12 \x04 café"):
        ids = reference_ids(prompt)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=2)
        expected = out[0, len(ids) :].tolist()
        expected = expected[: expected.index(2)] if 2 in expected else expected
        done = manas("generate", "-c", model, *RUN_OPTIONS, "-p", prompt, "-n", "12", "-t", "0", "--json").ok()
        assert done.json()["prompt_tokens"] == len(ids) and done.json()["tokens"] == expected


def test_the_real_chat_template_renders_the_ids_transformers_gives(smollm2):
    pytest.importorskip("jinja2")
    from transformers import AutoTokenizer

    from manas_cli.chat import parse_messages, render_prompt
    from manas_cli.formats.checkpoint import load_checkpoint

    folder, model = smollm2
    checkpoint = load_checkpoint(model)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": MULTILINGUAL}]
    expected = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    template = checkpoint.metadata["chat_template"]
    assert render_prompt(template, parse_messages(messages), checkpoint.encoding).ids == expected


# ---- llama.cpp's own fixtures: its vocabularies, inputs and the ids it gives ----

LLAMA_CPP_VOCAB = DATA / "llamacpp" / "vocab"
SEPARATOR = "\n__ggml_vocab_test__\n"  # between cases in an .inp file (llama.cpp's tests/test-tokenizer-0)


@pytest.mark.parametrize("name", ["gpt-2", "llama-bpe", "qwen2"])
def test_tokenize_gives_llama_cpps_ids_on_its_own_fixtures(name):
    """test-tokenizer-0's settings: no BOS, special-token text as plain text."""
    pytest.importorskip("gguf")
    vocabulary = LLAMA_CPP_VOCAB / f"ggml-vocab-{name}.gguf"
    cases = vocabulary.with_suffix(".gguf.inp").read_text(encoding="utf-8").split(SEPARATOR)[:-1]
    expected = vocabulary.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")[: len(cases)]
    stdin = "".join(json.dumps(case) + "\n" for case in cases).encode()
    run = manas("tokenize", "-c", vocabulary, "--jsonl", "--no-special", stdin=stdin).ok()
    assert len(cases) == 46 and run.out.split("\n")[:-1] == [line.strip() for line in expected]


def test_a_vocabulary_manas_cannot_read_is_one_error_line_naming_it(tmp_path):
    """BERT's WordPiece (tokenizer.ggml.model 'bert') is not read: a GGUF of one says so, as does a file that is no
    GGUF."""
    pytest.importorskip("gguf")
    import gguf

    writer = gguf.GGUFWriter(tmp_path / "bert.gguf", "bert")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[PAD]", "[UNK]", "[CLS]"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + bytes(10))
    (tmp_path / "cut.gguf").write_bytes((LLAMA_CPP_VOCAB / "ggml-vocab-gpt-2.gguf").read_bytes()[:100_000])
    cases = ((tmp_path / "bert.gguf", "tokenizer.ggml.model 'bert' is not one manas reads"),
             (tmp_path / "broken.gguf", "GGUF version 0 is not one manas reads"),
             (tmp_path / "cut.gguf", "it ends inside its metadata"))  # fmt: skip
    for path, message in cases:
        run = manas("tokenize", "-c", path, "x")
        assert run.returncode == 1 and run.err.startswith("error: ") and message in run.err, run.err
        assert len(run.err.strip().splitlines()) == 1


# ---- exports keep the chat format ----


def test_an_exported_instruct_model_chats_in_its_own_format_in_transformers(smollm2, tmp_path):
    """The Hugging Face export of a model with SmolLM2's real tokenizer and template: transformers renders the
    messages to manas' ids, stops where manas stops (<|im_end|>, not <|endoftext|>), and answers as `manas chat`."""
    pytest.importorskip("jinja2")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, model = smollm2
    manas("export", model, "--format", "hf", "--out", tmp_path / "hf").ok()
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == 2
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids["input_ids"]]), max_new_tokens=10, do_sample=False)
    answer = out[0, len(ids["input_ids"]) :].tolist()
    answer = answer[: answer.index(2)] if 2 in answer else answer
    chat = manas("chat", "-c", model, *RUN_OPTIONS, "-n", "10", "-t", "0", "--json",
                 stdin=(messages[0]["content"] + "\n").encode()).ok().json()  # fmt: skip
    assert chat["prompt_tokens"] == len(ids["input_ids"]) and chat["tokens"] == answer


def test_an_exported_gguf_carries_the_chat_template_and_the_models_end(smollm2, tmp_path):
    gguf = pytest.importorskip("gguf")
    from manas_cli.formats.checkpoint import load_checkpoint

    _, model = smollm2
    manas("export", model, "--format", "gguf", "--out", tmp_path / "m.gguf").ok()
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    assert fields["tokenizer.chat_template"].contents() == load_checkpoint(model).metadata["chat_template"]
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 2
    back = manas("tokenize", "-c", tmp_path / "m.gguf", "--no-special", stdin=MULTILINGUAL.encode()).ok()
    assert [int(token) for token in back.out.split()] == reference_ids(MULTILINGUAL)


# ---- SentencePiece: Llama 2's vocabulary ----


def test_tokenize_gives_llama_cpps_ids_for_llama_2s_sentencepiece_vocabulary():
    """llama.cpp's llama-spm fixture (Llama 2's pieces, scores and byte fallback), every case."""
    pytest.importorskip("gguf")
    vocabulary = LLAMA_CPP_VOCAB / "ggml-vocab-llama-spm.gguf"
    cases = vocabulary.with_suffix(".gguf.inp").read_text(encoding="utf-8").split(SEPARATOR)[:-1]
    expected = vocabulary.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")[: len(cases)]
    stdin = "".join(json.dumps(case) + "\n" for case in cases).encode()
    run = manas("tokenize", "-c", vocabulary, "--jsonl", "--no-special", stdin=stdin).ok()
    assert len(cases) == 46 and run.out.split("\n")[:-1] == [line.strip() for line in expected]


def test_a_llama_2_shaped_gguf_with_a_sentencepiece_vocabulary_converts_and_generates(tmp_path, tiny_bpe_spec):
    """A Llama-architecture GGUF carrying Llama 2's vocabulary: converted, its prompts are llama.cpp's ids (as
    `manas tokenize` gives them, with the BOS it adds), and it generates, its text what its tokens spell."""
    gguf = pytest.importorskip("gguf")
    from test_llama_family import converted, hf_folder
    from test_real_models import copy_fields

    hf_folder(tmp_path / "hf", tiny_bpe_spec, "tinyllama", vocab_size=32000)
    manas("export", converted(tmp_path, tmp_path / "hf"), "--format", "gguf", "--outtype", "f32", "--out",
          tmp_path / "bpe.gguf").ok()  # fmt: skip
    vocabulary = gguf.GGUFReader(LLAMA_CPP_VOCAB / "ggml-vocab-llama-spm.gguf").fields
    model = gguf.GGUFReader(tmp_path / "bpe.gguf")
    writer = gguf.GGUFWriter(tmp_path / "spm.gguf", "llama")
    copy_fields(writer, {k: f for k, f in model.fields.items() if not k.startswith("tokenizer.")})
    copy_fields(writer, {k: f for k, f in vocabulary.items() if k.startswith("tokenizer.")})
    for tensor in model.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    manas("convert", tmp_path / "spm.gguf", "--out", tmp_path / "spm.safetensors").ok()
    prompt = "Hello world, 日本語 🎉"
    ids = manas("tokenize", "-c", tmp_path / "spm.safetensors", prompt).ok().out.split()
    assert ids == manas("tokenize", "-c", LLAMA_CPP_VOCAB / "ggml-vocab-llama-spm.gguf", prompt).ok().out.split()
    done = manas("generate", "-c", tmp_path / "spm.safetensors", *RUN_OPTIONS, "-p", prompt, "-n", "8", "-t", "0",
                 "--json").ok().json()  # fmt: skip
    assert done["prompt_tokens"] == len(ids) + 1  # Llama 2's <s> first (tokenizer.ggml.add_bos_token)
    pieces = manas("tokenize", "-c", LLAMA_CPP_VOCAB / "ggml-vocab-llama-spm.gguf", "--json", "x").ok().json()
    assert pieces["pieces"] == [" x"] and len(done["tokens"]) == done["generated_tokens"]


# ---- SentencePiece tokenizer.model files: Mistral's, against sentencepiece itself ----

MISTRAL = DATA / "mistral"  # data/SOURCES.md


@pytest.mark.parametrize("version", ["v1", "v3"])
@pytest.mark.parametrize("name", ["shakespeare", "multilingual"])
def test_tokenize_gives_sentencepieces_ids_for_mistrals_tokenizer_models(version, name):
    """v3 has user-defined pieces ([INST], [/INST]), taken whole from the text as sentencepiece takes them."""
    sentencepiece = pytest.importorskip("sentencepiece")
    model = MISTRAL / f"tokenizer.model.{version}"
    text = texts()[name] + (" [INST] What? [/INST]" if name == "multilingual" else "")
    expected = sentencepiece.SentencePieceProcessor(model_file=str(model)).encode(text)
    run = manas("tokenize", "-c", model, "--no-special", stdin=text.encode())
    assert [int(token) for token in run.ok().out.split()] == expected


@pytest.mark.parametrize("tokenizer_file", ["tokenizer.model", "tokenizer.json"])
def test_a_llama_2_style_folder_converts_with_its_tokenizer_model_and_generates_as_transformers(
    tmp_path, tiny_bpe_spec, tokenizer_file
):
    """A TinyLlama-shaped folder whose tokenizer is a SentencePiece tokenizer.model (Mistral's, 32,000 pieces), or
    only its Hugging Face rendering as a tokenizer.json: the prompt is <s> and sentencepiece's ids, and greedy
    generation equals transformers' on them."""
    sentencepiece = pytest.importorskip("sentencepiece")
    import torch
    from transformers import AutoModelForCausalLM

    from test_llama_family import converted, hf_folder

    hf_folder(tmp_path / "hf", tiny_bpe_spec, "tinyllama", vocab_size=32000)
    (tmp_path / "hf" / "tokenizer.json").unlink()
    if tokenizer_file == "tokenizer.model":
        shutil.copyfile(MISTRAL / "tokenizer.model.v1", tmp_path / "hf" / "tokenizer.model")
    else:
        (tmp_path / "hf" / "tokenizer.json").write_text(hugging_face_rendering(MISTRAL / "tokenizer.model.v1"))
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    model = converted(tmp_path, tmp_path / "hf")
    prompt = "The capital of France is 日本 🎉"
    ids = [1, *sentencepiece.SentencePieceProcessor(model_file=str(MISTRAL / "tokenizer.model.v1")).encode(prompt)]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=2)
    expected = out[0, len(ids) :].tolist()
    expected = expected[: expected.index(2)] if 2 in expected else expected
    done = manas("generate", "-c", model, *RUN_OPTIONS, "-p", prompt, "-n", "10", "-t", "0", "--json").ok().json()
    assert done["prompt_tokens"] == len(ids) and done["tokens"] == expected
    for target in ("hf", "gguf"):  # not written yet: one line that says so, nothing left behind
        refused = manas("export", model, "--format", target, "--out", tmp_path / f"out-{target}")
        assert refused.returncode == 1 and "SentencePiece" in refused.err, refused.err
        assert len(refused.err.strip().splitlines()) == 1 and not (tmp_path / f"out-{target}").exists()


def hugging_face_rendering(model_file) -> str:
    """A SentencePiece BPE model as Hugging Face renders it in a tokenizer.json (transformers' LlamaConverter): the
    pieces as model.vocab, every split of a piece into two pieces as a merge, pieces in the order of their scores,
    byte fallback, control pieces as special added tokens, a Metaspace that puts "▁" before the text."""
    sentencepiece = pytest.importorskip("sentencepiece")
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    merges = [
        [piece[:cut], piece[cut:]]
        for piece in sorted(vocab, key=lambda p: (-processor.get_score(vocab[p]), vocab[p]))
        if not any(is_kind(vocab[piece]) for is_kind in (processor.is_unknown, processor.is_control, processor.is_byte))
        for cut in range(1, len(piece))
        if piece[:cut] in vocab and piece[cut:] in vocab
    ]
    added = [
        {"id": i, "content": piece, "special": True, "normalized": False, "lstrip": False, "rstrip": False,
         "single_word": False}
        for i, piece in enumerate(pieces)
        if processor.is_control(i) or processor.is_unknown(i)
    ]  # fmt: skip
    return json.dumps({
        "version": "1.0",
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False},
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    })  # fmt: skip


@pytest.mark.parametrize("name", ["shakespeare", "multilingual"])
def test_a_sentencepiece_tokenizer_json_gives_the_ids_of_tokenizers_and_sentencepiece(tmp_path, name):
    """Mistral's tokenizer.model rendered as a Metaspace, byte-fallback tokenizer.json (what a folder without its
    tokenizer.model holds): manas reads the json alone, and its ids are Hugging Face's and sentencepiece's."""
    sentencepiece = pytest.importorskip("sentencepiece")
    model = MISTRAL / "tokenizer.model.v1"
    (tmp_path / "tokenizer.json").write_text(hugging_face_rendering(model))
    text = texts()[name]
    expected = sentencepiece.SentencePieceProcessor(model_file=str(model)).encode(text)
    reference = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert reference.encode(text, add_special_tokens=False).ids == expected
    run = manas("tokenize", "-c", tmp_path / "tokenizer.json", "--no-special", stdin=text.encode())
    assert [int(token) for token in run.ok().out.split()] == expected


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t["added_tokens"].append({"id": 40000, "content": None}), "added_tokens must be objects"),
        (lambda t: t["model"].__setitem__("vocab", ["a", "b"]), "model.vocab must map pieces to ids"),
        (lambda t: t["model"]["vocab"].__setitem__("▁zz", 99999), "must have the ids 0 to n-1"),
        (lambda t: t.__setitem__("pre_tokenizer", {"type": "Sequence", "pretokenizers": {"x": 1}}), None),
    ],
)
def test_a_sentencepiece_tokenizer_json_that_does_not_hold_together_is_one_error_line(tmp_path, change, message):
    """Untrusted input: a tokenizer.json whose parts have the wrong types or ids is one error line; a pre-tokenizer
    of an odd shape adds no space prefix, and nothing breaks."""
    pytest.importorskip("sentencepiece")
    tokenizer = json.loads(hugging_face_rendering(MISTRAL / "tokenizer.model.v1"))
    change(tokenizer)
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    run = manas("tokenize", "-c", tmp_path / "tokenizer.json", "Hello")
    if message is None:
        assert run.returncode == 0 and run.out.split(), run.err
        return
    assert run.returncode == 1 and run.err.startswith("error: ") and message in run.err, run.err
    assert len(run.err.strip().splitlines()) == 1


def llama3_tokenizer_json(path: Path) -> Path:
    """Llama 3's tokenizer.json as Hugging Face's `tokenizers` writes it, from the vocabulary and merges of
    llama.cpp's llama-bpe fixture (Llama 3's own): its split regex, then bytes, whole pieces in the vocabulary taken
    as they are (ignore_merges), the special tokens as added tokens."""
    import gguf

    reader = gguf.GGUFReader(LLAMA_CPP_VOCAB / "ggml-vocab-llama-bpe.gguf")
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(merge.split(" ")) for merge in reader.fields["tokenizer.ggml.merges"].contents()]
    normal = {token: i for i, (token, kind) in enumerate(zip(tokens, types)) if kind == 1}
    model = tokenizers.models.BPE(vocab=normal, merges=merges, ignore_merges=True)
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [
            tokenizers.pre_tokenizers.Split(tokenizers.Regex(LLAMA3_SPLIT), behavior="isolated"),
            tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.add_special_tokens([token for token, kind in zip(tokens, types) if kind == 3])
    tokenizer.save(str(path))
    return path


LLAMA3_SPLIT = (  # tokenizer.LLAMA3_PAT_STR, as Llama 3's tokenizer.json writes it
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def test_llama_3s_tokenizer_json_reads_its_merges_as_ranks_and_gives_tokenizers_ids(tmp_path):
    """Llama 3's merges are tiktoken's ranks written out, not a BPE's build order (merge 2 builds 'ĠĠĠ' from 'ĠĠ',
    which no earlier merge builds): a folder's tokenizer.json is read as ranks, as a GGUF's is, to the ids of
    Hugging Face's `tokenizers` on every text of these tests and of llama.cpp's fixture."""
    pytest.importorskip("gguf")
    path = llama3_tokenizer_json(tmp_path / "tokenizer.json")
    reference = tokenizers.Tokenizer.from_file(str(path))
    fixture = LLAMA_CPP_VOCAB / "ggml-vocab-llama-bpe.gguf.inp"
    cases = [*texts().values(), *fixture.read_text(encoding="utf-8").split(SEPARATOR)[:-1]]
    stdin = "".join(json.dumps(case) + "\n" for case in cases).encode()
    run = manas("tokenize", "-c", path, "--jsonl", "--no-special", stdin=stdin).ok()
    ids = [[int(i) for i in line.split()] for line in run.out.split("\n")[:-1]]
    assert ids == [reference.encode(case, add_special_tokens=False).ids for case in cases]
