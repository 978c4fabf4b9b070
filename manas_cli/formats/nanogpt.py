"""nanoGPT's files: its ckpt.pt (model_args and GPT-2-named weights), and its character-level meta.pkl as an
equivalent tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.config import GPTConfig
from ..errors import CheckpointError, TokenizerError
from .gpt2 import gpt2_state_to_manas
from .importing import make_config, typed_field
from .tokenizer import bpe_spec, checked_spec

if TYPE_CHECKING:
    import torch

# nanoGPT's character-level encoding looks each character up alone: one piece per character, newlines included.
CHARACTER_PAT_STR = r"(?s:.)"

NANOGPT = "nanoGPT checkpoint"


def config_from_nanogpt(model_args: object, source: Path) -> GPTConfig:
    """nanoGPT's model_args; its MLP is nn.GELU(), the exact erf GELU."""
    if not isinstance(model_args, dict):
        raise CheckpointError(f"{source}: model_args is a {type(model_args).__name__}, not nanoGPT's dict")
    keys = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")
    if missing := [key for key in keys if key not in model_args]:
        raise CheckpointError(f"{source}: model_args lacks {', '.join(missing)}")
    field = typed_field(model_args, source, "model_args.")
    return make_config(
        source,
        **{key: field(key, int) for key in keys},
        bias=field("bias", bool, True),
        dropout=field("dropout", float, 0.0),
        gelu_approximate="none",
    )


def nanogpt_to_manas(state: dict[str, torch.Tensor], source: Path) -> dict[str, torch.Tensor]:
    """Some of a nanoGPT checkpoint's tensors (its 'model' state dict's) under manas' names."""
    return gpt2_state_to_manas(state, conv1d=False, source=source)


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
            raise TokenizerError(
                f"{source}: token {char!r} is not a single character; only character-level vocabularies convert"
            )
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
