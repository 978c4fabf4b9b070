"""Real models as people hold them (issue 57): a Llama-family model with SmolLM2's 8,192-token window served with
default flags on a machine whose free memory cannot hold 16 rows of that window."""

from __future__ import annotations

import re
import resource
import subprocess

import pytest
import torch

from cli_fixtures import MANAS, RUN_OPTIONS, checkpoints, cli_env, learned, manas  # noqa: F401 (fixtures)
from test_serve import READY

ADDRESS_SPACE_BYTES = 3 * 2**30  # ulimit -v: what the server may map; 16 rows of 8,192 positions need ~16 GiB


@pytest.fixture(scope="module")
def long_window(tmp_path_factory, tiny_bpe_spec):
    """A SmolLM2-shaped model declaring SmolLM2's 8,192-token window, converted."""
    from test_llama_family import converted, hf_folder

    folder = tmp_path_factory.mktemp("long-window")
    hf_folder(folder / "hf", tiny_bpe_spec, "smollm2", max_position_embeddings=8192)
    return converted(folder, folder / "hf")


def limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))


def test_serve_with_default_flags_keeps_the_window_that_fits_and_says_so(long_window):
    process = subprocess.Popen(
        [*MANAS, "serve", "-c", long_window, "--port", "0", "--threads", "1"],
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
        preexec_fn=limited,
    )
    try:
        ready = process.stderr.readline()
        found = READY.search(ready)
        kept = re.search(r"· window ([\d,]+) of 8,192 tokens, to fit the free memory \(--ctx sets it\)", ready)
        assert found and kept and int(kept.group(1).replace(",", "")) < 8192, ready
        import openai

        client = openai.OpenAI(base_url=f"http://{found.group(1)}:{found.group(2)}/v1", api_key="x", max_retries=0)
        done = client.completions.create(model="m", prompt="the", max_tokens=4, temperature=0)
        assert done.usage.completion_tokens == 4 or done.choices[0].finish_reason == "stop"
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0


def test_a_window_the_user_chose_is_kept_or_refused_never_changed(long_window):
    chosen = subprocess.run(
        [*MANAS, "serve", "-c", long_window, "--port", "0", "--threads", "1", "--ctx", "8192"],
        capture_output=True,
        text=True,
        env=cli_env(),
        preexec_fn=limited,
        timeout=120,
    )
    assert chosen.returncode == 1 and chosen.stderr.startswith("error: this run needs about")
    assert "lower --batch-size" in chosen.stderr


# ---- GGUF in ----


def gguf_roundtrip(original, tmp_path, outtype: str):
    """The manas checkpoint exported to GGUF, and that GGUF converted back: (the GGUF, the checkpoint back)."""
    exported = tmp_path / f"model-{outtype}.gguf"
    manas("export", original, "--format", "gguf", "--outtype", outtype, "--out", exported).ok()
    back = tmp_path / f"back-{outtype}.safetensors"
    manas("convert", exported, "--out", back).ok()
    return exported, back


@pytest.mark.parametrize("family", ["smollm2", "qwen2", "tinyllama"])
def test_a_gguf_export_converts_back_to_the_same_weights_and_text(tmp_path, tiny_bpe_spec, family):
    """llama (interleaved rope pairs, tied or not) and qwen2 (rotate-half): manas → GGUF f32 → manas is the same
    model, tokenizer and text; through q8_0 (once: the layout is proven above), every weight is the gguf package's
    dequantization of its blocks."""
    pytest.importorskip("gguf")
    import gguf

    from manas_cli.formats.checkpoint import load_checkpoint
    from test_llama_family import converted, hf_folder

    hf_folder(tmp_path / family, tiny_bpe_spec, family)
    original = converted(tmp_path, tmp_path / family)
    _, back = gguf_roundtrip(original, tmp_path, "f32")
    a, b = load_checkpoint(original), load_checkpoint(back)
    assert a.model.config == b.model.config and a.tokenizer_spec["ranks"] == b.tokenizer_spec["ranks"]
    assert all(torch.equal(a.model.state_dict()[name], t) for name, t in b.model.state_dict().items())
    flags = (*RUN_OPTIONS, "-p", "the weather", "-n", "12", "-t", "0", "--json")
    assert (
        manas("generate", "-c", back, *flags).ok().json()["tokens"]
        == manas("generate", "-c", original, *flags).ok().json()["tokens"]
    )
    if family != "smollm2":
        return
    exported, back = gguf_roundtrip(original, tmp_path, "q8_0")
    stored = {t.name: t for t in gguf.GGUFReader(exported).tensors}
    embedding = gguf.quants.dequantize(stored["token_embd.weight"].data, stored["token_embd.weight"].tensor_type)
    assert torch.equal(load_checkpoint(back).model.state_dict()["token_embedding.weight"], torch.from_numpy(embedding))


