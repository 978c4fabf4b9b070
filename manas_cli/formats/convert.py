"""Weights trained elsewhere, as manas checkpoints: nanoGPT's ckpt.pt and Hugging Face GPT-2 and Starcoder2 folders.

nanoGPT kept GPT-2's tensor names, so one table maps both onto manas' names. The differences are layout
(Hugging Face's Conv1D stores linear weights in×out, nanoGPT's nn.Linear out×in as manas does), prefixes
(torch.compile's `_orig_mod.`, GPT2LMHeadModel's `transformer.`) and the GELU each was trained with.
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from . import starcoder2
from .checkpoint import is_pytorch_file
from ..errors import CheckpointError, InputError, TokenizerError, first_line
from ..files import check_output_file
from ..engine.model import GPT, GPTConfig, parameter_shapes
from .tokenizer import (
    bpe_spec, build_encoding, checked_spec, spec_from_hf_files, spec_from_tiktoken_file, spec_from_tokenizer_json,
    vocabulary_size,
)

# Inside transformer.h.N: GPT-2's module names (nanoGPT's too) and manas' inside blocks.N.
GPT2_BLOCK_MODULES = {
    "ln_1": "ln_attention",
    "attn.c_attn": "attention.qkv",  # fused q|k|v in both, in that order
    "attn.c_proj": "attention.output",
    "ln_2": "ln_ffn",
    "mlp.c_fc": "ffn.up",
    "mlp.c_proj": "ffn.down",
}
GPT2_TOP_MODULES = {"wte": "token_embedding", "wpe": "position_embedding", "ln_f": "final_norm"}
GPT2_LINEAR_MODULES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# Causal masks that older nanoGPT (no flash attention) and older transformers saved as buffers: not weights.
GPT2_MASK_BUFFERS = ("attn.bias", "attn.masked_bias")
TIED_HEAD = "lm_head.weight"

# Hugging Face's activation_function values that manas computes exactly, as F.gelu's `approximate`.
HF_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}

# nanoGPT's character-level encoding looks each character up alone: one piece per character, newlines included.
CHARACTER_PAT_STR = r"(?s:.)"

NANOGPT = "nanoGPT checkpoint"
HF_FOLDER = "Hugging Face {} folder"  # formatted with the architecture read
HF_WEIGHTS = "Hugging Face {} weights"


@dataclass
class Converted:
    """What convert wrote, for the CLI to report."""

    source_kind: str
    config: GPTConfig
    parameters: int
    tokenizer: str


# --- tensor names -----------------------------------------------------------------------------------------------


def manas_name(gpt2_name: str) -> str | None:
    """GPT-2's name (without prefixes) of a tensor → manas' name; None for mask buffers; KeyError if unknown."""
    if gpt2_name.startswith("h."):
        _, index, rest = gpt2_name.split(".", 2)
        if rest in GPT2_MASK_BUFFERS:
            return None
        module, _, kind = rest.rpartition(".")
        return f"blocks.{index}.{GPT2_BLOCK_MODULES[module]}.{kind}"
    module, _, kind = gpt2_name.rpartition(".")
    return f"{GPT2_TOP_MODULES[module]}.{kind}"


def gpt2_name(name: str) -> str:
    """manas' name of a tensor → GPT-2's (without prefixes): the inverse of manas_name."""
    if name.startswith("blocks."):
        _, index, rest = name.split(".", 2)
        module, _, kind = rest.rpartition(".")
        return f"h.{index}.{_inverse(GPT2_BLOCK_MODULES)[module]}.{kind}"
    module, _, kind = name.rpartition(".")
    return f"{_inverse(GPT2_TOP_MODULES)[module]}.{kind}"


def is_gpt2_linear_weight(gpt2_name: str) -> bool:
    """Weights that Hugging Face's Conv1D stores transposed (in×out)."""
    return gpt2_name.endswith(".weight") and gpt2_name.split(".", 2)[-1].removesuffix(".weight") in GPT2_LINEAR_MODULES


