"""`manas convert`: nanoGPT and Hugging Face GPT-2 weights become manas checkpoints that compute the same function,
with the tokenizer they were trained with; anything unsafe or inexact is refused with one `error:` line."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cli_fixtures import cli
from conftest import engine_of
from manas_cli.engine.generation import generate
from manas_cli.engine.sampling import Sampler
from manas_cli.formats.checkpoint import load_checkpoint, save_checkpoint
from manas_cli.formats.header import read_metadata
from manas_cli.formats.tokenizer import bpe_spec, decode_ranks, end_of_text_id

torch.set_num_threads(1)

# The installed console script of this interpreter's environment (python -m manas_cli where there is none).
_SCRIPT = Path(sys.executable).with_name("manas")
MANAS = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "manas_cli"]
GPT2_RANKS = Path(__file__).resolve().parent / "data" / "gpt2.tiktoken"
GPT2_VOCAB = 50257
SMALL_VOCAB = 96  # for models whose conversion is refused before any tokenizer has to fit


def run_manas(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The real CLI, one thread (the machine's other core belongs to whoever else is running)."""
    return cli(*args, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, text=True)


def assert_converted(result: subprocess.CompletedProcess, dst: Path) -> None:
    assert result.returncode == 0, result.stderr
    assert dst.is_file()
    assert [p.name for p in dst.parent.iterdir() if p.name.endswith(".tmp")] == []  # atomic write left nothing


def assert_refused(result: subprocess.CompletedProcess, message: str) -> None:
    """The CLI's contract for a refusal: exit 1, exactly one stderr line, `error: ...`, no traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr and "\x1b[" not in result.stderr


# ---- Hugging Face GPT-2 ------------------------------------------------------------------------------------------


def tiny_hf_gpt2(activation: str = "gelu_new", vocab_size: int = GPT2_VOCAB, seed: int = 0):
    """A random GPT2LMHeadModel with GPT-2's vocabulary (so GPT-2's tokenizer fits) and a narrow body. Weights are
    spread wider than GPT-2's init so that logits are far apart and greedy choices are never near-ties."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=96,
        n_embd=32,
        n_layer=2,
        n_head=4,
        activation_function=activation,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
    )
    return GPT2LMHeadModel(config).eval()


def save_folder_safetensors(model, folder: Path) -> list[str]:
    model.save_pretrained(folder)
    return [str(folder)]


def save_folder_pytorch_bin(model, folder: Path) -> list[str]:
    """The layout of older Hub uploads such as gpt2's pytorch_model.bin: GPT2Model's names (no `transformer.`
    prefix, no lm_head) and the causal-mask buffers older transformers kept in the state dict."""
    folder.mkdir()
    model.config.to_json_file(folder / "config.json")
    state = {name.removeprefix("transformer."): t for name, t in model.state_dict().items() if name != "lm_head.weight"}
    n = model.config.n_positions
    for i in range(model.config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n, dtype=torch.uint8)).view(1, 1, n, n)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, folder / "pytorch_model.bin")
    return [str(folder)]


def save_bare_safetensors(model, folder: Path) -> list[str]:
    model.save_pretrained(folder)
    bare, config = folder.parent / "weights.safetensors", folder.parent / "gpt2-config.json"
    (folder / "model.safetensors").rename(bare)
    (folder / "config.json").rename(config)
    return [str(bare), "--config", str(config)]


HF_LAYOUTS = {
    "folder-safetensors": save_folder_safetensors,
    "folder-pytorch-bin": save_folder_pytorch_bin,
    "bare-safetensors-with-config": save_bare_safetensors,
}


