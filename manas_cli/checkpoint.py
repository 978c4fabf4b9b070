"""The manas checkpoint: one .safetensors file holding weights, config and tokenizer (format documented in FORMAT.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import tiktoken
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from .errors import CheckpointError, TokenizerError
from .files import atomic_write
from .model import GPT, GPTConfig
from .tokenizer import build_encoding, parse_spec, vocabulary_size

FORMAT = "manas-gpt"
FORMAT_VERSION = "1"
TIED = "lm_head.weight"  # tied to token_embedding.weight: never stored, tied again on load


@dataclass
class Checkpoint:
    model: GPT
    encoding: tiktoken.Encoding
    tokenizer_spec: dict
    path: Path | None = None


def save_checkpoint(
    path: str | Path, model: GPT, tokenizer_spec: dict, extra_metadata: dict[str, str] | None = None, *,
    overwrite: bool = True,
) -> None:
    """Validate that the tokenizer fits the model, then write the checkpoint atomically (see files.atomic_write)."""
    encoding = build_encoding(tokenizer_spec)
    _check_vocabulary(encoding, model.config, path)
    tensors = {
        name: tensor.detach().to("cpu").contiguous()
        for name, tensor in model.state_dict().items()
        if name != TIED
    }
    metadata = {
        **(extra_metadata or {}),
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "config": json.dumps(model.config.to_dict()),
        "tokenizer": json.dumps(tokenizer_spec),
    }
    # save() to bytes, not save_file(): the latter writes a temporary file of its own beside the target, which a
    # signal can orphan; ours is the only one, and atomic_write removes it.
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(save(tensors, metadata=metadata)), overwrite=overwrite)


def read_metadata(path: str | Path) -> dict[str, str]:
    """The checkpoint's string metadata, after checking that it is a manas checkpoint of a version we read."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt header: {exc})") from exc
    if metadata.get("format") != FORMAT or "config" not in metadata:
        raise CheckpointError(
            f"{path}: not a manas checkpoint (no format/config metadata); "
            "`manas convert` imports nanoGPT and Hugging Face GPT-2 weights"
        )
    if metadata.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: unsupported format_version {metadata.get('format_version')!r} (this manas reads {FORMAT_VERSION})"
        )
    return metadata


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Checkpoint:
    """Load, check every tensor against the config, tie lm_head, and return the model in eval mode."""
    path = Path(path)
    metadata = read_metadata(path)
    try:
        config = GPTConfig.from_dict(json.loads(metadata["config"]))
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: invalid config: {exc}") from exc
    try:
        spec = parse_spec(metadata.get("tokenizer", "null"))
        encoding = build_encoding(spec)
    except TokenizerError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    _check_vocabulary(encoding, config, path)

    # A real (random) init, then overwritten: cheaper than building on the meta device, whose init imports
    # torch._dynamo (over a second of every command's start-up).
    model = GPT(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items() if name != TIED}
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            names = set(f.keys())
            if unexpected := sorted(names - set(expected)):
                raise CheckpointError(f"{path}: unexpected tensor {unexpected[0]} (not part of this config's model)")
            if missing := sorted(set(expected) - names):
                raise CheckpointError(f"{path}: missing tensor {missing[0]} (expected shape {list(expected[missing[0]])})")
            state = {}
            for name in sorted(names):
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise CheckpointError(
                        f"{path}: tensor {name} has shape {list(shape)}, the config needs {list(expected[name])}"
                    )
                state[name] = f.get_tensor(name)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: truncated or corrupt tensor data ({exc})") from exc
    model.load_state_dict(state, strict=False, assign=True)
    model.lm_head.weight = model.token_embedding.weight  # assign=True replaced the tied parameter
    model = model.to(device=device, dtype=dtype).eval()
    return Checkpoint(model, encoding, spec, path)


def _check_vocabulary(encoding: tiktoken.Encoding, config: GPTConfig, path: str | Path) -> None:
    if vocabulary_size(encoding) > config.vocab_size:
        raise CheckpointError(
            f"{path}: the tokenizer has {vocabulary_size(encoding)} tokens but the model's vocab_size is {config.vocab_size}"
        )