def _inverse(mapping: dict[str, str]) -> dict[str, str]:
    return {value: key for key, value in mapping.items()}


def gpt2_state_to_manas(state: dict[str, torch.Tensor], *, conv1d: bool, source: Path) -> dict[str, torch.Tensor]:
    """Rename (and, from Conv1D, transpose) a GPT-2-named state dict; the tied lm_head must equal the embedding."""
    renamed: dict[str, torch.Tensor] = {}
    head = None
    for name, tensor in state.items():
        bare = name.removeprefix("_orig_mod.").removeprefix("transformer.")
        if bare == TIED_HEAD:
            head = tensor
            continue
        try:
            target = manas_name(bare)
        except (KeyError, ValueError):
            raise CheckpointError(f"{source}: unexpected tensor {name}: not part of a GPT-2 model") from None
        if target is None:
            continue
        renamed[target] = tensor.t() if conv1d and is_gpt2_linear_weight(bare) else tensor
    check_tied_head(head, renamed.get("token_embedding.weight"), source)
    return renamed


def check_tied_head(head: torch.Tensor | None, embedding: torch.Tensor | None, source: Path) -> None:
    if head is not None and embedding is not None and not torch.equal(head, embedding):
        raise CheckpointError(
            f"{source}: lm_head.weight differs from the token embedding; manas ties the two (as GPT-2 and "
            "Starcoder2 do), so a model with an untied output layer cannot be converted exactly"
        )


def build_model(config: GPTConfig, state: dict[str, torch.Tensor], source: Path) -> GPT:
    """A float32 manas model holding exactly the given tensors: every one present, none extra, shapes matching, each
    real floating-point. Checked before the model is built, so its size is backed by the source's tensors."""
    expected = set()
    for name, shape in parameter_shapes(config):
        if name not in state:
            raise CheckpointError(f"{source}: missing tensor for {name} (shape {list(shape)})")
        tensor = state[name]
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"{source}: tensor for {name} has shape {list(tensor.shape)}, the config needs {list(shape)}")
        if not tensor.is_floating_point():  # complex too: copying it into a float32 weight drops the imaginary part
            raise CheckpointError(f"{source}: tensor for {name} is {tensor.dtype}, not a real floating-point tensor")
        expected.add(name)
    if extra := sorted(set(state) - expected):
        raise CheckpointError(f"{source}: tensor for {extra[0]} does not fit this config (bias={config.bias})")
    model = GPT(config)  # a real init costs less than the meta device, whose first use imports torch._dynamo
    model.load_state_dict(state, strict=False)  # copies into float32 parameters; lm_head stays tied
    return model.eval()


# --- reading files without running code ----------------------------------------------------------------------------


def load_pickled_weights(path: Path) -> object:
    """torch.load with weights only: tensors and plain values load, a pickle that would run code is refused. A zip
    checkpoint's tensors are memory-mapped, not read, so their shapes are checked against the config before any
    data is touched; a compressed entry (torch.save never writes one) is refused, as its size is not the file's."""
    _refuse_compressed_entries(path)
    with path.open("rb") as f:
        if not is_pytorch_file(f.read(8)):
            raise CheckpointError(f"{path}: not a readable PyTorch checkpoint: it is neither the zip archive "
                                  "torch.save writes nor a pickle; pass nanoGPT's ckpt.pt, or a Hugging Face folder "
                                  "or its model.safetensors")
    try:
        with quiet_warnings():  # torch warns about legacy (non-zip) checkpoints on stderr
            return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as exc:
        # torch's message is long and holds ANSI codes; the global it refused is what the user needs to know.
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if not found:  # not a pickle at all (random bytes)
            raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({first_line(exc)})") from None
        raise CheckpointError(
            f"{path}: refused: its pickle would run code ({found.group(1)}); manas loads weights only and never runs "
            "code from a file. nanoGPT's and Hugging Face's checkpoints hold only tensors and plain values"
        ) from None
    except Exception as exc:  # torch reports garbage as any of RuntimeError, EOFError, IndexError, KeyError...
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({first_line(exc)})") from None