# Where each raw block type keeps its float16 scales (byte offsets in a block): set to a small finite value, the
# rest of the block random, so every value is finite and every bit of the quantized codes is exercised.
SCALE_OFFSETS = {
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
}  # fmt: skip
QUANTIZED_BY_THE_PACKAGE = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def copy_fields(writer, fields: dict) -> None:
    """A GGUF reader's metadata fields into a writer (but the file's own header and architecture)."""
    import gguf

    for name, field in fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)


def stored_blocks(values, name: str, rng, scale: float = 0.01):
    """values (rows, columns) as blocks of type `name`: quantized by the gguf package where it can, else random
    blocks whose float16 scales are `scale` (every bit of the codes exercised: the K-quants and IQ4, written
    directly)."""
    import gguf
    import numpy as np

    kind = gguf.GGMLQuantizationType[name]
    if name in QUANTIZED_BY_THE_PACKAGE:
        return gguf.quants.quantize(values, kind)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (values.shape[0], values.shape[1] // block, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[name]:
        data[:, :, offset : offset + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
    return data.reshape(values.shape[0], -1)


def retyped(source, out, kinds, scale: float = 0.01) -> None:
    """The GGUF at source written again with its matrices stored in `kinds`, in turn (stored_blocks)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    copy_fields(writer, reader.fields)
    rng = np.random.default_rng(0)
    matrices = 0
    for tensor in reader.tensors:
        values = np.array(tensor.data, dtype=np.float32).reshape(tuple(int(n) for n in reversed(tensor.shape)))
        if values.ndim == 1:
            writer.add_tensor(tensor.name, values)
            continue
        name = kinds[matrices % len(kinds)]
        matrices += 1
        writer.add_tensor(tensor.name, stored_blocks(values, name, rng, scale),
                          raw_dtype=gguf.GGMLQuantizationType[name])  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_every_tensor_type_dequantizes_as_the_gguf_package_does(tmp_path, tiny_bpe_spec):
    """A model 256 wide (a K-quant block's width), its matrices stored in every type in turn, converted; exported
    again as f32, each tensor is the gguf package's dequantization of the stored blocks, bit for bit."""
    pytest.importorskip("gguf")
    import gguf
    import numpy as np

    from test_llama_family import converted, hf_folder

    kinds = [*QUANTIZED_BY_THE_PACKAGE, *SCALE_OFFSETS]
    hf_folder(tmp_path / "wide", tiny_bpe_spec, "tinyllama", hidden_size=256, intermediate_size=512)
    exported = tmp_path / "wide.gguf"
    manas(
        "export", converted(tmp_path, tmp_path / "wide"), "--format", "gguf", "--outtype", "f32", "--out", exported
    ).ok()
    retyped(exported, tmp_path / "typed.gguf", kinds)
    manas("convert", tmp_path / "typed.gguf", "--out", tmp_path / "typed.safetensors").ok()
    manas("export", tmp_path / "typed.safetensors", "--format", "gguf", "--outtype", "f32", "--out",
          tmp_path / "again.gguf").ok()  # fmt: skip
    typed = {t.name: t for t in gguf.GGUFReader(tmp_path / "typed.gguf").tensors}
    again = {t.name: t for t in gguf.GGUFReader(tmp_path / "again.gguf").tensors}
    seen = set()
    for name, tensor in typed.items():
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1)
        assert np.array_equal(np.asarray(again[name].data).reshape(-1), expected), (name, tensor.tensor_type.name)
        seen.add(tensor.tensor_type.name)
    assert set(kinds) <= seen


def test_what_a_gguf_holds_that_manas_cannot_run_is_one_error_line(tmp_path):
    pytest.importorskip("gguf")
    import gguf

    writer = gguf.GGUFWriter(tmp_path / "moe.gguf", "qwen3moe")  # mixture-of-experts: not yet
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    run = manas("convert", tmp_path / "moe.gguf", "--out", tmp_path / "out.safetensors")
    assert run.returncode == 1 and "llama.cpp architecture 'qwen3moe' is not one manas imports" in run.err
    assert len(run.err.strip().splitlines()) == 1 and not (tmp_path / "out.safetensors").exists()


def test_a_gguf_runs_wherever_a_checkpoint_is_taken_and_nothing_is_written(tmp_path, tiny_bpe_spec):
    """torch reads it in memory, the native core in place: the same greedy text as the checkpoint it was exported
    from (float32 blocks: the same weights), and the cache folder holds no copy of them."""
    pytest.importorskip("gguf")
    from test_llama_family import converted, hf_folder

    hf_folder(tmp_path / "qwen2", tiny_bpe_spec, "qwen2")
    original = converted(tmp_path, tmp_path / "qwen2")
    exported, _ = gguf_roundtrip(original, tmp_path, "f32")
    cache = tmp_path / "cache"
    flags = (*RUN_OPTIONS, "-p", "the weather", "-n", "10", "-t", "0", "--json")
    expected = manas("generate", "-c", original, *flags).json()["tokens"]
    for engine in ("torch", "native"):
        run = manas("generate", "-m", exported, *flags, "--engine", engine, XDG_CACHE_HOME=str(cache)).ok()
        assert run.json()["tokens"] == expected, engine
    scored = manas("score", "-m", exported, *RUN_OPTIONS, "--json", stdin=b"the weather is fine today").ok()
    assert scored.json()["tokens"] > 1 and not (cache / "manas" / "gguf").exists()
    manas("export", exported, "--out", tmp_path / "hf").ok()  # read into memory, written as a Hugging Face folder
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()


# ---- GPT-2's and StarCoder2's GGUFs ----


@pytest.mark.parametrize("name", ["learned-mha", "rope-gqa"])
def test_gpt2_and_starcoder2_ggufs_convert_back_to_the_same_model(tmp_path, checkpoints, name):
    """learned positions are llama.cpp's gpt2 (fused q|k|v, out×in: no Conv1D), rotary ones its starcoder2 (separate
    q, k, v in the rotate-half layout; grouped-query here)."""
    pytest.importorskip("gguf")
    from manas_cli.formats.checkpoint import load_checkpoint

    original = checkpoints[name].path
    _, back = gguf_roundtrip(original, tmp_path, "f32")
    a, b = load_checkpoint(original), load_checkpoint(back)
    assert a.model.config == b.model.config and a.tokenizer_spec["ranks"] == b.tokenizer_spec["ranks"]
    assert all(torch.equal(a.model.state_dict()[key], t) for key, t in b.model.state_dict().items())
    flags = (*RUN_OPTIONS, "-p", "the king", "-n", "12", "-t", "0", "--json")
    expected = manas("generate", "-c", original, *flags).ok().json()["tokens"]
    assert manas("generate", "-c", back, *flags).ok().json()["tokens"] == expected


def test_a_gpt2_gguf_whose_output_layer_is_stored_apart_keeps_it(tmp_path, learned):
    """llama.cpp's converter repeats GPT-2's tied output layer as output.weight, which quantizes on its own (Q6_K
    beside a Q4_K embedding in a Q4_K_M file): the model then runs with that layer, not the embedding."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from manas_cli.formats.checkpoint import load_checkpoint

    exported, _ = gguf_roundtrip(learned.path, tmp_path, "f32")
    reader = gguf.GGUFReader(exported)
    writer = gguf.GGUFWriter(tmp_path / "untied.gguf", "gpt2")
    copy_fields(writer, reader.fields)
    for tensor in reader.tensors:
        values = np.array(tensor.data, dtype=np.float32).reshape(tuple(int(n) for n in reversed(tensor.shape)))
        writer.add_tensor(tensor.name, values)
        if tensor.name == "token_embd.weight":
            output = values[:, ::-1].copy()
            writer.add_tensor("output.weight", output)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    manas("convert", tmp_path / "untied.gguf", "--out", tmp_path / "untied.safetensors").ok()
    model = load_checkpoint(tmp_path / "untied.safetensors").model
    assert not model.config.tie_embeddings
    assert torch.equal(model.lm_head.weight, torch.from_numpy(output))
    flags = (*RUN_OPTIONS, "-p", "the king", "-n", "8", "-t", "0", "--json")
    native, torch_engine = (
        manas("generate", "-c", tmp_path / "untied.safetensors", *flags, "--engine", engine).ok().json()["tokens"]
        for engine in ("native", "torch")
    )
    assert native == torch_engine


# ---- a Q4_K file's quality through each path ----


def q4_k_blocks(rows):
    """float32 rows (a multiple of 256 long) as llama.cpp's Q4_K blocks, by the plainest rule: per 32 values a
    6-bit scale and min of the block's float16 d and dmin, each value 4 bits. A block is 144 bytes: d, dmin, the
    twelve bytes of packed scales and mins, then 128 bytes holding sub-blocks 2i and 2i+1 in the low and high
    nibbles."""
    import numpy as np

    x = rows.astype(np.float32).reshape(-1, 8, 32)
    low = np.minimum(x.min(axis=2), 0)
    step, offset = (x.max(axis=2) - low) / 15, -low  # per sub-block: x ≈ step * q - offset
    d = np.maximum(step.max(axis=1), 1e-8) / 63
    dmin = np.maximum(offset.max(axis=1), 1e-8) / 63
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.round(step / d[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(offset / dmin[:, None]), 0, 63).astype(np.uint8)
    scale = d16.astype(np.float32)[:, None] * sc
    q = np.clip(np.round((x + (dmin16.astype(np.float32)[:, None] * m)[:, :, None]) / scale[:, :, None]), 0, 15)
    q = q.astype(np.uint8)
    packed = np.zeros((x.shape[0], 12), np.uint8)
    packed[:, 0:4], packed[:, 4:8] = sc[:, :4], m[:, :4]
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    packed[:, 0:4] |= (sc[:, 4:] >> 4) << 6
    packed[:, 4:8] |= (m[:, 4:] >> 4) << 6
    nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(x.shape[0], 128)
    header = np.stack([d16, dmin16], axis=1).view(np.uint8)
    return np.concatenate([header, packed, nibbles], axis=1).reshape(rows.shape[0], -1)


def test_a_q4_k_file_converted_to_int8_scores_within_a_hundredth_of_a_nat_of_its_float32_conversion(
    tmp_path, tiny_bpe_spec, shakespeare_held_out
):
    """A model 256 wide, every matrix stored as Q4_K (the bulk of a Q4_K_M file): converted to float32 its blocks
    are dequantized exactly; converted with --quantize int8 it loses under 0.01 nats/token more on held-out text."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from test_llama_family import converted, hf_folder

    hf_folder(tmp_path / "wide", tiny_bpe_spec, "tinyllama", hidden_size=256, intermediate_size=512)
    original = converted(tmp_path, tmp_path / "wide")
    exported, _ = gguf_roundtrip(original, tmp_path, "f32")
    reader = gguf.GGUFReader(exported)
    writer = gguf.GGUFWriter(tmp_path / "q4_k.gguf", "llama")
    copy_fields(writer, reader.fields)
    for tensor in reader.tensors:
        values = np.array(tensor.data, dtype=np.float32).reshape(tuple(int(n) for n in reversed(tensor.shape)))
        if values.ndim == 1:
            writer.add_tensor(tensor.name, values)
            continue
        blocks = q4_k_blocks(values)
        dequantized = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(values.shape)
        assert np.abs(dequantized - values).max() <= 0.1 * np.abs(values).max()  # 4 bits' worth, not noise
        writer.add_tensor(tensor.name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    text = shakespeare_held_out[:3000].encode()
    scores = {}
    for kind in ("float32", "int8"):
        out = tmp_path / f"q4_k-{kind}.safetensors"
        quantize = ("--quantize", kind) if kind != "float32" else ()
        manas("convert", tmp_path / "q4_k.gguf", *quantize, "--out", out).ok()
        scores[kind] = manas("score", "-c", out, *RUN_OPTIONS, "--json", stdin=text).ok().json()
    assert scores["int8"]["weights"] == "int8" and scores["float32"]["weights"] == "float32"
    assert abs(scores["int8"]["nats_per_token"] - scores["float32"]["nats_per_token"]) < 0.01


def test_a_gpt2_gguf_whose_head_count_is_per_layer_is_one_error_line(tmp_path, learned):
    """Some architectures store head_count_kv per layer (an array): a GPT-2 block has one count for all layers."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    exported, _ = gguf_roundtrip(learned.path, tmp_path, "f32")
    reader = gguf.GGUFReader(exported)
    writer = gguf.GGUFWriter(tmp_path / "per-layer.gguf", "gpt2")
    copy_fields(writer, {k: v for k, v in reader.fields.items() if k != "gpt2.attention.head_count_kv"})
    writer.add_key_value(
        "gpt2.attention.head_count_kv", [4, 4], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT32
    )
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data).reshape(tuple(int(n) for n in reversed(tensor.shape))))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    run = manas("convert", tmp_path / "per-layer.gguf", "--out", tmp_path / "out.safetensors")
    assert run.returncode == 1 and run.err.startswith("error: ") and "n_kv_head" in run.err, run.err
    assert len(run.err.strip().splitlines()) == 1 and not (tmp_path / "out.safetensors").exists()
