"""A GGUF file run as it is published: mapped, its tensors' blocks multiplied in place by the native core
(core/blocks.c), never converted. This module reads the file's layout, checks every tensor's extent against the
mapping before the core may read it, and gives the core's loader (native/model.py's NativeGPT) what
binding.bind asks for: `vector(name)` and `linear(name)` under manas' names. No torch, no gguf package.

llama.cpp's `llama` and `smollm3` files keep queries and keys in interleaved rope pairs, manas' own layout; its
`qwen2` and `qwen3` files keep Hugging Face's rotate-half pairs, which the core rotates as they are
(ManasModel.rope_halves). A llama file's rope_freqs.weight (Llama 3.1, 3.2) is its config's rope_factors."""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import struct
from ctypes import POINTER, c_float
from dataclasses import dataclass
from pathlib import Path

from ..engine.config import GPTConfig
from ..errors import CheckpointError, TokenizerError, first_line
from ..native.binding import WEIGHTS_F32, WEIGHTS_GGML, ManasLinear
from .gguf_config import INTERLEAVED, tensor_extent
from .gguf_metadata import Layout, TensorInfo, layout_of
from .gguf_vocab import spec_from_fields, string_field
from .tokenizer_cache import cached_spec

# llama.cpp's architectures whose files the core runs in place
IN_PLACE = ("llama", "qwen2", "qwen3", "smollm3", "gemma3", "phi3")