def _refuse_compressed_entries(path: Path) -> None:
    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            compressed = [info.filename for info in archive.infolist() if info.compress_type != zipfile.ZIP_STORED]
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({first_line(exc)})") from None
    if compressed:
        raise CheckpointError(
            f"{path}: {compressed[0]} is compressed inside the archive; torch.save never compresses, and manas does "
            "not inflate what the file's size does not bound: re-save it with torch.save"
        )


@contextmanager
def quiet_warnings() -> Iterator[None]:
    """No library's warning text reaches the user's stderr: what matters becomes an error or nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        with quiet_warnings():
            return load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({first_line(exc)})") from None



class _CodeInPickle(pickle.UnpicklingError):
    """The pickle named a class or function: loading it would run code."""


class _PlainDataUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, strings and numbers only: every class or function lookup is refused, so no code
    runs (a pickle can only call what find_class hands it)."""

    def find_class(self, module: str, name: str):
        raise _CodeInPickle(f"{module}.{name}")


def read_plain_pickle(path: Path) -> object:
    try:
        with open(path, "rb") as f:
            return _PlainDataUnpickler(f).load()
    except FileNotFoundError:
        raise InputError(f"{path} does not exist") from None
    except _CodeInPickle as exc:
        raise TokenizerError(
            f"{path}: refused: it refers to {exc} and would run code; nanoGPT's meta.pkl holds only plain dicts, "
            "strings and numbers"
        ) from None
    except (pickle.UnpicklingError, EOFError, OSError, ValueError, IndexError, KeyError, TypeError, AttributeError) as exc:
        raise TokenizerError(f"{path}: not a readable pickle ({first_line(exc)})") from None


# --- configs ---------------------------------------------------------------------------------------------------------


def config_from_nanogpt(model_args: object, source: Path) -> GPTConfig:
    """nanoGPT's model_args; its MLP is nn.GELU(), the exact erf GELU."""
    if not isinstance(model_args, dict):
        raise CheckpointError(f"{source}: model_args is a {type(model_args).__name__}, not nanoGPT's dict")
    keys = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")
    if missing := [key for key in keys if key not in model_args]:
        raise CheckpointError(f"{source}: model_args lacks {', '.join(missing)}")
    field = _typed_field(model_args, source, "model_args.")
    return _make_config(
        source, **{key: field(key, int) for key in keys}, bias=field("bias", bool, True),
        dropout=field("dropout", float, 0.0), gelu_approximate="none",
    )


def config_from_hf(values: object, source: Path) -> GPTConfig:
    """A Hugging Face GPT-2 (or Starcoder2) config.json, refusing the options manas does not compute."""
    if not isinstance(values, dict):
        raise CheckpointError(f"{source}: not a JSON object")
    if values.get("model_type") == starcoder2.MODEL_TYPE:
        return config_from_starcoder2(values, source)
    if values.get("model_type") != "gpt2":
        raise CheckpointError(
            f"{source}: model_type is {values.get('model_type')!r}; convert reads GPT-2 models (model_type 'gpt2') "
            "and Starcoder2 models (model_type 'starcoder2') only"
        )
    activation = values.get("activation_function", "gelu_new")
    if activation not in HF_ACTIVATIONS:
        raise CheckpointError(f"{source}: activation_function {activation!r} is not supported (only {', '.join(HF_ACTIVATIONS)})")
    field = _typed_field(values, source)
    n_embd = field("n_embd", int, 768)
    unsupported = {
        "n_inner": values.get("n_inner") not in (None, 4 * n_embd),
        "scale_attn_weights": values.get("scale_attn_weights", True) is not True,
        "scale_attn_by_inverse_layer_idx": values.get("scale_attn_by_inverse_layer_idx", False) is not False,
        "add_cross_attention": values.get("add_cross_attention", False) is not False,
    }
    if changed := [name for name, differs in unsupported.items() if differs]:
        raise CheckpointError(f"{source}: {changed[0]}={values[changed[0]]!r} has no manas equivalent")
    return _make_config(
        source,
        vocab_size=field("vocab_size", int, 50257), block_size=field("n_positions", int, 1024),
        n_layer=field("n_layer", int, 12), n_head=field("n_head", int, 12), n_embd=n_embd,
        norm_eps=field("layer_norm_epsilon", float, 1e-5), dropout=field("resid_pdrop", float, 0.0),
        gelu_approximate=HF_ACTIVATIONS[activation],
    )


