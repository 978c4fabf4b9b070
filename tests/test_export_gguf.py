"""`manas export --format gguf`: one GGUF file for llama.cpp and ollama. Read back with the gguf package's own reader,
it holds llama.cpp's architecture, every hyperparameter, every tensor under llama.cpp's name and layout, and the
tokenizer; a forward pass written here from the GGUF layout alone computes manas' logits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model
from manas_cli.formats.checkpoint import load_checkpoint, save_checkpoint
from manas_cli.formats.tokenizer import END_OF_TEXT, build_encoding
from test_convert import assert_refused, run_manas
from test_export import shakespeare_character_spec

gguf = pytest.importorskip("gguf")

torch.set_num_threads(1)

# name → (position encoding, head layout, llama.cpp's architecture)
VARIANTS = {
    "learned": ("learned", "mha", "gpt2"),
    "rope": ("rope", "gqa", "starcoder2"),
    "learned-gqa": ("learned", "gqa", "gpt2"),
}
ARCHITECTURES = {name: VARIANTS[name][2] for name in ("learned", "rope")}  # GPT-2's own layout, and manas' default
BLOCK_SIZE = 64  # the prompt and 32 new tokens fit: llama.cpp's context does not slide
PROMPT = "the weather in the €uro zone"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_bpe_spec) -> dict[str, Path]:
    """Each variant as a tiny model speaking the tiny BPE. learned-gqa's vocabulary is padded: four ids with no
    token (llama.cpp, unlike manas, can sample those, so the llama.cpp test uses the others)."""
    folder = tmp_path_factory.mktemp("gguf")
    paths = {}
    for name, (position_encoding, layout, _) in VARIANTS.items():
        vocab_size = build_encoding(tiny_bpe_spec).n_vocab + (4 if name == "learned-gqa" else 0)
        path = folder / f"{name}.safetensors"
        model = make_model(position_encoding, layout, vocab_size=vocab_size, block_size=BLOCK_SIZE, rope_base=500.0)
        save_checkpoint(path, model, tiny_bpe_spec)
        paths[name] = path
    return paths


_exports: dict[tuple[str, str], Path] = {}


def exported(checkpoints: dict[str, Path], position_encoding: str, outtype: str) -> Path:
    """The checkpoint exported through the CLI (once per session); f16 by default, as users get it."""
    key = (position_encoding, outtype)
    if key not in _exports:
        checkpoint = checkpoints[position_encoding]
        out = checkpoint.with_name(f"{position_encoding}-{outtype}.gguf")
        flags = () if outtype == "f16" else ("--outtype", outtype)
        result = run_manas("export", checkpoint, "--format", "gguf", "--out", out, *flags)
        assert result.returncode == 0, result.stderr
        assert f"llama.cpp architecture {VARIANTS[position_encoding][2]}, {outtype}" in result.stderr
        _exports[key] = out
    return _exports[key]


# ---- reading GGUF, written from the format, not from manas -------------------------------------------------------


def field(reader, key: str):
    return reader.fields[key].contents()


def gguf_tensors(reader) -> dict[str, torch.Tensor]:
    """Every tensor as float32, in the (outer ... inner) shape numpy gives: GGUF lists dimensions innermost first."""
    tensors = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        tensors[tensor.name] = torch.from_numpy(values.reshape(tuple(reversed(tensor.shape.tolist()))).copy())
    return tensors


def rotate_half_order(n_heads: int, head_size: int) -> list[int]:
    """For each head, manas' row of every rotate-half row: the pairs' first halves (0, 2, 4, ...), then the seconds."""
    within = [*range(0, head_size, 2), *range(1, head_size, 2)]
    return [head * head_size + row for head in range(n_heads) for row in within]


def expected_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """llama.cpp's tensors for the manas model, biases the model lacks as zeros (none here: bias=True)."""
    model = load_checkpoint(checkpoint).model
    config, state = model.config, model.state_dict()
    tensors = {
        "token_embd.weight": state["token_embedding.weight"],
        "output_norm.weight": state["final_norm.weight"],
        "output_norm.bias": state["final_norm.bias"],
    }
    if config.position_encoding == "learned":
        tensors["position_embd.weight"] = state["position_embedding.weight"]
    kv_width = config.n_kv_head * config.head_size
    for i in range(config.n_layer):
        names = {
            "attn_norm": "ln_attention",
            "attn_output": "attention.output",
            "ffn_norm": "ln_ffn",
            "ffn_up": "ffn.up",
            "ffn_down": "ffn.down",
        }
        for kind in ("weight", "bias"):
            for gguf_name, name in names.items():
                tensors[f"blk.{i}.{gguf_name}.{kind}"] = state[f"blocks.{i}.{name}.{kind}"]
            qkv = state[f"blocks.{i}.attention.qkv.{kind}"]
            if config.position_encoding == "learned":
                tensors[f"blk.{i}.attn_qkv.{kind}"] = qkv
                continue
            q, k, v = qkv.split((config.n_embd, kv_width, kv_width))
            tensors[f"blk.{i}.attn_q.{kind}"] = q[rotate_half_order(config.n_head, config.head_size)]
            tensors[f"blk.{i}.attn_k.{kind}"] = k[rotate_half_order(config.n_kv_head, config.head_size)]
            tensors[f"blk.{i}.attn_v.{kind}"] = v
    return tensors