def hf_greedy(model, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt, do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
    return out[0, prompt.size(1) :].tolist()


def manas_greedy(model, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    return [step.tokens[0] for step in generate(engine_of(model), prompt, Sampler(temperature=0.0), new_tokens)]


@pytest.mark.parametrize(
    ("layout", "activation"),
    [("folder-safetensors", "gelu_new"), ("folder-pytorch-bin", "gelu"), ("bare-safetensors-with-config", "gelu_new")],
)
def test_hf_gpt2_converts_to_the_same_logits_and_greedy_tokens(tmp_path, layout, activation):
    hf = tiny_hf_gpt2(activation)
    source_args = HF_LAYOUTS[layout](hf, tmp_path / "hf")
    dst = tmp_path / "converted.safetensors"

    assert_converted(run_manas("convert", *source_args, "--out", dst, "--tokenizer-file", GPT2_RANKS), dst)

    model = load_checkpoint(dst).model
    ids = torch.randint(0, GPT2_VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=0)
    prompt = ids[:1, :8]
    assert manas_greedy(model, prompt, 64) == hf_greedy(hf, prompt, 64)


# ---- nanoGPT ------------------------------------------------------------------------------------------------------


NANOGPT_ARGS = dict(n_layer=2, n_head=4, n_embd=32, block_size=24, dropout=0.0)


def nanogpt_state(bias: bool, seed: int = 0, vocab_size: int = GPT2_VOCAB) -> dict[str, torch.Tensor]:
    """A state dict named and shaped exactly as nanoGPT's GPT holds it (nn.Linear out×in, c_attn fused q|k|v,
    lm_head the same tensor as wte), with weights wide enough that GELU's tanh approximation visibly differs."""
    g = torch.Generator().manual_seed(seed)
    C, L, T = NANOGPT_ARGS["n_embd"], NANOGPT_ARGS["n_layer"], NANOGPT_ARGS["block_size"]

    def randn(*shape: int, std: float = 0.3) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    state = {"transformer.wte.weight": randn(vocab_size, C), "transformer.wpe.weight": randn(T, C)}
    linears = {"attn.c_attn": (3 * C, C), "attn.c_proj": (C, C), "mlp.c_fc": (4 * C, C), "mlp.c_proj": (C, 4 * C)}
    for i in range(L):
        prefix = f"transformer.h.{i}."
        for norm in ("ln_1", "ln_2"):
            state[prefix + norm + ".weight"] = 1 + randn(C, std=0.1)
        for name, shape in linears.items():
            state[prefix + name + ".weight"] = randn(*shape, std=1.2 / math.sqrt(shape[1]))
        if bias:
            for norm in ("ln_1", "ln_2"):
                state[prefix + norm + ".bias"] = randn(C, std=0.1)
            for name, shape in linears.items():
                state[prefix + name + ".bias"] = randn(shape[0], std=0.1)
    state["transformer.ln_f.weight"] = 1 + randn(C, std=0.1)
    if bias:
        state["transformer.ln_f.bias"] = randn(C, std=0.1)
    state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


def nanogpt_forward(state: dict[str, torch.Tensor], idx: torch.Tensor, n_head: int, gelu: str = "none") -> torch.Tensor:
    """nanoGPT's forward, written out from the raw state dict: explicit masked softmax attention, nn.GELU()
    (exact erf), LayerNorm eps 1e-5 with or without bias, logits through lm_head."""

    def p(name: str) -> torch.Tensor | None:
        return state.get(name)

    def norm(x, name):
        return F.layer_norm(x, x.shape[-1:], p(name + ".weight"), p(name + ".bias"), 1e-5)

    def linear(x, name):
        return F.linear(x, p(name + ".weight"), p(name + ".bias"))

    B, T = idx.shape
    x = p("transformer.wte.weight")[idx] + p("transformer.wpe.weight")[:T]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    layer = 0
    while f"transformer.h.{layer}.ln_1.weight" in state:
        h = f"transformer.h.{layer}."
        q, k, v = linear(norm(x, h + "ln_1"), h + "attn.c_attn").split(x.size(-1), dim=2)
        q, k, v = (t.view(B, T, n_head, -1).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        y = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + linear(y.transpose(1, 2).reshape(B, T, -1), h + "attn.c_proj")
        x = x + linear(F.gelu(linear(norm(x, h + "ln_2"), h + "mlp.c_fc"), approximate=gelu), h + "mlp.c_proj")
        layer += 1
    return F.linear(norm(x, "transformer.ln_f"), p("lm_head.weight"))


def save_nanogpt_checkpoint(path: Path, state: dict[str, torch.Tensor], compiled: bool = True, **model_args) -> None:
    """What nanoGPT's train.py writes: the (torch.compile'd, hence `_orig_mod.`-prefixed) model's state dict, the
    optimizer's, model_args, progress and the run's config of plain values."""
    derived = {"vocab_size": state["transformer.wte.weight"].size(0), "bias": "transformer.ln_f.bias" in state}
    args = {**NANOGPT_ARGS, **derived, **model_args}
    params = [t.clone().requires_grad_() for t in state.values()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    sum(p.sum() for p in params).backward()
    optimizer.step()
    prefix = "_orig_mod." if compiled else ""
    torch.save(
        {
            "model": {prefix + name: t for name, t in state.items()},
            "optimizer": optimizer.state_dict(),
            "model_args": args,
            "iter_num": 250,
            "best_val_loss": torch.tensor(1.4697),
            "config": {"dataset": "shakespeare_char", "learning_rate": 1e-3, "compile": compiled, "device": "cpu"},
        },
        path,
    )


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_nanogpt_checkpoint_converts_and_matches_an_independent_forward(tmp_path, bias):
    state = nanogpt_state(bias)
    save_nanogpt_checkpoint(tmp_path / "ckpt.pt", state)
    dst = tmp_path / "nano.safetensors"

    assert_converted(run_manas("convert", tmp_path / "ckpt.pt", "--out", dst, "--tokenizer-file", GPT2_RANKS), dst)

    model = load_checkpoint(dst).model
    assert model.config.bias is bias and model.config.gelu_approximate == "none"
    ids = torch.randint(0, GPT2_VOCAB, (2, NANOGPT_ARGS["block_size"]), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = nanogpt_forward(state, ids, NANOGPT_ARGS["n_head"])
        # the test can tell GELUs apart: tanh's approximation moves these logits by far more than the tolerance
        assert (nanogpt_forward(state, ids, NANOGPT_ARGS["n_head"], gelu="tanh") - expected).abs().max() > 1e-3
        torch.testing.assert_close(model(ids), expected, atol=1e-4, rtol=0)
    assert read_metadata(dst)["converted_from"] == "nanoGPT checkpoint"


def test_nanogpt_padded_vocabulary_converts_and_generates_only_real_tokens(tmp_path):
    state = nanogpt_state(bias=False, vocab_size=50304)  # nanoGPT rounds GPT-2's 50257 up to a multiple of 64
    state["transformer.wte.weight"][GPT2_VOCAB:] *= 40  # make the padded ids the model's favourites
    state["lm_head.weight"] = state["transformer.wte.weight"]
    save_nanogpt_checkpoint(tmp_path / "ckpt.pt", state)
    dst = tmp_path / "padded.safetensors"
    assert_converted(run_manas("convert", tmp_path / "ckpt.pt", "--out", dst, "--tokenizer-file", GPT2_RANKS), dst)
    assert load_checkpoint(dst).model.config.vocab_size == 50304

    for temperature in ("0", "1"):
        generated = run_manas(
            "generate",
            "-c",
            dst,
            "-p",
            "Hello",
            "-n",
            "8",
            "-t",
            temperature,
            "--seed",
            "1",
            "--json",
            "--threads",
            "1",
        )
        assert generated.returncode == 0, generated.stderr
        tokens = json.loads(generated.stdout)["tokens"]
        assert len(tokens) == 8 and max(tokens) < GPT2_VOCAB


def test_uncompiled_nanogpt_checkpoint_with_mask_buffers_converts(tmp_path):
    """Before flash attention, nanoGPT kept a causal mask `attn.bias` in the state dict, and without torch.compile
    there is no `_orig_mod.` prefix: the mask is not a weight, and the model is the same."""
    state = nanogpt_state(bias=True)
    T = NANOGPT_ARGS["block_size"]
    with_masks = state | {
        f"transformer.h.{i}.attn.bias": torch.tril(torch.ones(T, T)).view(1, 1, T, T)
        for i in range(NANOGPT_ARGS["n_layer"])
    }
    save_nanogpt_checkpoint(tmp_path / "ckpt.pt", with_masks, compiled=False)
    dst = tmp_path / "nano.safetensors"
    assert_converted(run_manas("convert", tmp_path / "ckpt.pt", "--out", dst, "--tokenizer-file", GPT2_RANKS), dst)
    ids = torch.arange(T).unsqueeze(0) * 97
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(dst).model(ids), nanogpt_forward(state, ids, 4), atol=1e-4, rtol=0)


# ---- tokenizers -------------------------------------------------------------------------------------------------

VARIED_TEXT = (
    "Hello world! It's 3.14159 — naïve café, 東京 and 🙂.\n\n\tdef f(x):  return x**2  # squares\n"
    "We'll see; I'd've thought   so... <html>&amp;</html> ÆØÅ Ω≈ç√∫ ½ x² \r\n"
)


def test_gpt2_tokenizer_file_gives_gpt2_ids_and_round_trips(tmp_path):
    save_nanogpt_checkpoint(tmp_path / "ckpt.pt", nanogpt_state(bias=False))
    dst = tmp_path / "nano.safetensors"
    assert_converted(run_manas("convert", tmp_path / "ckpt.pt", "--out", dst, "--tokenizer-file", GPT2_RANKS), dst)

    encoding = load_checkpoint(dst).encoding
    assert encoding.encode_ordinary("Hello world") == [15496, 995]  # GPT-2's published ids
    assert end_of_text_id(encoding) == 50256
    assert encoding.decode(encoding.encode_ordinary(VARIED_TEXT)) == VARIED_TEXT


def character_meta(text: str) -> dict:
    """nanoGPT's data/shakespeare_char/prepare.py meta: the sorted characters of the text."""
    chars = sorted(set(text))
    return {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}


def convert_character_model(tmp_path: Path, text: str) -> tuple[Path, dict]:
    """A nanoGPT character-level checkpoint over the characters of text, converted with its meta.pkl."""
    meta = character_meta(text)
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps(meta))
    save_nanogpt_checkpoint(tmp_path / "ckpt.pt", nanogpt_state(bias=False, vocab_size=meta["vocab_size"]))
    dst = tmp_path / "char.safetensors"
    assert_converted(
        run_manas("convert", tmp_path / "ckpt.pt", "--out", dst, "--tokenizer-meta", tmp_path / "meta.pkl"), dst
    )
    return dst, meta


def test_character_level_meta_pkl_encodes_exactly_as_nanogpt(tmp_path):
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak. Ça va? naïve — ok!\n"
    dst, meta = convert_character_model(tmp_path, text)

    encoding = load_checkpoint(dst).encoding
    nanogpt_ids = [meta["stoi"][c] for c in text]
    assert encoding.encode_ordinary(text) == nanogpt_ids  # one id per character, never merged, multi-byte ones too
    assert encoding.decode(nanogpt_ids) == "".join(meta["itos"][i] for i in nanogpt_ids) == text
    assert encoding.max_token_value == meta["vocab_size"] - 1  # no <|endoftext|>: nanoGPT's char models have none


def test_character_level_model_generates_and_names_characters_outside_its_vocabulary(tmp_path):
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
    dst, _ = convert_character_model(tmp_path, text)

    generated = run_manas("generate", "-c", dst, "-p", "First", "-n", "12", "-t", "0", "--json", "--threads", "1")
    assert generated.returncode == 0, generated.stderr
    record = json.loads(generated.stdout)
    assert record["generated_tokens"] == 12 and set(record["text"]) <= set(text)

    for prompt, named in (("Zebra", "'Z'"), ("", "<|endoftext|>")):
        refused = run_manas("generate", "-c", dst, "-p", prompt, "-n", "2", "--threads", "1")
        assert_refused(refused, named)


# ---- refusals ---------------------------------------------------------------------------------------------------


class RunsCode:
    """A pickle payload that would create a marker file if it were ever unpickled by a trusting loader."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def setup_malicious_checkpoint(tmp: Path) -> list:
    torch.save({"model_args": NANOGPT_ARGS, "model": {}, "payload": RunsCode(tmp / "PWNED")}, tmp / "ckpt.pt")
    return ["convert", tmp / "ckpt.pt", "--out", tmp / "out.safetensors", "--tokenizer-file", GPT2_RANKS]


def setup_malicious_meta(tmp: Path) -> list:
    save_nanogpt_checkpoint(tmp / "ckpt.pt", nanogpt_state(bias=False, vocab_size=10))
    (tmp / "meta.pkl").write_bytes(
        pickle.dumps({"stoi": {"a": 0}, "itos": {0: "a"}, "payload": RunsCode(tmp / "PWNED")})
    )
    return ["convert", tmp / "ckpt.pt", "--out", tmp / "out.safetensors", "--tokenizer-meta", tmp / "meta.pkl"]


def setup_existing_destination(tmp: Path) -> list:
    save_nanogpt_checkpoint(tmp / "ckpt.pt", nanogpt_state(bias=False, vocab_size=SMALL_VOCAB))
    (tmp / "out.safetensors").write_bytes(b"precious")
    return ["convert", tmp / "ckpt.pt", "--out", tmp / "out.safetensors", "--tokenizer-file", GPT2_RANKS]


def setup_character_model_without_meta(tmp: Path) -> list:
    save_nanogpt_checkpoint(tmp / "ckpt.pt", nanogpt_state(bias=False, vocab_size=65))
    return ["convert", tmp / "ckpt.pt", "--out", tmp / "out.safetensors", "--tokenizer-file", GPT2_RANKS]


def setup_multi_character_meta(tmp: Path) -> list:
    save_nanogpt_checkpoint(tmp / "ckpt.pt", nanogpt_state(bias=False, vocab_size=10))
    (tmp / "meta.pkl").write_bytes(pickle.dumps({"stoi": {"a": 0, "th": 1}, "itos": {0: "a", 1: "th"}}))
    return ["convert", tmp / "ckpt.pt", "--out", tmp / "out.safetensors", "--tokenizer-meta", tmp / "meta.pkl"]


def setup_untied_head(tmp: Path) -> list:
    state = nanogpt_state(bias=False, vocab_size=SMALL_VOCAB)
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    save_nanogpt_checkpoint(tmp / "ckpt.pt", state)
    return with_fitting_tokenizer(tmp)


def with_fitting_tokenizer(tmp: Path) -> list:
    """convert of tmp/ckpt.pt with a character vocabulary the model's ids cover: the tokenizer, checked before any
    weights are read, passes, and what is wrong with the weights is what is refused."""
    (tmp / "meta.pkl").write_bytes(pickle.dumps(character_meta("abc")))
    return ["convert", tmp / "ckpt.pt", "--out", tmp / "out.safetensors", "--tokenizer-meta", tmp / "meta.pkl"]


def setup_model_args_disagreeing_with_tensors(tmp: Path) -> list:
    save_nanogpt_checkpoint(tmp / "ckpt.pt", nanogpt_state(bias=False, vocab_size=SMALL_VOCAB), n_embd=64)
    return with_fitting_tokenizer(tmp)


def setup_bias_flag_disagreeing_with_tensors(tmp: Path) -> list:
    save_nanogpt_checkpoint(tmp / "ckpt.pt", nanogpt_state(bias=False, vocab_size=SMALL_VOCAB), bias=True)
    return with_fitting_tokenizer(tmp)


def setup_bare_safetensors_without_config(tmp: Path) -> list:
    tiny_hf_gpt2(vocab_size=SMALL_VOCAB).save_pretrained(tmp / "hf")
    return [
        "convert",
        tmp / "hf" / "model.safetensors",
        "--out",
        tmp / "out.safetensors",
        "--tokenizer-file",
        GPT2_RANKS,
    ]


def setup_hf_config_of(**changes) -> Callable[[Path], list]:
    def setup(tmp: Path) -> list:
        tiny_hf_gpt2(vocab_size=SMALL_VOCAB).save_pretrained(tmp / "hf")
        config = json.loads((tmp / "hf" / "config.json").read_text()) | changes
        (tmp / "hf" / "config.json").write_text(json.dumps(config))
        return ["convert", tmp / "hf", "--out", tmp / "out.safetensors", "--tokenizer-file", GPT2_RANKS]

    return setup


def setup_folder_without_weights(tmp: Path) -> list:
    (tmp / "hf").mkdir()
    tiny_hf_gpt2(vocab_size=SMALL_VOCAB).config.to_json_file(tmp / "hf" / "config.json")
    return ["convert", tmp / "hf", "--out", tmp / "out.safetensors", "--tokenizer-file", GPT2_RANKS]


def setup_manas_checkpoint_as_source(tmp: Path) -> list:
    from conftest import make_model

    save_checkpoint(tmp / "model.safetensors", make_model(), bpe_spec({bytes([i]): i for i in range(256)}))
    return ["convert", tmp / "model.safetensors", "--out", tmp / "out.safetensors", "--tokenizer-file", GPT2_RANKS]


def setup_not_a_checkpoint(tmp: Path) -> list:
    (tmp / "ckpt.pt").write_text("to be or not to be\n")
    return ["convert", tmp / "ckpt.pt", "--out", tmp / "out.safetensors", "--tokenizer-file", GPT2_RANKS]


def setup_two_tokenizers(tmp: Path) -> list:
    save_nanogpt_checkpoint(tmp / "ckpt.pt", nanogpt_state(bias=False, vocab_size=SMALL_VOCAB))
    (tmp / "meta.pkl").write_bytes(pickle.dumps(character_meta("abc")))
    return [
        "convert",
        tmp / "ckpt.pt",
        "--out",
        tmp / "out.safetensors",
        "--tokenizer-file",
        GPT2_RANKS,
        "--tokenizer-meta",
        tmp / "meta.pkl",
    ]


def setup_unknown_tokenizer(tmp: Path) -> list:
    save_nanogpt_checkpoint(tmp / "ckpt.pt", nanogpt_state(bias=False, vocab_size=SMALL_VOCAB))
    return ["convert", tmp / "ckpt.pt", "--out", tmp / "out.safetensors", "--tokenizer", "llama"]


REFUSALS = {
    "pickle-that-runs-code": (setup_malicious_checkpoint, "refused: its pickle would run code (posix.system)"),
    "meta-pkl-that-runs-code": (setup_malicious_meta, "refused: it refers to posix.system and would run code"),
    "existing-destination": (setup_existing_destination, "out.safetensors exists: pass --force to overwrite it"),
    "character-model-without-meta": (setup_character_model_without_meta, "needs its --tokenizer-meta meta.pkl"),
    "multi-character-token": (setup_multi_character_meta, "token 'th' is not a single character"),
    "untied-lm-head": (setup_untied_head, "lm_head.weight differs from the token embedding"),
    "wrong-shape": (setup_model_args_disagreeing_with_tensors, "the config needs [96, 64]"),
    "bias-flag-without-biases": (
        setup_bias_flag_disagreeing_with_tensors,
        "missing tensor for blocks.0.ln_attention.bias",
    ),
    "bare-weights-without-config": (setup_bare_safetensors_without_config, "pass --config PATH"),
    "not-gpt2": (
        setup_hf_config_of(model_type="gpt_neox"),
        "model_type is 'gpt_neox'; convert reads 'gpt2', 'starcoder2', 'llama', 'qwen2', 'qwen3', 'smollm3', "
        "'mistral', 'gemma3_text'",
    ),
    "layer-scaled-attention": (
        setup_hf_config_of(scale_attn_by_inverse_layer_idx=True),
        "scale_attn_by_inverse_layer_idx=True has no manas equivalent",
    ),
    "relu": (setup_hf_config_of(activation_function="relu"), "activation_function 'relu' is not supported"),
    "folder-without-weights": (
        setup_folder_without_weights,
        "holds neither model.safetensors, model.safetensors.index.json nor pytorch_model.bin",
    ),
    "already-manas": (setup_manas_checkpoint_as_source, "is already a manas checkpoint"),
    "not-a-checkpoint": (setup_not_a_checkpoint, "not a readable PyTorch checkpoint"),
    "two-tokenizers": (setup_two_tokenizers, "both name a tokenizer: pass one of them"),
    "unknown-tokenizer": (setup_unknown_tokenizer, "--tokenizer must be 'gpt2'"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_convert_refuses_with_one_clear_error_line(tmp_path, case):
    setup, message = REFUSALS[case]
    args = setup(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}

    assert_refused(run_manas(*args), message)

    assert not (tmp_path / "PWNED").exists()  # no pickled code ever ran
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert after == before  # nothing written, nothing overwritten


def test_without_tokenizer_file_or_tiktoken_cache_convert_uses_the_shipped_gpt2_ranks(tmp_path):
    """Issue 32, item 14: GPT-2's ranks ship inside the package, so the named encoding needs no download."""
    save_nanogpt_checkpoint(tmp_path / "ckpt.pt", nanogpt_state(bias=False))
    (tmp_path / "cache").mkdir()
    # an empty tiktoken cache, and a proxy that refuses every connection: a download would fail, here and online
    offline = {"TIKTOKEN_CACHE_DIR": str(tmp_path / "cache"), "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}

    result = run_manas("convert", tmp_path / "ckpt.pt", "--out", tmp_path / "out.safetensors", env=offline)
    assert result.returncode == 0, result.stderr
    assert load_checkpoint(tmp_path / "out.safetensors").tokenizer_spec == {"kind": "tiktoken", "encoding": "gpt2"}
    run = run_manas("generate", "-c", tmp_path / "out.safetensors", "Hello", "-n", "3", "--device", "cpu", env=offline)
    assert run.returncode == 0, run.stderr


def test_force_replaces_an_existing_destination(tmp_path):
    save_nanogpt_checkpoint(tmp_path / "ckpt.pt", nanogpt_state(bias=False))
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"an older file")
    assert_converted(
        run_manas("convert", tmp_path / "ckpt.pt", "--out", dst, "--tokenizer-file", GPT2_RANKS, "--force"), dst
    )
    assert load_checkpoint(dst).model.config.n_embd == NANOGPT_ARGS["n_embd"]
    assert decode_ranks(json.loads(read_metadata(dst)["tokenizer"])["ranks"])[b"Hello"] == 15496
