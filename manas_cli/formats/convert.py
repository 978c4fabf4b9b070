"""manas convert: weights trained elsewhere as a manas checkpoint. What the source is decides the importer: a
Hugging Face folder or bare weights with a config (huggingface.py: GPT-2 or Starcoder2), or nanoGPT's ckpt.pt
(nanogpt.py); the tokenizer comes from the folder, --tokenizer-file, --tokenizer-meta or tiktoken's cache."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.config import GPTConfig
from ..errors import CheckpointError, InputError, TokenizerError
from ..files import check_output_file
from .huggingface import (
    HF_CONFIG,
    HF_FOLDER,
    HF_INDEX,
    HF_MERGES,
    HF_PICKLE,
    HF_SAFETENSORS,
    HF_TOKENIZER,
    HF_VOCAB,
    HF_WEIGHTS,
    folder_chat_template,
    folder_tokenizer,
    hf_kind,
    load_hf,
    load_hf_folder,
    read_hf_config,
)
from .importing import load_pickled_weights, load_safetensors, read_plain_pickle
from .nanogpt import NANOGPT, character_spec, load_nanogpt
from .tokenizer import build_encoding, spec_from_tiktoken_file, vocabulary_size

if TYPE_CHECKING:
    from ..torch_engine.model import GPT


@dataclass
class Converted:
    """What convert wrote, for the CLI to report."""

    source_kind: str
    config: GPTConfig
    parameters: int
    tokenizer: str


def load_source(src: Path, config_path: Path | None) -> tuple[str, GPT]:
    """Detect what src is and return (its kind, the equivalent manas model)."""
    check_source(src)
    if src.is_dir():
        if config_path is not None:
            raise InputError(f"{src} is a folder with its own config.json; --config is for a bare model.safetensors")
        return hf_kind(HF_FOLDER, load_hf_folder(src))
    if src.suffix == ".safetensors":
        config = _require_config(src, config_path)
        return hf_kind(HF_WEIGHTS, load_hf(load_safetensors(src), src, config))
    loaded = load_pickled_weights(src)
    if isinstance(loaded, dict) and "model_args" in loaded and "model" in loaded:
        if config_path is not None:
            raise InputError(
                f"{src} is a nanoGPT checkpoint with its own model_args; --config is for a bare model.safetensors"
            )
        return NANOGPT, load_nanogpt(loaded, src)
    import torch  # the pickle was read with torch's weights-only loader: its tensors are torch's

    if isinstance(loaded, dict) and loaded and all(isinstance(t, torch.Tensor) for t in loaded.values()):
        return hf_kind(HF_WEIGHTS, load_hf(loaded, src, _require_config(src, config_path)))
    raise CheckpointError(
        f"{src}: neither a nanoGPT checkpoint (a dict with 'model_args' and 'model') nor a state dict of tensors"
    )


def _gguf_source(src: Path) -> tuple[str, GPT, tuple[str, dict], str | None]:
    """A GGUF file's (kind, model, (tokenizer description, spec), chat template): all of it is in the file."""
    from .gguf_model import load_gguf

    imported = load_gguf(src)
    kind = "SentencePiece" if imported.tokenizer_spec["kind"] == "spm" else "byte-level BPE"
    tokenizer = (f"the {kind} in {src.name}'s metadata (embedded)", imported.tokenizer_spec)
    return f"GGUF {imported.architecture}", imported.model, tokenizer, imported.chat_template


def source_files(src: Path) -> tuple[Path, ...]:
    """Every file convert may read from src: src itself, or the files it reads inside a folder."""
    names = (HF_CONFIG, HF_SAFETENSORS, HF_PICKLE, HF_VOCAB, HF_MERGES, HF_TOKENIZER, HF_INDEX)
    return (*(src / name for name in names), *sorted(src.glob("*.safetensors"))) if src.is_dir() else (src,)


def _require_config(src: Path, config_path: Path | None) -> GPTConfig:
    if config_path is None:
        raise InputError(
            f"{src} holds bare weights: pass --config PATH, the Hugging Face GPT-2 config.json that goes with them"
        )
    return read_hf_config(config_path)