STARCODER2_SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def config_from_starcoder2(values: dict, source: Path) -> GPTConfig:
    """A Hugging Face Starcoder2 config.json (starcoder2.py maps its tensors), refusing every option whose
    computation differs from manas'."""
    activation = values.get("hidden_act", "gelu_pytorch_tanh")
    if activation not in starcoder2.ACTIVATIONS:
        raise CheckpointError(f"{source}: hidden_act {activation!r} is not supported (only {', '.join(starcoder2.ACTIVATIONS)})")
    # The shape has no sensible default: one missing would be blamed on a field checked against it.
    if missing := [key for key in STARCODER2_SHAPE_FIELDS if key not in values]:
        raise CheckpointError(f"{source}: the Starcoder2 config lacks {', '.join(missing)}")
    rope = values.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{source}: rope_parameters must be an object of rope_type and rope_theta, got {rope!r}")
    field, rope_field = _typed_field(values, source), _typed_field(rope, source, "rope_parameters.")
    config = _make_config(
        source, position_encoding="rope",
        vocab_size=field("vocab_size", int, 49152), block_size=field("max_position_embeddings", int, 4096),
        n_layer=field("num_hidden_layers", int, 30), n_head=field("num_attention_heads", int, 24),
        n_kv_head=field("num_key_value_heads", int, 2), n_embd=field("hidden_size", int, 3072),
        # transformers 5 spells it rope_parameters.rope_theta, 4.x (and vLLM, TGI) rope_theta
        rope_base=rope_field("rope_theta", float, field("rope_theta", float, 10000.0)),
        norm_eps=field("norm_epsilon", float, 1e-5), dropout=field("residual_dropout", float, 0.0),
        gelu_approximate=starcoder2.ACTIVATIONS[activation],
    )
    window = values.get("sliding_window")
    unsupported = {
        "intermediate_size": values.get("intermediate_size", 12288) != 4 * config.n_embd,
        "use_bias": values.get("use_bias", True) is not True,
        "tie_word_embeddings": values.get("tie_word_embeddings", True) is not True,
        # a window as long as the context masks nothing
        "sliding_window": window is not None and not (type(window) is int and window >= config.block_size),
        "head_dim": values.get("head_dim") not in (None, config.head_size),
        "rope_scaling": values.get("rope_scaling") is not None,
        "rope_parameters": rope.get("rope_type", "default") != "default" or not set(rope) <= {"rope_type", "rope_theta"},
    }
    if changed := [name for name, differs in unsupported.items() if differs]:
        name = changed[0]
        shown = f"{name}={values[name]!r}" if name in values else f"{name} (Starcoder2's default)"
        raise CheckpointError(f"{source}: {shown} has no manas equivalent")
    return config


def _typed_field(values: dict, source: Path, prefix: str = ""):
    """A reader of values[key] (or a default) that is exactly of its type (a bool is not an int, a string not a
    bool; an int is a float), naming the field otherwise."""

    def field(key: str, kind: type, default: object = None) -> object:
        value = values.get(key, default)
        valid = isinstance(value, (int, float) if kind is float else kind) and (kind is bool or not isinstance(value, bool))
        if not valid:
            raise CheckpointError(f"{source}: {prefix}{key} must be {'an' if kind is int else 'a'} {kind.__name__}, got {value!r}")
        return value

    return field


def _make_config(source: Path, position_encoding: str = "learned", **values) -> GPTConfig:
    try:
        return GPTConfig(position_encoding=position_encoding, **values)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{source}: invalid model shape: {exc}") from None


def read_hf_config(path: Path) -> GPTConfig:
    """A config.json read and checked, its errors naming it, before any weights are loaded."""
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path} does not exist") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: not a readable JSON config ({first_line(exc)})") from None
    return config_from_hf(values, path)


