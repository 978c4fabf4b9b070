"""manas convert: weights trained elsewhere as a manas checkpoint. What the source is decides the importer: a
Hugging Face folder or bare weights with a config (huggingface.py and the families' modules), a GGUF file
(gguf_model.py), or nanoGPT's ckpt.pt (nanogpt.py); the tokenizer comes from the folder or the GGUF, or
--tokenizer-file, --tokenizer-meta or tiktoken's cache. The weights are read, renamed and written a layer at a time
(tensor_files.py's Source, checkpoint_writer.py), never a whole model in memory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.config import GPTConfig, parameter_count
from ..errors import CheckpointError, InputError, TokenizerError
from ..files import atomic_write, check_output_file
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
    folder_tensors,
    folder_tokenizer,
    hf_kind,
    hf_to_manas,
    read_hf_config,
)
from .importing import load_pickled_weights, read_plain_pickle
from .nanogpt import NANOGPT, character_spec, config_from_nanogpt, nanogpt_to_manas
from .tensor_files import Source, TensorFile
from .tokenizer import build_encoding, spec_from_tiktoken_file, vocabulary_size

if TYPE_CHECKING:
    from .gguf_model import GGUFImport


@dataclass
class Converted:
    """What convert wrote, for the CLI to report."""

    source_kind: str
    config: GPTConfig
    parameters: int
    tokenizer: str


def read_source(src: Path, config_path: Path | None) -> Source:
    """Detect what src is (not a GGUF file: convert_checkpoint reads that with its tokenizer) and how its tensors
    become a manas model's, reading no more of it than that takes."""
    check_source(src)
    if src.is_dir():
        if config_path is not None:
            raise InputError(f"{src} is a folder with its own config.json; --config is for a bare model.safetensors")
        if not (src / HF_CONFIG).is_file():
            raise InputError(f"{src} has no {HF_CONFIG}: not a Hugging Face model folder")
        config = read_hf_config(src / HF_CONFIG)
        return _hf_source(HF_FOLDER, src, config, folder_tensors(src, config))
    if src.suffix == ".safetensors":
        from .tensor_files import SafetensorsTensors

        return _hf_source(HF_WEIGHTS, src, _require_config(src, config_path), SafetensorsTensors([src]))
    from .tensor_files import LoadedTensors

    loaded = load_pickled_weights(src)
    if isinstance(loaded, dict) and "model_args" in loaded and "model" in loaded:
        if config_path is not None:
            raise InputError(
                f"{src} is a nanoGPT checkpoint with its own model_args; --config is for a bare model.safetensors"
            )
        config = config_from_nanogpt(loaded["model_args"], src)
        tensors = LoadedTensors.of(loaded["model"], src)
        return Source(NANOGPT, config, tensors, lambda state, config: (config, nanogpt_to_manas(state, src)))
    import torch  # the pickle was read with torch's weights-only loader: its tensors are torch's

    if isinstance(loaded, dict) and loaded and all(isinstance(t, torch.Tensor) for t in loaded.values()):
        return _hf_source(HF_WEIGHTS, src, _require_config(src, config_path), LoadedTensors(loaded))
    raise CheckpointError(
        f"{src}: neither a nanoGPT checkpoint (a dict with 'model_args' and 'model') nor a state dict of tensors"
    )


def _hf_source(template: str, src: Path, config: GPTConfig, tensors: TensorFile) -> Source:
    return Source(
        hf_kind(template, config), config, tensors, lambda state, config: (config, hf_to_manas(state, src, config))
    )


def _gguf_tokenizer(imported: GGUFImport, src: Path) -> tuple[str, dict]:
    """(a description, the spec) of the tokenizer in a GGUF file's metadata."""
    kind = "SentencePiece" if imported.tokenizer_spec["kind"] == "spm" else "byte-level BPE"
    return f"the {kind} in {src.name}'s metadata (embedded)", imported.tokenizer_spec


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
        from .gguf_model import read_gguf_import

        imported = read_gguf_import(src)
        source, (description, spec) = imported.source(), _gguf_tokenizer(imported, src)
        template = imported.chat_template
    else:
        own = folder_tokenizer(src) if tokenizer_file is None and tokenizer_meta is None else None
        description, spec = own or tokenizer_spec(tokenizer, tokenizer_file, tokenizer_meta)
        template = folder_chat_template(src) if src.is_dir() else None
        source = read_source(src, config_path)
    check_tokenizer_fits(spec, source.config, description)
    if quantize is not None:
        from ..torch_engine.quantize import check_quantizable_from

        check_quantizable_from(source.config, quantize, src)
    metadata = {
        **(extra_metadata or {}),
        "converted_from": source.kind,
        **({"chat_template": template} if template else {}),
    }
    written: list[GPTConfig] = []
    atomic_write(
        dst, lambda tmp: written.append(write_source(tmp, source, spec, metadata, quantize, src)), overwrite=force
    )
    config = written[0]
    return Converted(source.kind, config, parameter_count(config), description)


def write_source(
    tmp: str, source: Source, spec: dict, metadata: dict[str, str], kind: str | None, src: Path
) -> GPTConfig:
    """Write the checkpoint of `source` to the temporary file tmp, a group of tensors at a time; the config it
    holds."""
    from .checkpoint import checkpoint_metadata
    from .checkpoint_writer import CheckpointWriter

    config, writer = source.config, None
    with open(tmp, "wb") as f:
        for group in source.groups():
            config, tensors = source.to_manas(group, config)
            if writer is None:  # the first group has settled the config
                writer = CheckpointWriter(f, config, checkpoint_metadata(config, spec, kind, metadata), kind, src)
            for name, tensor in tensors.items():
                writer.add(name, tensor)
        if writer is None:
            raise CheckpointError(f"{src}: holds no tensors")
        writer.finish()
    return config