# ggml's types: (name, values per block, bytes per block) for those the core multiplies; the others by name only
BLOCK_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2),
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
    20: ("IQ4_NL", 32, 18), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 23: ("IQ4_XS", 256, 136),
}  # fmt: skip
OTHER_TYPES = {
    9: "Q8_1", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 21: "IQ3_S", 22: "IQ2_S",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip

# llama.cpp's tensor names in a llama or qwen2 file → manas' module names (formats/llama.py's, for the same model)
TOP = {"token_embd": "token_embedding", "output_norm": "final_norm", "output": "lm_head"}
LAYER = {
    "attn_norm": "ln_attention", "attn_q": "attention.qkv", "attn_k": "attention.key", "attn_v": "attention.value",
    "attn_q_norm": "attention.q_norm", "attn_k_norm": "attention.k_norm",
    "attn_output": "attention.output", "ffn_norm": "ln_ffn", "ffn_gate": "ffn.gate", "ffn_up": "ffn.up",
    "ffn_down": "ffn.down", "post_attention_norm": "ln_attention_out", "post_ffw_norm": "ln_ffn_out",
}  # fmt: skip
BY_MANAS_NAME = {manas: gguf for gguf, manas in (TOP | LAYER).items()}
# A phi3 file's fused layers: manas' layer → (llama.cpp's tensor, which of its row ranges: q|k|v, gate|up)
FUSED = {
    "attention.qkv": ("attn_qkv", 0), "attention.key": ("attn_qkv", 1), "attention.value": ("attn_qkv", 2),
    "ffn.gate": ("ffn_up", 0), "ffn.up": ("ffn_up", 1),
}  # fmt: skip


def type_name(kind: int) -> str:
    return BLOCK_TYPES[kind][0] if kind in BLOCK_TYPES else OTHER_TYPES.get(kind, f"ggml type {kind}")


@dataclass(frozen=True)
class Tensor:
    """A tensor in the mapping: its ggml type, its shape (rows, columns: PyTorch's order), where its bytes start."""

    kind: int
    shape: tuple[int, ...]
    start: int
    nbytes: int


class NotInPlace(CheckpointError):
    """A GGUF file of an architecture manas runs, but not in place (gpt2, starcoder2): torch converts it in memory."""


class GGUFFile:
    """A GGUF file mapped (copy-on-write; a file of up to header.READ_WHOLE_BYTES read into memory instead), its
    metadata read from those same bytes, every tensor checked: a type the core multiplies, whole blocks, its bytes
    inside the file, aligned, apart from the others."""

    def __init__(self, path: Path) -> None:
        from .gguf_config import (
            ARCHITECTURES,
            PHI3_SHORT_FACTORS,
            RUNS,
            check_apart,
            check_block_count,
            hf_config,
            with_rope_factors,
        )
        from .header import map_whole
        from .huggingface import checked_template, config_from_hf

        self.path = path
        try:
            with open(path, "rb") as f:
                self.mapping = map_whole(f, os.fstat(f.fileno()).st_size, path)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read it ({first_line(exc)})") from None
        layout = layout_of(self.mapping, path)
        fields = layout.fields  # not kept: its vocabulary's strings (8 MB for 49,152 tokens) outlive their use
        self.architecture = string_field(fields, "general.architecture", path, CheckpointError)
        if self.architecture in ARCHITECTURES and self.architecture not in IN_PLACE:
            raise NotInPlace(f"{path}: llama.cpp's {self.architecture} runs converted to float32, not in place")
        if self.architecture not in IN_PLACE:
            raise CheckpointError(
                f"{path}: llama.cpp architecture {self.architecture!r} is not one manas runs from GGUF ({RUNS})"
            )
        check_block_count(layout, self.architecture, path)
        self.tensors = {tensor.name: checked_tensor(tensor, layout, path) for tensor in layout.tensors}
        check_apart([(t.start, t.start + t.nbytes, name) for name, t in self.tensors.items()], path)
        shapes = {name: tensor.shape for name, tensor in self.tensors.items()}
        short = self._float_vector(PHI3_SHORT_FACTORS) if self.architecture == "phi3" else None
        config = config_from_hf(hf_config(fields, self.architecture, shapes, path, short), path)
        self.config: GPTConfig = with_rope_factors(config, self._rope_factors(), path)
        check_shapes(shapes, self.config, path, fused=self.architecture == "phi3")
        with memoryview(self.mapping)[: layout.metadata_end] as metadata:  # released even when the spec is refused
            self.tokenizer_spec = cached_spec(metadata, lambda: spec_from_fields(fields, path))
        template = fields.get("tokenizer.chat_template")
        template = checked_template(template, path) if isinstance(template, str) and template.strip() else None
        self.metadata = {"converted_from": f"GGUF {self.architecture}"} | (
            {"chat_template": template} if template else {}
        )

    def _rope_factors(self) -> list[float] | None:
        """rope_freqs.weight's values (the config checks them)."""
        if "rope_freqs.weight" in self.tensors and self.architecture != "llama":
            raise CheckpointError(f"{self.path}: rope_freqs.weight in a {self.architecture} file, whose rope llama.cpp "
                                  "does not scale")  # fmt: skip
        return self._float_vector("rope_freqs.weight")

    def _float_vector(self, name: str) -> list[float] | None:
        """A float32 vector's values (rope_freqs, a phi3 file's rope factors), read from the checked mapping."""
        tensor = self.tensors.get(name)
        if tensor is None:
            return None
        if tensor.kind != 0 or len(tensor.shape) != 1:
            raise CheckpointError(f"{self.path}: {name} is {type_name(tensor.kind)} {list(tensor.shape)}, "
                                  "where llama.cpp writes a float32 vector")  # fmt: skip
        with memoryview(self.mapping)[tensor.start : tensor.start + tensor.nbytes] as data:
            return list(struct.unpack(f"<{tensor.nbytes // 4}f", data))

    @property
    def types(self) -> str:
        """The file's weight types, most bytes first: "Q4_K, Q6_K, F32"."""
        totals: dict[str, int] = {}
        for tensor in self.tensors.values():
            totals[type_name(tensor.kind)] = totals.get(type_name(tensor.kind), 0) + tensor.nbytes
        return ", ".join(sorted(totals, key=totals.get, reverse=True))


def checked_tensor(tensor: TensorInfo, layout: Layout, path: Path) -> Tensor:
    """A tensor's entry as the core may read it: a type it multiplies, whole blocks along each row, every byte its
    shape implies inside the file (offsets that wrap, or point past the end, refused) and aligned."""
    if tensor.kind not in BLOCK_TYPES:
        raise CheckpointError(
            f"{path}: tensor {tensor.name} is {type_name(tensor.kind)}, a type manas does not multiply "
            f"(it runs {', '.join(name for name, _, _ in BLOCK_TYPES.values())}); pick another quantization of "
            "the model"
        )
    start, nbytes = tensor_extent(tensor, layout, BLOCK_TYPES[tensor.kind][1:], path)
    return Tensor(tensor.kind, tuple(reversed(tensor.dims)), start, nbytes)


def expected_shapes(config: GPTConfig, fused: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor a llama-family file of this config holds, by llama.cpp's name, in PyTorch's order: the model's
    own (engine/config.py's parameter_shapes; the output layer where untied), queries, keys and values apart; with
    `fused` (phi3) q|k|v as attn_qkv and gate|up as ffn_up."""
    from ..engine.config import parameter_shapes

    kv_width = config.n_kv_head * config.head_size
    expected = {}
    for name, shape in parameter_shapes(config):
        module, _, kind = name.rpartition(".")
        _, layer, inner = module.split(".", 2) if module.startswith("blocks.") else ("", "", "")
        if fused and inner in FUSED:
            tensor = FUSED[inner][0]
            rows = config.attention_width + 2 * kv_width if tensor == "attn_qkv" else 2 * config.ffn_width
            expected[f"blk.{layer}.{tensor}.{kind}"] = (rows, *shape[1:])
        elif ".attention.qkv." in name:
            for part, rows in (("qkv", config.attention_width), ("key", kv_width), ("value", kv_width)):
                expected[gguf_name(name.replace(".qkv.", f".{part}."))] = (rows, *shape[1:])
        else:
            expected[gguf_name(name)] = shape
    return expected


def check_shapes(shapes: dict[str, tuple[int, ...]], config: GPTConfig, path: Path, fused: bool = False) -> None:
    """The file holds exactly the model's tensors, each of the shape its config implies: the core sizes every buffer
    by the config and reads each tensor by its shape, so the two must agree before it reads anything."""
    from .gguf_config import PHI3_LONG_FACTORS, PHI3_SHORT_FACTORS

    expected = expected_shapes(config, fused)
    names = (PHI3_SHORT_FACTORS, PHI3_LONG_FACTORS) if fused else ("rope_freqs.weight",)
    if config.rope_factors is not None and any(name in shapes for name in names):  # else a linear scaling's factor
        expected |= dict.fromkeys(names, (len(config.rope_factors),))
    for name, shape in shapes.items():
        if name not in expected:
            raise CheckpointError(f"{path}: tensor {name} is not part of a model manas runs from this file")
        if shape != expected[name]:
            raise CheckpointError(f"{path}: tensor {name} is {list(shape)}, where the model's config needs "
                                  f"{list(expected[name])}")  # fmt: skip
    if missing := [name for name in expected if name not in shapes]:
        raise CheckpointError(f"{path}: the file has no {missing[0]}")


def gguf_name(name: str) -> str:
    """manas' tensor name → llama.cpp's: blocks.3.attention.key.weight → blk.3.attn_k.weight."""
    module, _, kind = name.rpartition(".")
    if module.startswith("blocks."):
        _, layer, inner = module.split(".", 2)
        return f"blk.{layer}.{BY_MANAS_NAME.get(inner, inner)}.{kind}"
    return f"{BY_MANAS_NAME.get(module, module)}.{kind}"


class GGUFWeights:
    """A mapped GGUF file's tensors as the core reads them (binding.bind): vectors (norms, biases) as float32,
    matrices as ggml layers over their blocks in place. Queries, keys and values stay three layers
    (separate_qkv), each of its own type; the token embedding is a ggml table (token_table) unless float32."""

    separate_qkv = True

    def __init__(self, gguf: GGUFFile, library: ctypes.CDLL) -> None:
        self.gguf, self.library, self.config = gguf, library, gguf.config
        self.name = f"GGUF {gguf.types}"
        self.rope_halves = gguf.architecture not in INTERLEAVED  # Hugging Face's rotate-half pairs, kept
        self.nbytes = sum(tensor.nbytes for tensor in gguf.tensors.values())
        # the bytes the core reads from the file's pages: free memory as the kernel counts it (MemAvailable) takes
        # them for reclaimable cache, but a run keeps them resident (native/engine.py's free_memory_bytes)
        in_place = (tensor.nbytes for tensor in gguf.tensors.values() if tensor.kind != 0 and len(tensor.shape) == 2)
        self.mapped_bytes = sum(in_place) if isinstance(gguf.mapping, mmap.mmap) else 0
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(gguf.mapping))
        self.kept: list[object] = []  # float32 copies of vectors stored as F16 (small), alive with the pointers

    def vector(self, name: str):
        """A 1-D tensor (a norm's weight, a bias) as float32: in place where the file stores it so, else a copy;
        None where the file has none. The token embedding is a vector only when stored as float32."""
        tensor = self._tensor(name)
        if tensor is None or (name == "token_embedding.weight" and tensor.kind != 0):
            return None
        count = math.prod(tensor.shape)
        if tensor.kind == 0 and (self._base + tensor.start) % 4 == 0:  # else copied below (float loads align)
            address = self._base + tensor.start
            if self.library.manas_first_not_finite(address, count) >= 0:
                raise self._not_finite(name)
            return ctypes.cast(address, POINTER(c_float))
        stored = {0: 0, 1: 1, 30: 2}.get(tensor.kind)  # core.c's STORED_F32, STORED_F16, STORED_BF16
        if stored is None:
            raise CheckpointError(f"{self.gguf.path}: tensor {gguf_name(name)} is {type_name(tensor.kind)}, "
                                  "where a float vector belongs")  # fmt: skip
        converted = (c_float * count)()
        if self.library.manas_convert(self._base + tensor.start, stored, count, 0, converted) >= 0:
            raise self._not_finite(name)
        self.kept.append(converted)
        return ctypes.cast(converted, POINTER(c_float))

    def linear(self, name: str) -> ManasLinear:
        if name == "lm_head" and self._tensor("lm_head.weight") is None:
            name = "token_embedding"  # tied: the output layer is the embedding's rows
        if self.gguf.architecture == "phi3" and (fused := self._fused(name)) is not None:
            return fused
        tensor = self._tensor(f"{name}.weight")
        if tensor is None:
            raise CheckpointError(f"{self.gguf.path}: the file has no {gguf_name(name + '.weight')}")
        rows, columns = tensor.shape if len(tensor.shape) == 2 else (0, 0)
        if rows == 0:
            raise CheckpointError(f"{self.gguf.path}: tensor {gguf_name(name + '.weight')} is not a matrix")
        bias = self.vector(f"{name}.bias") if name != "token_embedding" else None
        kind = WEIGHTS_F32 if tensor.kind == 0 else WEIGHTS_GGML
        return ManasLinear(kind, columns, rows, tensor.kind, self._base + tensor.start, None, None, bias)

    def _fused(self, name: str) -> ManasLinear | None:
        """A phi3 file's query, key, value, gate or up layer: its rows of the fused tensor, read in place (a row
        of a ggml type is whole blocks, so each range starts on one)."""
        _, layer, inner = name.split(".", 2) if name.startswith("blocks.") else ("", "", "")
        if inner not in FUSED:
            return None
        tensor_name, part = FUSED[inner]
        tensor = self.gguf.tensors[f"blk.{layer}.{tensor_name}.weight"]  # its shape checked (check_shapes)
        config, kv = self.config, self.config.n_kv_head * self.config.head_size
        widths = (config.attention_width, kv, kv) if tensor_name == "attn_qkv" else (config.ffn_width,) * 2
        row_bytes = tensor.nbytes // tensor.shape[0]
        start = tensor.start + sum(widths[:part]) * row_bytes
        kind = WEIGHTS_F32 if tensor.kind == 0 else WEIGHTS_GGML
        return ManasLinear(kind, tensor.shape[1], widths[part], tensor.kind, self._base + start, None, None, None)

    def token_table(self) -> ManasLinear:
        """The token embedding as a ggml layer, its rows dequantized one by one as tokens are embedded."""
        return self.linear("token_embedding")

    def release(self, linear: ManasLinear) -> None:
        """The layers are read in place: nothing to drop (float32 layers are regrouped into panels, then their
        mapped pages are read no more; the kernel drops them under pressure, as any clean page)."""

    def _tensor(self, name: str) -> Tensor | None:
        return self.gguf.tensors.get(gguf_name(name))

    def _not_finite(self, name: str) -> CheckpointError:
        return CheckpointError(
            f"{self.gguf.path}: tensor {gguf_name(name)} holds a value that is not finite (NaN or infinity): "
            "the file is damaged"
        )


def open_gguf(path: Path) -> GGUFFile:
    """A GGUF file to run in place, or one CheckpointError / TokenizerError naming what it cannot read."""
    try:
        return GGUFFile(path)
    except TokenizerError as exc:  # the layout reader's, for a file that is not a GGUF
        raise CheckpointError(str(exc)) from None