# --- sources -----------------------------------------------------------------------------------------------------------


def load_source(src: Path, config_path: Path | None) -> tuple[str, GPT]:
    """Detect what src is and return (its kind, the equivalent manas model)."""
    check_source(src)
    if src.is_dir():
        if config_path is not None:
            raise InputError(f"{src} is a folder with its own config.json; --config is for a bare model.safetensors")
        return _hf_kind(HF_FOLDER, _load_hf_folder(src))
    if src.suffix == ".safetensors":
        config = _require_config(src, config_path)
        return _hf_kind(HF_WEIGHTS, _load_hf(load_safetensors(src), src, config))
    loaded = load_pickled_weights(src)
    if isinstance(loaded, dict) and "model_args" in loaded and "model" in loaded:
        if config_path is not None:
            raise InputError(f"{src} is a nanoGPT checkpoint with its own model_args; --config is for a bare model.safetensors")
        return NANOGPT, _load_nanogpt(loaded, src)
    if isinstance(loaded, dict) and loaded and all(isinstance(t, torch.Tensor) for t in loaded.values()):
        return _hf_kind(HF_WEIGHTS, _load_hf(loaded, src, _require_config(src, config_path)))
    raise CheckpointError(
        f"{src}: neither a nanoGPT checkpoint (a dict with 'model_args' and 'model') nor a state dict of tensors"
    )


# What convert reads from a Hugging Face folder.
HF_CONFIG, HF_SAFETENSORS, HF_PICKLE = "config.json", "model.safetensors", "pytorch_model.bin"
HF_VOCAB, HF_MERGES, HF_TOKENIZER = "vocab.json", "merges.txt", "tokenizer.json"


def source_files(src: Path) -> tuple[Path, ...]:
    """Every file convert may read from src: src itself, or the files it reads inside a folder."""
    names = (HF_CONFIG, HF_SAFETENSORS, HF_PICKLE, HF_VOCAB, HF_MERGES, HF_TOKENIZER)
    return tuple(src / name for name in names) if src.is_dir() else (src,)


def _load_hf_folder(folder: Path) -> GPT:
    config_path = folder / HF_CONFIG
    if not config_path.is_file():
        raise InputError(f"{folder} has no {HF_CONFIG}: not a Hugging Face model folder")
    config = read_hf_config(config_path)
    if (folder / HF_SAFETENSORS).is_file():
        return _load_hf(load_safetensors(folder / HF_SAFETENSORS), folder, config)
    if (folder / HF_PICKLE).is_file():
        state = load_pickled_weights(folder / HF_PICKLE)
        if not isinstance(state, dict):
            raise CheckpointError(f"{folder / HF_PICKLE}: not a state dict")
        return _load_hf(state, folder, config)
    raise InputError(f"{folder} holds neither model.safetensors nor pytorch_model.bin (sharded weights are not supported)")


def _hf_kind(template: str, model: GPT) -> tuple[str, GPT]:
    """(the source's kind, the model): a rope model can only have come from a Starcoder2 folder."""
    return template.format("Starcoder2" if model.config.position_encoding == "rope" else "GPT-2"), model


def _load_hf(state: dict[str, torch.Tensor], source: Path, config: GPTConfig) -> GPT:
    if config.position_encoding == "rope":
        weights = {name: tensor for name, tensor in state.items() if name != TIED_HEAD}
        renamed = starcoder2.state_to_manas(weights, config, source)
        check_tied_head(state.get(TIED_HEAD), renamed.get("token_embedding.weight"), source)
        return build_model(config, renamed, source)
    return build_model(config, gpt2_state_to_manas(state, conv1d=True, source=source), source)


def _load_nanogpt(checkpoint: dict, source: Path) -> GPT:
    config = config_from_nanogpt(checkpoint["model_args"], source)
    state = checkpoint["model"]
    if not isinstance(state, dict):
        raise CheckpointError(f"{source}: 'model' is a {type(state).__name__}, not a state dict")
    return build_model(config, gpt2_state_to_manas(state, conv1d=False, source=source), source)


