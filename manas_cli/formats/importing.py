"""What every importer shares: PyTorch and safetensors files read without running code, config fields read by
type, and the manas model built from a renamed state dict, every tensor checked against the config."""

from __future__ import annotations

import pickle
import re
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.config import GPTConfig, parameter_shapes
from ..errors import CheckpointError, InputError, TokenizerError, first_line
from .header import is_pytorch_file

if TYPE_CHECKING:
    import torch

    from ..torch_engine.model import GPT


TIED_HEAD = "lm_head.weight"


def build_model(config: GPTConfig, state: dict[str, torch.Tensor], source: Path) -> GPT:
    """A float32 manas model holding exactly the given tensors: every one present, none extra, shapes matching, each
    real floating-point. Checked before the model is built, so its size is backed by the source's tensors."""
    from ..torch_engine.model import GPT

    expected = set()
    for name, shape in parameter_shapes(config):
        if name not in state:
            raise CheckpointError(f"{source}: missing tensor for {name} (shape {list(shape)})")
        tensor = state[name]
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{source}: tensor for {name} has shape {list(tensor.shape)}, the config needs {list(shape)}"
            )
        if not tensor.is_floating_point():  # complex too: copying it into a float32 weight drops the imaginary part
            raise CheckpointError(f"{source}: tensor for {name} is {tensor.dtype}, not a real floating-point tensor")
        expected.add(name)
    if extra := sorted(set(state) - expected):
        raise CheckpointError(f"{source}: tensor for {extra[0]} does not fit this config (bias={config.bias})")
    model = GPT(config)  # a real init costs less than the meta device, whose first use imports torch._dynamo
    model.load_state_dict(state, strict=False)  # copies into float32 parameters; lm_head stays tied
    return model.eval()


def with_zero_biases(config: GPTConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """state, with a zero bias beside each of its weights whose module has none in this config and has one in a
    bias=True model of it: GPT-2's and Starcoder2's Hugging Face classes always have biases, and adding zero changes
    nothing. On the device (meta too) and in the dtype of its weight."""
    import torch

    shapes, own = dict(parameter_shapes(replace(config, bias=True))), dict(parameter_shapes(config))
    zeros = {}
    for name, tensor in state.items():
        bias = name.removesuffix("weight") + "bias"
        if name.endswith(".weight") and bias in shapes and bias not in own:
            zeros[bias] = torch.zeros(shapes[bias], dtype=tensor.dtype, device=tensor.device)
    return state | zeros


def check_tied_head(head: torch.Tensor | None, embedding: torch.Tensor | None, source: Path) -> None:
    import torch

    if head is not None and embedding is not None and not torch.equal(head, embedding):
        raise CheckpointError(
            f"{source}: lm_head.weight differs from the token embedding; manas ties the two (as GPT-2 and "
            "Starcoder2 do), so a model with an untied output layer cannot be converted exactly"
        )


# --- reading files without running code ----------------------------------------------------------------------------


def load_pickled_weights(path: Path) -> object:
    """torch.load with weights only: tensors and plain values load, a pickle that would run code is refused. A zip
    checkpoint's tensors are memory-mapped, not read, so their shapes are checked against the config before any
    data is touched; a compressed entry (torch.save never writes one) is refused, as its size is not the file's."""
    import torch

    _refuse_compressed_entries(path)
    with path.open("rb") as f:
        if not is_pytorch_file(f.read(8)):
            raise CheckpointError(
                f"{path}: not a readable PyTorch checkpoint: it is neither the zip archive "
                "torch.save writes nor a pickle; pass nanoGPT's ckpt.pt, or a Hugging Face folder "
                "or its model.safetensors"
            )
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
    except (
        pickle.UnpicklingError,
        EOFError,
        OSError,
        ValueError,
        IndexError,
        KeyError,
        TypeError,
        AttributeError,
    ) as exc:
        raise TokenizerError(f"{path}: not a readable pickle ({first_line(exc)})") from None


# --- configs ---------------------------------------------------------------------------------------------------------


def typed_field(values: dict, source: Path, prefix: str = ""):
    """A reader of values[key] (or a default) that is exactly of its type (a bool is not an int, a string not a
    bool; an int is a float), naming the field otherwise."""

    def field(key: str, kind: type, default: object = None) -> object:
        value = values.get(key, default)
        valid = isinstance(value, (int, float) if kind is float else kind) and (
            kind is bool or not isinstance(value, bool)
        )
        if not valid:
            raise CheckpointError(
                f"{source}: {prefix}{key} must be {'an' if kind is int else 'a'} {kind.__name__}, got {value!r}"
            )
        return value

    return field


def make_config(source: Path, position_encoding: str = "learned", **values) -> GPTConfig:
    try:
        return GPTConfig(position_encoding=position_encoding, **values)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{source}: invalid model shape: {exc}") from None
