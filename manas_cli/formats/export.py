"""A manas checkpoint as a Hugging Face folder, which transformers, vLLM and TGI load and serve.

Learned-position models are GPT-2 (plain multi-head attention only); rotary models are Starcoder2 (starcoder2.py).
The tokenizer goes along as vocab.json + merges.txt, derived from the tiktoken ranks, so that Hugging Face's
byte-level BPE encodes every text to the same ids.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import tiktoken
import torch

from . import starcoder2
from .checkpoint import TIED, check_finite_tensors, load_checkpoint
from .convert import gpt2_name, is_gpt2_linear_weight
from ..errors import CheckpointError, InputError
from ..files import claim_folder, refuse_inputs, refuse_special, temporary_name
from ..engine.model import GPT, GPTConfig
from ..engine.quantize import dequantize_model
from .tokenizer import END_OF_TEXT, GPT2_PAT_STR, bytes_to_unicode, merge_parts

GELU_TO_HF = {"tanh": "gelu_new", "none": "gelu"}
# Patterns that split text as Hugging Face's GPT-2 pre-tokenizer does: manas' own, and the equivalent possessive
# form that tiktoken's named gpt2 and r50k_base encodings use.
GPT2_SPLIT_PATTERNS = (
    GPT2_PAT_STR,
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""",
)
WRITTEN_FILES = (
    "config.json", "generation_config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer_config.json",
)
# Files an earlier export into the same folder may have left that Hugging Face would read instead of ours.
SHADOWING_FILES = (
    "tokenizer.json", "special_tokens_map.json", "added_tokens.json",
    "pytorch_model.bin", "pytorch_model.bin.index.json", "model.safetensors.index.json",
)


@dataclass
class Exported:
    out: Path
    files: list[str]
    config: GPTConfig
    architecture: str  # "GPT-2" or "Starcoder2"


def check_exportable(config: GPTConfig, source: Path) -> None:
    """Refuse what Hugging Face's GPT-2, the twin of learned-position models, cannot compute exactly."""
    if config.n_kv_head != config.n_head:
        raise CheckpointError(
            f"{source}: grouped-query attention (n_kv_head={config.n_kv_head} < n_head={config.n_head}) with learned "
            "positions has no exact equivalent: GPT-2 gives every head its own keys and values (rope models with "
            "grouped-query attention export, as Starcoder2)"
        )


# --- model -------------------------------------------------------------------------------------------------------


def hf_config(config: GPTConfig, dtype: torch.dtype, end_of_text: int | None) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,  # OpenAI's name for it, which llama.cpp's GPT-2 converter reads
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,  # 4 * n_embd, as manas
        "activation_function": GELU_TO_HF[config.gelu_approximate],
        "layer_norm_epsilon": config.norm_eps,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "resid_pdrop": config.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": end_of_text,
        "eos_token_id": end_of_text,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's tensors: Conv1D weights transposed, and zero biases where a bias=False model has none
    (a zero bias adds nothing, so the function is the same). lm_head is tied, so it is left out, as
    save_pretrained does."""
    state = model.state_dict()
    with torch.device("meta"):
        with_biases = GPT(replace(model.config, bias=True))
    dtype = model.token_embedding.weight.dtype
    tensors = {}
    for name, template in with_biases.state_dict().items():
        if name == TIED:
            continue
        tensor = state[name] if name in state else torch.zeros(template.shape, dtype=dtype)
        target = gpt2_name(name)
        tensor = tensor.t() if is_gpt2_linear_weight(target) else tensor
        tensors[f"transformer.{target}"] = tensor.detach().to("cpu").contiguous()
    return tensors


def hf_model(model: GPT, end_of_text: int | None, source: Path) -> tuple[str, dict, dict[str, torch.Tensor]]:
    """(architecture, config.json, tensors) of the Hugging Face twin: Starcoder2 for rope, else GPT-2."""
    config, dtype = model.config, model.token_embedding.weight.dtype
    if config.position_encoding == "rope":
        starcoder2.check_exportable(config, source)
        return "Starcoder2", starcoder2.hf_config(config, dtype, end_of_text), starcoder2.hf_state_dict(model)
    check_exportable(config, source)
    return "GPT-2", hf_config(config, dtype, end_of_text), hf_state_dict(model)


# --- tokenizer -----------------------------------------------------------------------------------------------------


def hf_merges(ranks: dict[bytes, int], pat_str: str, source: Path) -> list[tuple[bytes, bytes]]:
    """The merge that builds each multi-byte token, in rank order: Hugging Face applies merges by their position in
    merges.txt, tiktoken by the rank of what they build, so this order makes the two agree."""
    multi_byte = sorted((rank, token) for token, rank in ranks.items() if len(token) > 1)
    if multi_byte and pat_str not in GPT2_SPLIT_PATTERNS:
        raise CheckpointError(
            f"{source}: the tokenizer splits text with its own pattern, but Hugging Face's GPT-2 tokenizer always "
            "splits with GPT-2's, so it would encode differently; only GPT-2-pattern BPE tokenizers export"
        )
    merges = []
    for rank, token in multi_byte:
        parts = merge_parts(ranks, token, rank)
        if len(parts) != 2 or not all(part in ranks for part in parts):
            raise CheckpointError(
                f"{source}: token {token!r} (id {rank}) is not the merge of two earlier tokens, so Hugging Face's "
                "byte-level BPE cannot represent this tokenizer"
            )
        merges.append((parts[0], parts[1]))
    return merges


@dataclass
class ByteLevelBPE:
    """A tiktoken encoding as byte-level BPE files spell it, each byte by its printable alias (bytes_to_unicode)."""

    tokens: dict[str, int]  # ordinary tokens → id
    special: dict[str, int]  # special tokens (<|endoftext|>) → id
    merges: list[str]  # "left right", in the order they apply


def byte_level_bpe(encoding: tiktoken.Encoding, source: Path) -> ByteLevelBPE:
    # tiktoken keeps the ranks, pattern and special tokens of an Encoding only in these attributes.
    ranks: dict[bytes, int] = encoding._mergeable_ranks
    alias = bytes_to_unicode()

    def show(token: bytes) -> str:
        return "".join(alias[byte] for byte in token)

    merges = [f"{show(left)} {show(right)}" for left, right in hf_merges(ranks, encoding._pat_str, source)]
    tokens = {show(token): rank for token, rank in ranks.items()}
    for text, token_id in encoding._special_tokens.items():
        if text in tokens:  # one string for two ids: vocab.json would keep one, GGUF would list it twice
            raise CheckpointError(
                f"{source}: the special token {text!r} (id {token_id}) is spelled like ordinary token {tokens[text]} "
                "in byte-level BPE's alphabet, so the exported tokenizer could not tell them apart: rename it"
            )
    return ByteLevelBPE(tokens, dict(encoding._special_tokens), merges)


def tokenizer_files(encoding: tiktoken.Encoding, block_size: int, source: Path) -> dict[str, str]:
    """vocab.json, merges.txt and tokenizer_config.json for Hugging Face's GPT2Tokenizer."""
    bpe = byte_level_bpe(encoding, source)
    vocab = bpe.tokens | bpe.special
    end_of_text = END_OF_TEXT if END_OF_TEXT in bpe.special else None
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": block_size,
        "add_prefix_space": False,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,  # tiktoken's decode returns the text as it was
        "errors": "replace",
        # Named explicitly: left out, GPT2Tokenizer would invent <|endoftext|> as a new token.
        "bos_token": end_of_text,
        "eos_token": end_of_text,
        "unk_token": end_of_text,
    }
    return {
        # json.dumps' defaults, as OpenAI wrote GPT-2's encoder.json: GPT-2's export is then that file, byte for byte
        "vocab.json": json.dumps(dict(sorted(vocab.items(), key=lambda kv: kv[1]))),
        "merges.txt": "#version: 0.2\n" + "".join(f"{merge}\n" for merge in bpe.merges),
        "tokenizer_config.json": json_text(config),
    }