def _require_config(src: Path, config_path: Path | None) -> GPTConfig:
    if config_path is None:
        raise InputError(f"{src} holds bare weights: pass --config PATH, the Hugging Face GPT-2 config.json that goes with them")
    return read_hf_config(config_path)


def check_source(src: Path) -> None:
    """The refusals that need no weights loaded: run before anything slow."""
    if not src.exists():
        raise InputError(f"{src} does not exist")
    if src.suffix == ".safetensors" and src.is_file():
        _refuse_manas_checkpoint(src)


def _refuse_manas_checkpoint(src: Path) -> None:
    from safetensors import safe_open

    from .checkpoint import FORMAT

    try:
        with safe_open(src, framework="pt") as f:
            is_manas = (f.metadata() or {}).get("format") == FORMAT
    except Exception:  # unreadable files get a precise message when their tensors are loaded
        return
    if is_manas:
        raise InputError(f"{src} is already a manas checkpoint: nothing to convert")


# --- tokenizers ----------------------------------------------------------------------------------------------------


def folder_tokenizer(src: Path) -> tuple[str, dict] | None:
    """A Hugging Face folder's own GPT-2 tokenizer files, when they split text as GPT-2 does: vocab.json and
    merges.txt of a GPT-2 model, or of any without a tokenizer.json (whose own pre-tokenizer could split otherwise,
    as Starcoder2's does); else a tokenizer.json alone (transformers 5 saves no other), which says how it splits.
    None to fall back to --tokenizer-file or tiktoken's cache."""
    vocab, merges, combined = src / HF_VOCAB, src / HF_MERGES, src / HF_TOKENIZER
    if not src.is_dir():
        return None
    if vocab.is_file() and merges.is_file():
        if combined.is_file() and _model_type(src / HF_CONFIG) != "gpt2":
            return None
        texts = _tokenizer_text(vocab, src), _tokenizer_text(merges, src)
        return f"GPT-2's BPE from {src}'s vocab.json and merges.txt (embedded)", spec_from_hf_files(*texts, src)
    if combined.is_file():
        spec = spec_from_tokenizer_json(_tokenizer_text(combined, src), src)
        return f"GPT-2's BPE from {src}'s tokenizer.json (embedded)", spec
    return None


# Tokenizer files are a few MB (GPT-2's vocab.json 1 MB, a 150,000-token tokenizer.json 11 MB): a larger one is
# refused before it is parsed, as its tokens would take memory out of proportion to it.
MAX_TOKENIZER_FILE_BYTES = 64 * 2**20


def _tokenizer_text(path: Path, src: Path) -> str:
    try:
        if path.stat().st_size > MAX_TOKENIZER_FILE_BYTES:
            raise TokenizerError(f"{path} is over {MAX_TOKENIZER_FILE_BYTES // 2**20} MiB: not a tokenizer file "
                                 "manas reads")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"cannot read the tokenizer files of {src}: {first_line(exc)}") from None


def _model_type(config: Path) -> object:
    try:
        values = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None  # read_hf_config names what is wrong with it
    return values.get("model_type") if isinstance(values, dict) else None


def tokenizer_spec(tokenizer: str, tokenizer_file: Path | None, tokenizer_meta: Path | None) -> tuple[str, dict]:
    """(a description, the checkpoint's tokenizer spec) from --tokenizer, --tokenizer-file, --tokenizer-meta."""
    if tokenizer_meta is not None:
        if tokenizer_file is not None:
            raise InputError("--tokenizer-file and --tokenizer-meta both name a tokenizer: pass one of them")
        return f"the character-level vocabulary of {tokenizer_meta}", character_spec(read_plain_pickle(tokenizer_meta), tokenizer_meta)
    if tokenizer != "gpt2":
        raise InputError(f"--tokenizer must be 'gpt2' (or use --tokenizer-meta for a character-level meta.pkl), got {tokenizer!r}")
    if tokenizer_file is not None:
        if not tokenizer_file.is_file():
            raise InputError(f"--tokenizer-file {tokenizer_file} does not exist")
        return f"GPT-2's BPE from {tokenizer_file} (embedded)", spec_from_tiktoken_file(tokenizer_file)
    named = {"kind": "tiktoken", "encoding": "gpt2"}
    try:
        build_encoding(named)
    except TokenizerError:
        raise TokenizerError(
            "GPT-2's tokenizer is not in tiktoken's cache and cannot be downloaded here: pass its ranks file with "
            "--tokenizer-file PATH (a .tiktoken file such as gpt2.tiktoken), or --tokenizer-meta meta.pkl for a "
            "character-level nanoGPT model"
        ) from None
    return "tiktoken's named encoding gpt2", named