def gguf_forward(reader, ids: torch.Tensor) -> torch.Tensor:
    """Logits (T, vocab) for one sequence, computed as llama.cpp's gpt2 and starcoder2 graphs do, from the file."""
    arch = field(reader, "general.architecture")
    hp = {key.removeprefix(f"{arch}."): field(reader, key) for key in reader.fields if key.startswith(f"{arch}.")}
    t = gguf_tensors(reader)
    n_head, n_kv_head, eps = (
        hp["attention.head_count"],
        hp["attention.head_count_kv"],
        hp["attention.layer_norm_epsilon"],
    )
    head_size = hp["embedding_length"] // n_head
    T = ids.numel()

    def norm(x, name):
        return F.layer_norm(x, x.shape[-1:], t[f"{name}.weight"], t[f"{name}.bias"], eps)

    def linear(x, name):
        return x @ t[f"{name}.weight"].T + t[f"{name}.bias"]

    def neox_rope(x):  # x (heads, T, hs): rotate (i, i + hs/2) by pos · base^(-2i/hs)
        half = head_size // 2
        angles = torch.arange(T, dtype=torch.float64)[:, None] * hp["rope.freq_base"] ** (
            -torch.arange(0, head_size, 2, dtype=torch.float64) / head_size
        )
        cos, sin = angles.cos().float(), angles.sin().float()
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    x = t["token_embd.weight"][ids]
    if arch == "gpt2":
        x = x + t["position_embd.weight"][:T]
    mask = torch.full((T, T), float("-inf")).triu(1)
    for i in range(hp["block_count"]):
        h = norm(x, f"blk.{i}.attn_norm")
        if arch == "gpt2":
            q, k, v = linear(h, f"blk.{i}.attn_qkv").split(
                (n_head * head_size, n_kv_head * head_size, n_kv_head * head_size), -1
            )
        else:
            q, k, v = (linear(h, f"blk.{i}.attn_{part}") for part in "qkv")
        q, k, v = (y.view(T, -1, head_size).transpose(0, 1) for y in (q, k, v))
        if arch == "starcoder2":
            q, k = neox_rope(q), neox_rope(k)
        k, v = (y.repeat_interleave(n_head // n_kv_head, dim=0) for y in (k, v))
        attention = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(head_size) + mask, dim=-1) @ v
        x = x + linear(attention.transpose(0, 1).reshape(T, -1), f"blk.{i}.attn_output")
        h = norm(x, f"blk.{i}.ffn_norm")
        x = x + linear(F.gelu(linear(h, f"blk.{i}.ffn_up"), approximate="tanh"), f"blk.{i}.ffn_down")
    return norm(x, "output_norm") @ t["token_embd.weight"].T  # tied: llama.cpp reuses token_embd as output


# ---- tests -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("position_encoding", list(ARCHITECTURES))
def test_gguf_holds_llama_cpps_architecture_and_every_hyperparameter(checkpoints, position_encoding):
    reader = gguf.GGUFReader(exported(checkpoints, position_encoding, "f16"))
    config = load_checkpoint(checkpoints[position_encoding]).model.config
    arch = ARCHITECTURES[position_encoding]
    expected = {
        "general.architecture": arch,
        "general.name": position_encoding,
        "general.file_type": 1,
        "general.quantization_version": 2,
        f"{arch}.vocab_size": config.vocab_size,
        f"{arch}.context_length": BLOCK_SIZE,
        f"{arch}.embedding_length": 32,
        f"{arch}.feed_forward_length": 128,
        f"{arch}.block_count": 2,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": config.n_kv_head,
        f"{arch}.attention.layer_norm_epsilon": pytest.approx(1e-5),
    }
    if position_encoding == "rope":
        expected |= {f"{arch}.rope.dimension_count": 8, f"{arch}.rope.freq_base": 500.0}
    model_keys = {key: field(reader, key) for key in reader.fields if key.startswith(("general.", f"{arch}."))}
    assert model_keys == expected


OUTTYPE_TOLERANCE = {"f32": 0.0, "f16": 2**-11, "q8_0": 1 / 127}  # relative to a value (f16) or its block's max (q8_0)


@pytest.mark.parametrize("outtype", list(OUTTYPE_TOLERANCE))
@pytest.mark.parametrize("position_encoding", list(ARCHITECTURES))
def test_gguf_holds_every_tensor_under_llama_cpps_name_shape_and_precision(checkpoints, position_encoding, outtype):
    reader = gguf.GGUFReader(exported(checkpoints, position_encoding, outtype))
    expected = expected_tensors(checkpoints[position_encoding])
    stored = {tensor.name: tensor for tensor in reader.tensors}
    tensors = gguf_tensors(reader)
    assert sorted(tensors) == sorted(expected)

    for name, want in expected.items():
        got = tensors[name]
        assert got.shape == want.shape, name
        # GGUF's shape is innermost first: llama.cpp's {n_embd, n_vocab} for an embedding of n_vocab rows
        assert stored[name].shape.tolist() == list(reversed(want.shape)), name
        kept_f32 = outtype == "f32" or want.dim() == 1 or name == "position_embd.weight"
        kind = stored[name].tensor_type.name
        assert kind == ("F32" if kept_f32 else outtype.upper()), name
        if kept_f32:
            assert torch.equal(got, want), name
        elif outtype == "f16":
            torch.testing.assert_close(got, want, rtol=OUTTYPE_TOLERANCE["f16"], atol=1e-7)
        else:  # each block of 32 values is rounded to int8 steps of its largest magnitude / 127, a float16 scale
            blocks, got_blocks = want.reshape(-1, 32), got.reshape(-1, 32)
            step = blocks.abs().amax(dim=1, keepdim=True) * OUTTYPE_TOLERANCE["q8_0"]
            assert ((got_blocks - blocks).abs() <= step * (0.5 + 127 * 2**-11)).all(), name


def test_gguf_embeds_the_tokenizer_as_byte_level_bpe(checkpoints, tiny_bpe_spec):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    reader = gguf.GGUFReader(exported(checkpoints, "learned-gqa", "f32"))
    encoding, alias = build_encoding(tiny_bpe_spec), bytes_to_unicode()
    eot = encoding.encode_single_token(END_OF_TEXT)
    vocab_size = load_checkpoint(checkpoints["learned-gqa"]).model.config.vocab_size
    assert vocab_size == encoding.n_vocab + 4

    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.pre") == "gpt-2"  # llama.cpp's name for GPT-2's split pattern, ours
    assert field(reader, "tokenizer.ggml.eos_token_id") == field(reader, "tokenizer.ggml.bos_token_id") == eot
    assert field(reader, "tokenizer.ggml.add_bos_token") is False
    tokens, types = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == vocab_size
    for i in range(encoding.n_vocab):
        if i == eot:
            assert (tokens[i], types[i]) == (END_OF_TEXT, 3)  # CONTROL
        else:
            assert (tokens[i], types[i]) == ("".join(alias[b] for b in encoding.decode_single_token_bytes(i)), 1)
    assert all(types[i] == 5 for i in range(encoding.n_vocab, vocab_size))  # UNUSED: the padded ids

    merges = field(reader, "tokenizer.ggml.merges")
    multi_byte = [i for i in range(encoding.n_vocab) if i != eot and len(encoding.decode_single_token_bytes(i)) > 1]
    assert [merge.replace(" ", "") for merge in merges] == [tokens[i] for i in multi_byte]  # in rank order
    assert merges[:3] == ["t h", "h e", "th e"]


@pytest.mark.parametrize("position_encoding", list(VARIANTS))
def test_a_forward_pass_from_the_gguf_tensors_gives_manas_logits(checkpoints, position_encoding):
    """llama.cpp's gpt2 reads head_count_kv, so learned positions with grouped-query attention are gpt2 too."""
    reader = gguf.GGUFReader(exported(checkpoints, position_encoding, "f32"))
    model = load_checkpoint(checkpoints[position_encoding]).model
    ids = torch.randint(0, model.config.vocab_size, (BLOCK_SIZE,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(gguf_forward(reader, ids), model(ids[None])[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("position_encoding", list(ARCHITECTURES))
def test_llama_cpp_generates_manas_greedy_tokens(checkpoints, tiny_bpe_spec, position_encoding):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = exported(checkpoints, position_encoding, "f32")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=BLOCK_SIZE, n_threads=1, verbose=False)
    prompt_ids = build_encoding(tiny_bpe_spec).encode_ordinary(PROMPT)
    assert llm.tokenize(PROMPT.encode(), add_bos=False, special=False) == prompt_ids
    result = run_manas(
        "generate",
        "-c",
        checkpoints[position_encoding],
        "--device",
        "cpu",
        "--threads",
        "1",
        "-p",
        PROMPT,
        "-n",
        "32",
        "-t",
        "0",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    manas_ids = json.loads(result.stdout)["tokens"]
    llama_ids = []
    for token in llm.generate(prompt_ids, temp=0.0, top_k=1):
        if token == llm.token_eos() or len(llama_ids) == len(manas_ids):
            break
        llama_ids.append(token)
    assert llama_ids == manas_ids


# ---- refusals --------------------------------------------------------------------------------------------------------


REFUSALS = {  # (position encoding, model overrides, tokenizer spec changes, message)
    "exact-gelu": (
        "learned",
        {"gelu_approximate": "none"},
        {},
        "llama.cpp's gpt2 and starcoder2 compute GELU's tanh approximation",
    ),
    "bpe-with-another-split-pattern": ("rope", {}, {"pat_str": r"\S+|\s+"}, "only GPT-2-pattern BPE tokenizers export"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_export_gguf_refuses_what_llama_cpp_would_compute_or_encode_differently(tmp_path, tiny_bpe_spec, case):
    position_encoding, overrides, spec_changes, message = REFUSALS[case]
    model = make_model(position_encoding, vocab_size=300, **overrides)
    save_checkpoint(tmp_path / "m.safetensors", model, tiny_bpe_spec | spec_changes)
    result = run_manas("export", tmp_path / "m.safetensors", "--format", "gguf", "--out", tmp_path / "m.gguf")
    assert_refused(result, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]  # nothing written, no temporary file


def test_export_gguf_refuses_a_vocabulary_without_end_of_text(tmp_path):
    spec = shakespeare_character_spec("First Citizen: speak")
    save_checkpoint(tmp_path / "m.safetensors", make_model("rope", vocab_size=build_encoding(spec).n_vocab), spec)
    result = run_manas("export", tmp_path / "m.safetensors", "--format", "gguf", "--out", tmp_path / "m.gguf")
    assert_refused(result, "the tokenizer has no <|endoftext|>")


def test_export_gguf_does_not_overwrite_without_force(tmp_path, checkpoints):
    out = tmp_path / "model.gguf"
    out.write_bytes(b"mine")
    assert_refused(run_manas("export", checkpoints["rope"], "--format", "gguf", "--out", out), "exists: pass --force")
    assert out.read_bytes() == b"mine"

    result = run_manas("export", checkpoints["rope"], "--format", "gguf", "--out", out, "--force")
    assert result.returncode == 0, result.stderr
    assert out.read_bytes() == exported(checkpoints, "rope", "f16").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_export_gguf_without_the_gguf_package_says_how_to_install_it(tmp_path, checkpoints):
    shadow = tmp_path / "no-gguf"
    shadow.mkdir()
    (shadow / "gguf.py").write_text("raise ImportError(\"No module named 'gguf'\")\n")  # as if it were not installed
    result = run_manas(
        "export", checkpoints["rope"], "--format", "gguf", "--out", tmp_path / "m.gguf", env={"PYTHONPATH": str(shadow)}
    )
    assert_refused(result, 'pip install "manas-cli[gguf]"')


def test_outtype_is_a_usage_error_for_the_hugging_face_format(tmp_path, checkpoints):
    result = run_manas("export", checkpoints["rope"], "--format", "hf", "--out", tmp_path / "hf", "--outtype", "q8_0")
    assert result.returncode == 2 and "--outtype applies to --format gguf only" in result.stderr
    assert not (tmp_path / "hf").exists()


def test_q8_0_keeps_float16_for_matrices_whose_rows_do_not_fill_whole_blocks(tmp_path, tiny_bpe_spec):
    """q8_0 packs 32 values of a row per block: a 48-wide model falls back to f16 there, as llama.cpp's converter."""
    model = make_model("rope", vocab_size=build_encoding(tiny_bpe_spec).n_vocab, n_embd=48)
    save_checkpoint(tmp_path / "m.safetensors", model, tiny_bpe_spec)
    result = run_manas(
        "export", tmp_path / "m.safetensors", "--format", "gguf", "--out", tmp_path / "m.gguf", "--outtype", "q8_0"
    )
    assert result.returncode == 0, result.stderr

    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert field(reader, "general.file_type") == 7  # MOSTLY_Q8_0
    kinds = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    assert kinds["token_embd.weight"] == kinds["blk.0.attn_q.weight"] == "F16"  # rows of 48
    assert kinds["blk.0.ffn_down.weight"] == "Q8_0"  # rows of 4 × 48 = 192 = 6 blocks
    assert kinds["blk.0.attn_q.bias"] == "F32"


def with_own_output_layer(source: Path, out: Path) -> None:
    """The GGUF at source written again with an output.weight of its own: the token embedding, scaled."""
    import numpy as np

    from test_real_models import copy_fields

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    copy_fields(writer, reader.fields)
    for tensor in reader.tensors:
        values = np.array(tensor.data, dtype=np.float32).reshape(tuple(int(n) for n in reversed(tensor.shape)))
        writer.add_tensor(tensor.name, values)
        if tensor.name == "token_embd.weight":
            writer.add_tensor("output.weight", values * 1.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", ["learned", "rope"])
def test_a_gpt2_or_starcoder2_gguf_exports_the_model_its_conversion_exports(checkpoints, tmp_path, name):
    """export reads a GGUF a layer at a time, as convert does; a gpt2 or starcoder2 file's output layer, compared with
    the embedding first, unties the model only where it differs (and an untied GPT-2 block exports nowhere)."""
    import numpy as np

    path, untied = tmp_path / "m.gguf", tmp_path / "untied.gguf"
    again = ("--format", "gguf", "--outtype", "f32")
    for args in (("export", checkpoints[name], *again, "--out", path),
                 ("export", path, *again, "--out", tmp_path / "direct.gguf"),
                 ("convert", path, "--out", tmp_path / "c.safetensors"),
                 ("export", tmp_path / "c.safetensors", *again, "--out", tmp_path / "through.gguf")):  # fmt: skip
        done = run_manas(*args)
        assert done.returncode == 0, done.stderr
    direct, through = ({t.name: t.data for t in gguf.GGUFReader(tmp_path / f"{way}.gguf").tensors}
                       for way in ("direct", "through"))  # fmt: skip
    assert direct.keys() == through.keys() and "output.weight" not in direct
    assert all(np.array_equal(direct[name], through[name]) for name in direct)
    with_own_output_layer(path, untied)
    assert_refused(run_manas("export", untied, *again, "--out", tmp_path / "u.gguf"), "only when it has their block")
    assert run_manas("convert", untied, "--out", tmp_path / "u.safetensors").returncode == 0
    assert not load_checkpoint(tmp_path / "u.safetensors").model.config.tie_embeddings