def json_text(values: dict) -> str:
    return json.dumps(values, indent=2, ensure_ascii=False) + "\n"


# --- writing -----------------------------------------------------------------------------------------------------------


def check_out_dir(out: Path, force: bool, source: Path) -> None:
    """out is a new or empty folder, or with force one whose files we replace (or remove: SHADOWING_FILES), none of
    them the checkpoint we read or anything but a regular file."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file: name a folder to write the Hugging Face model into")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise InputError(f"{out} is not empty: pass --force to overwrite its Hugging Face files")
    if not out.parent.is_dir():
        raise InputError(f"the folder of --out {out} does not exist")
    for name in (*WRITTEN_FILES, *SHADOWING_FILES):
        refuse_inputs(out / name, (source,))
        refuse_special(out / name)


def write_folder(out: Path, writers: dict[str, Callable[[Path], None]], *, overwrite: bool) -> None:
    """Write every file into a staging folder beside out, then move them in: a new (or empty) folder appears whole
    (one rename, which fails if another writer filled it meanwhile); with overwrite, an existing one has each file
    replaced atomically and no stale file left to shadow ours."""
    staging = out.parent / temporary_name(out.name)
    os.mkdir(staging)  # the umask's mode, as a folder the user made (mkdtemp's 0700 would hide it from a server)
    try:
        for name, write in writers.items():
            write(staging / name)
        if not (overwrite and out.exists()):
            claim_folder(staging, out)
            return
        for name in writers:
            os.replace(staging / name, out / name)
        for name in SHADOWING_FILES:
            (out / name).unlink(missing_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def export_hf(checkpoint_path: Path, out: Path, *, force: bool = False) -> Exported:
    """Write checkpoint_path as a Hugging Face GPT-2 or Starcoder2 folder; refuse before writing anything it cannot
    export."""
    from safetensors.torch import save

    if out.is_symlink() and out.is_dir():
        out = out.resolve()  # write into the folder the link names, as the user would (a rename would hit the link)
    check_out_dir(out, force, checkpoint_path)
    checkpoint = load_checkpoint(checkpoint_path)
    dequantize_model(checkpoint.model)  # an int8 checkpoint exports its weights dequantized to float
    config = checkpoint.model.config
    texts = tokenizer_files(checkpoint.encoding, config.block_size, checkpoint_path)
    special = checkpoint.encoding._special_tokens
    end_of_text = special.get(END_OF_TEXT)
    architecture, model_config, tensors = hf_model(checkpoint.model, end_of_text, checkpoint_path)
    check_finite_tensors(tensors, checkpoint_path)
    generation = {"bos_token_id": end_of_text, "eos_token_id": end_of_text}
    texts |= {"config.json": json_text(model_config), "generation_config.json": json_text(generation)}
    writers: dict[str, Callable[[Path], None]] = {
        name: (lambda path, text=text: path.write_text(text, encoding="utf-8")) for name, text in texts.items()
    }
    # save() to bytes, not save_file(), whose own temporary file is private (0600) and would stay so
    writers["model.safetensors"] = lambda path: path.write_bytes(save(tensors, metadata={"format": "pt"}))
    write_folder(out, writers, overwrite=force)
    return Exported(out, sorted(writers), config, architecture)