def character_spec(meta: object, source: Path) -> dict:
    """nanoGPT's character-level meta.pkl as an exactly equivalent tokenizer: each character's UTF-8 bytes are one
    token whose id is nanoGPT's, and the split pattern hands the BPE one character at a time, so no merge ever
    happens. It has no <|endoftext|>: nanoGPT's character models have none."""
    if not isinstance(meta, dict) or not isinstance(meta.get("stoi"), dict):
        raise TokenizerError(f"{source}: not nanoGPT's character-level meta.pkl (no 'stoi' dict of characters to ids)")
    stoi, itos = meta["stoi"], meta.get("itos")
    ranks: dict[bytes, int] = {}
    for char, index in stoi.items():
        if not isinstance(char, str) or len(char) != 1:
            raise TokenizerError(f"{source}: token {char!r} is not a single character; only character-level vocabularies convert")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise TokenizerError(f"{source}: character {char!r} has id {index!r}, not a non-negative integer")
        if itos is not None and (not isinstance(itos, dict) or itos.get(index) != char):
            raise TokenizerError(f"{source}: stoi and itos disagree about {char!r} (id {index})")
        try:
            ranks[char.encode("utf-8")] = index
        except UnicodeEncodeError:
            raise TokenizerError(f"{source}: character {char!r} has no UTF-8 encoding") from None
    if not ranks:
        raise TokenizerError(f"{source}: the vocabulary is empty")
    if len(set(ranks.values())) != len(ranks):
        raise TokenizerError(f"{source}: two characters share an id, so decoding would be ambiguous")
    return checked_spec(bpe_spec(ranks, CHARACTER_PAT_STR, special_tokens={}), source)


def check_tokenizer_fits(spec: dict, config: GPTConfig, description: str) -> None:
    size = vocabulary_size(build_encoding(spec))
    if size > config.vocab_size:
        # fewer ids than the 256 bytes: no byte-level BPE fits, so this is a character-level model
        hint = "; a character-level nanoGPT model needs its --tokenizer-meta meta.pkl" if config.vocab_size < 256 else ""
        raise TokenizerError(
            f"{description} has {size} tokens but the model has only {config.vocab_size} token ids{hint}"
        )


# --- the command -------------------------------------------------------------------------------------------------


def convert_checkpoint(
    src: Path,
    dst: Path,
    *,
    config_path: Path | None = None,
    tokenizer: str = "gpt2",
    tokenizer_file: Path | None = None,
    tokenizer_meta: Path | None = None,
    force: bool = False,
) -> Converted:
    """Read src (nanoGPT or Hugging Face GPT-2), write the equivalent manas checkpoint to dst atomically."""
    from .checkpoint import save_checkpoint

    check_output_file(dst, force, inputs=(*source_files(src), config_path, tokenizer_file, tokenizer_meta))
    check_source(src)
    own = folder_tokenizer(src) if tokenizer_file is None and tokenizer_meta is None else None
    description, spec = own or tokenizer_spec(tokenizer, tokenizer_file, tokenizer_meta)
    kind, model = load_source(src, config_path)
    check_tokenizer_fits(spec, model.config, description)
    save_checkpoint(dst, model, spec, extra_metadata={"converted_from": kind}, overwrite=force)
    return Converted(kind, model.config, model.num_parameters(), description)