def check_source(src: Path) -> None:
    """The refusals that need no weights loaded: run before anything slow."""
    if not src.exists():
        raise InputError(f"{src} does not exist")
    if src.suffix == ".safetensors" and src.is_file():
        _refuse_manas_checkpoint(src)


def _refuse_manas_checkpoint(src: Path) -> None:
    from safetensors import safe_open

    from .header import FORMAT

    try:
        with safe_open(src, framework="numpy") as f:  # its header alone: no torch for a refusal
            is_manas = (f.metadata() or {}).get("format") == FORMAT
    except Exception:  # unreadable files get a precise message when their tensors are loaded
        return
    if is_manas:
        raise InputError(f"{src} is already a manas checkpoint: nothing to convert")


def tokenizer_spec(tokenizer: str, tokenizer_file: Path | None, tokenizer_meta: Path | None) -> tuple[str, dict]:
    """(a description, the checkpoint's tokenizer spec) from --tokenizer, --tokenizer-file, --tokenizer-meta."""
    if tokenizer_meta is not None:
        if tokenizer_file is not None:
            raise InputError("--tokenizer-file and --tokenizer-meta both name a tokenizer: pass one of them")
        return f"the character-level vocabulary of {tokenizer_meta}", character_spec(
            read_plain_pickle(tokenizer_meta), tokenizer_meta
        )
    if tokenizer != "gpt2":
        raise InputError(
            f"--tokenizer must be 'gpt2' (or use --tokenizer-meta for a character-level meta.pkl), got {tokenizer!r}"
        )
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


def check_tokenizer_fits(spec: dict, config: GPTConfig, description: str) -> None:
    size = vocabulary_size(build_encoding(spec))
    if size > config.vocab_size:
        # fewer ids than the 256 bytes: no byte-level BPE fits, so this is a character-level model
        hint = (
            "; a character-level nanoGPT model needs its --tokenizer-meta meta.pkl" if config.vocab_size < 256 else ""
        )
        raise TokenizerError(
            f"{description} has {size} tokens but the model has only {config.vocab_size} token ids{hint}"
        )


def convert_checkpoint(
    src: Path,
    dst: Path,
    *,
    config_path: Path | None = None,
    tokenizer: str = "gpt2",
    tokenizer_file: Path | None = None,
    tokenizer_meta: Path | None = None,
    force: bool = False,
    quantize: str | None = None,
    extra_metadata: dict[str, str] | None = None,
) -> Converted:
    """Read src (nanoGPT, a Hugging Face folder or weights, or a GGUF file), write the equivalent manas checkpoint to
    dst atomically, its matrices as int8 or int4 with `quantize`, with `extra_metadata` among its metadata. What
    needs no weights is checked first, before torch is imported: a refusal of the source, its config or its
    tokenizer comes in a fraction of a second."""
    check_output_file(dst, force, inputs=(*source_files(src), config_path, tokenizer_file, tokenizer_meta))
    check_source(src)
    if src.suffix == ".gguf" and src.is_file():
        kind, model, (description, spec), template = _gguf_source(src)
    else:
        own = folder_tokenizer(src) if tokenizer_file is None and tokenizer_meta is None else None
        description, spec = own or tokenizer_spec(tokenizer, tokenizer_file, tokenizer_meta)
        template = folder_chat_template(src) if src.is_dir() else None
        kind, model = load_source(src, config_path)
    from .checkpoint import save_checkpoint

    check_tokenizer_fits(spec, model.config, description)
    parameters = model.num_parameters()
    if quantize is not None:
        from ..torch_engine.quantize import quantize_checked

        quantize_checked(model, quantize, src)
    metadata = {**(extra_metadata or {}), "converted_from": kind, **({"chat_template": template} if template else {})}
    save_checkpoint(dst, model, spec, extra_metadata=metadata, overwrite=force)
    return Converted(kind, model.config, parameters, description)
