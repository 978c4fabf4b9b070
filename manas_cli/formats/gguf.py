"""A manas checkpoint as one GGUF file, the format llama.cpp, ollama and LM Studio load.

GGUF names llama.cpp's own architectures. The model's Hugging Face tensors map onto them as llama.cpp's converter
(convert_hf_to_gguf.py) maps them, with the names of the gguf package's TensorNameMap: GPT-2's are `gpt2` (Conv1D
weights transposed back to out×in), Starcoder2's are `starcoder2` (queries and keys already in the rotate-half
layout of llama.cpp's NEOX rope), Qwen2's `qwen2` and Qwen3's `qwen3` (NEOX too), and Llama's `llama` and SmolLM3's
`smollm3` (no rope on every fourth layer, the one pattern llama.cpp's smollm3 runs), whose rope rotates interleaved
pairs as manas does (the queries and keys permuted back from Hugging Face's layout, as the
converter does); a scaled rope's factors (Llama 3.1, 3.2) go in as `rope_freqs.weight`, as the converter writes them.
llama.cpp's gpt2 reads head_count_kv, so learned-position models with grouped-query attention export too, though
Hugging Face's GPT-2 has no such thing. The tokenizer goes along as GGUF's byte-level BPE.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..engine.config import GPTConfig, as_float32
from ..errors import CheckpointError
from ..files import atomic_write, check_output_file
from . import gemma, gpt2, llama, phi3, rotary_layout, starcoder2
from .gguf_config import INTERLEAVED, PHI3_LONG_FACTORS, PHI3_SHORT_FACTORS, SMOLLM3_NO_ROPE_INTERVAL
from .gguf_vocab import import_gguf
from .huggingface import GPT2_SPLIT_PATTERNS, ByteLevelBPE, byte_level_bpe
from .model_tensors import model_tensors
from .tokenizer import DIGITS_PAT_STR, END_OF_TEXT, LLAMA3_PAT_STR, QWEN2_PAT_STR, bos_id

OUTTYPES = ("f32", "f16", "q8_0")
ARCHITECTURES = {"learned": "gpt2", "rope": "starcoder2"}  # position encoding → llama.cpp architecture
# llama.cpp's names for the split patterns it runs as Hugging Face does: GPT-2's (either spelling), SmolLM2's digits
# before it, Qwen2's.
PRE_TOKENIZERS = dict.fromkeys(GPT2_SPLIT_PATTERNS, "gpt-2") | {
    DIGITS_PAT_STR: "smollm",
    QWEN2_PAT_STR: "qwen2",
    LLAMA3_PAT_STR: "llama-bpe",
}


def architecture_of(config: GPTConfig) -> str:
    """llama.cpp's architecture for the model: Gemma 3's, the Llama family's Hugging Face twin's, else by position
    encoding."""
    if gemma.is_gemma(config):
        return "gemma3"
    if phi3.is_phi3(config):
        return "phi3"
    return llama.model_type_of(config) if not config.is_gpt2_family else ARCHITECTURES[config.position_encoding]


@dataclass
class ExportedGGUF:
    out: Path
    architecture: str  # llama.cpp's name
    outtype: str
    tensors: int
    size_bytes: int


def check_exportable(config: GPTConfig, end_of_text: int | None, source: Path) -> None:
    """Refuse what llama.cpp's gpt2, starcoder2, llama, qwen2, qwen3, smollm3 and gemma3 would compute or stop
    differently."""
    if config.rope_factors is not None and architecture_of(config) not in ("llama", "phi3", "gemma3"):
        raise CheckpointError(f"{source}: llama.cpp reads rope_factors (rope_freqs) only in its llama and phi3 "
                              "architectures, and gemma3's linear scaling")  # fmt: skip
    _check_layer_patterns(config, source)
    if (scalar := config.attention_scalar or config.head_size) != gemma.llama_cpp_scalar(config):
        raise CheckpointError(f"{source}: llama.cpp scales this model's attention by 1/√"
                              f"{gemma.llama_cpp_scalar(config):g}, not 1/√{scalar:g}")  # fmt: skip
    if gemma.is_gemma(config):
        gemma.check_exportable(config, source)
    elif phi3.is_phi3(config):
        phi3.check_exportable(config, source)
        if config.sliding_window is not None:
            raise CheckpointError(f"{source}: llama.cpp runs Phi-3 without its sliding window, which manas keeps")
    elif not config.is_gpt2_family:
        llama.check_exportable(config, source, hf=False)
    elif config.gelu_approximate != "tanh":
        raise CheckpointError(
            f"{source}: the model uses the exact GELU (gelu_approximate={config.gelu_approximate!r}), but llama.cpp's "
            "gpt2 and starcoder2 compute GELU's tanh approximation; only gelu_approximate='tanh' models export to GGUF"
        )
    floats = {
        "norm_eps": config.norm_eps,
        **({"rope_base": config.rope_base} if config.position_encoding == "rope" else {}),
    }
    for name, value in floats.items():
        stored = as_float32(value)
        if not math.isfinite(stored) or (value != 0 and stored == 0):
            raise CheckpointError(
                f"{source}: {name}={value!r} cannot be written in GGUF, which stores it as float32 (it would be "
                f"{stored!r})"
            )
    if end_of_text is None:
        raise CheckpointError(
            f"{source}: the tokenizer has no {END_OF_TEXT}, and llama.cpp's byte-level BPE then takes token 11 as the "
            "end of text, so its generations would stop where manas' do not"
        )


def _check_layer_patterns(config: GPTConfig, source: Path) -> None:
    """The layers without rope are the ones llama.cpp's smollm3 leaves it out of: every fourth (gemma3's window
    layers go in the file, as sliding_window_pattern)."""
    every_fourth = list(range(SMOLLM3_NO_ROPE_INTERVAL - 1, config.n_layer, SMOLLM3_NO_ROPE_INTERVAL))
    if config.nope_layers and config.nope_layers != every_fourth:
        raise CheckpointError(
            f"{source}: llama.cpp's smollm3 leaves rope out of every fourth layer, not of layers "
            f"{', '.join(map(str, config.nope_layers[:8]))}{', ...' if len(config.nope_layers) > 8 else ''}"
        )


# --- tensors -----------------------------------------------------------------------------------------------------


def gguf_tensors(gguf: Any, config: GPTConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Some of the model's tensors (a layer's, or one outside the layers) as Hugging Face's under llama.cpp's names,
    float32, in PyTorch's (out, in) layout: GGUF lists dimensions innermost first, so the gguf writer records this
    as llama.cpp's {in, out}. Shapes alone on the meta device, as export plans its file."""
    architecture = architecture_of(config)
    twins = {"starcoder2": starcoder2.hf_tensors, "gpt2": gpt2.hf_tensors, "gemma3": gemma.hf_tensors}
    twins |= {"phi3": phi3.hf_tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[architecture.upper()], config.n_layer)
    tensors = {}
    for name, tensor in twins.get(architecture, llama.hf_tensors)(config, state).items():
        if architecture == "gpt2" and gpt2.is_gpt2_linear_weight(name.removeprefix("transformer.")):
            tensor = tensor.t()  # Conv1D's in×out back to out×in, as llama.cpp's converter does
        if architecture in INTERLEAVED and name.endswith(rotary_layout.QUERY_KEY_TENSORS):
            heads = config.n_head if ".q_proj." in name else config.n_kv_head
            tensor = rotary_layout.from_rotate_half(tensor, heads, config.rotary_dims)  # llama's interleaved pairs
        if architecture == "gemma3" and name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp's gemma3 scales by the weight as stored: its converter adds Gemma's 1
        tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))] = tensor.float().contiguous()
    return tensors


def rope_factor_tensors(config: GPTConfig) -> dict[str, torch.Tensor]:
    """A scaled rope's factors as llama.cpp reads them: phi3's LongRoPE short factors as both lists (manas keeps no
    others), llama's as rope_freqs."""
    if config.rope_factors is None or gemma.is_gemma(config):  # gemma3's: a linear scaling's factor (gguf_fields)
        return {}
    names = (PHI3_SHORT_FACTORS, PHI3_LONG_FACTORS) if architecture_of(config) == "phi3" else ("rope_freqs.weight",)
    return {name: torch.tensor(config.rope_factors, dtype=torch.float32) for name in names}


def readable(gguf: Any, data: np.ndarray, kind: Any) -> np.ndarray:
    """Stored data as llama.cpp will read it: floats as they are (no float32 copy of a float16 embedding), blocks
    dequantized."""
    types = gguf.GGMLQuantizationType
    return data if kind in (types.F32, types.F16) else gguf.quants.dequantize(data, kind)


def stored_form(gguf: Any, shape: tuple[int, ...], kind: Any) -> tuple[tuple[int, ...], Any, int]:
    """(shape, numpy dtype, bytes) of a tensor of `shape` stored as ggml type `kind`, as gguf.quants.quantize makes
    it: floats as they are, blocks as rows of bytes."""
    types = gguf.GGMLQuantizationType
    if kind in (types.F32, types.F16):
        dtype = np.float32 if kind == types.F32 else np.float16
        return shape, dtype, math.prod(shape) * np.dtype(dtype).itemsize
    byte_shape = tuple(gguf.quant_shape_to_byte_shape(shape, kind))
    return byte_shape, np.uint8, math.prod(byte_shape)


def tensor_type(gguf: Any, name: str, tensor: np.ndarray, outtype: str) -> Any:
    """llama.cpp's converter's choice: vectors (norms, biases) and the position table stay float32; matrices are
    f16 or q8_0, falling back to f16 where a row does not split into whole q8_0 blocks."""
    types = gguf.GGMLQuantizationType
    if outtype == "f32" or tensor.ndim == 1 or name == "position_embd.weight":
        return types.F32
    block_size = gguf.GGML_QUANT_SIZES[types.Q8_0][0]
    if outtype == "q8_0" and tensor.shape[-1] % block_size == 0:
        return types.Q8_0
    return types.F16


# --- the file ------------------------------------------------------------------------------------------------------


def add_hyperparameters(writer: Any, gguf: Any, config: GPTConfig, name: str, outtype: str) -> None:
    """Every hyperparameter llama.cpp's loader reads for gpt2, starcoder2, llama and qwen2."""
    file_types = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }
    writer.add_name(name)
    writer.add_file_type(file_types[outtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(config.ffn_width)
    writer.add_block_count(config.n_layer)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.n_kv_head)
    if config.norm == "rmsnorm":
        writer.add_layer_norm_rms_eps(config.norm_eps)
        writer.add_key_length(config.head_size)
        writer.add_value_length(config.head_size)
    else:
        writer.add_layer_norm_eps(config.norm_eps)
    if config.position_encoding == "rope":
        writer.add_rope_dimension_count(config.rotary_dims)
        writer.add_rope_freq_base(config.rope_base)
    if config.rope_scale is not None:  # phi3's LongRoPE attention factor, within its original context
        writer.add_rope_scaling_attn_factors(config.rope_scale)
        writer.add_rope_scaling_orig_ctx_len(config.block_size)
    if config.window_layers is not None:  # gemma3's window, its layers (one flag each) and their rope base
        windows = set(config.window_layers)
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([i in windows for i in range(config.n_layer)])
        writer.add_rope_freq_base_swa(config.local_rope_base or config.rope_base)
    if gemma.is_gemma(config) and config.rope_factors is not None:  # its global layers' (check_exportable: linear)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_factors[0])


def add_tokenizer(
    writer: Any, gguf: Any, bpe: ByteLevelBPE, pre: str, vocab_size: int, end_of_text: int, bos: int | None
) -> None:
    """GGUF's byte-level BPE ("gpt2"): every id's token, its type, the merges in the order they apply. Ids without a
    token (a vocabulary padded past the tokenizer) get placeholders that no text encodes to, as llama.cpp's
    converter writes them."""
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for table, kind in ((bpe.tokens, gguf.TokenType.NORMAL), (bpe.special, gguf.TokenType.CONTROL)):
        for token, i in table.items():
            tokens[i], types[i] = token, kind
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(bpe.merges)
    writer.add_bos_token_id(end_of_text if bos is None else bos)
    writer.add_eos_token_id(end_of_text)
    writer.add_add_bos_token(bos is not None)  # as manas: a tokenizer's own BOS, never a prepended end-of-text
    writer.add_add_eos_token(False)


def export_gguf(checkpoint_path: Path, out: Path, *, outtype: str = "f16", force: bool = False) -> ExportedGGUF:
    """Write checkpoint_path (a manas checkpoint or a GGUF file) as one GGUF file, atomically, a layer at a time
    (the header first, from the tensors' shapes alone); refuse before writing anything it cannot export."""
    gguf = import_gguf("writing GGUF")
    check_output_file(out, force, inputs=(checkpoint_path,))
    model = model_tensors(checkpoint_path)  # quantized weights export dequantized
    config = model.config
    end_of_text = model.encoding._special_tokens.get(getattr(model.encoding, "end_of_text", END_OF_TEXT))
    check_exportable(config, end_of_text, checkpoint_path)
    # refuses split patterns llama.cpp does not have
    bpe = byte_level_bpe(model.encoding, checkpoint_path, tuple(PRE_TOKENIZERS))
    pre = PRE_TOKENIZERS.get(model.encoding._pat_str, "gpt-2")  # a tokenizer without merges splits nothing
    architecture = architecture_of(config)

    def groups(meta: bool) -> Iterator[dict[str, torch.Tensor]]:
        yield from (gguf_tensors(gguf, config, group) for group in model.groups(meta=meta))
        yield rope_factor_tensors(config)

    # every tensor's shape and type, in the order they are written: the file's entries come before its data
    planned = {name: (tuple(t.shape), tensor_type(gguf, name, t, outtype)) for group in groups(meta=True)
               for name, t in group.items()}  # fmt: skip

    def write(tmp: str) -> None:
        writer = gguf.GGUFWriter(tmp, architecture)
        try:
            add_hyperparameters(writer, gguf, config, checkpoint_path.stem, outtype)
            add_tokenizer(writer, gguf, bpe, pre, config.vocab_size, end_of_text, bos_id(model.encoding))
            if template := model.metadata.get("chat_template"):
                writer.add_chat_template(template)  # llama-server and ollama chat in the model's own format
            for name, (shape, kind) in planned.items():
                writer.add_tensor_info(name, *stored_form(gguf, shape, kind), kind)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for group in groups(meta=False):  # a layer at a time, in the order of the tensors' entries
                for name, tensor in group.items():
                    kind = planned[name][1]
                    data = gguf.quants.quantize(tensor.numpy(), kind)
                    if not np.isfinite(readable(gguf, data, kind)).all():  # a float16 of 1e5 is not
                        raise CheckpointError(
                            f"{checkpoint_path}: tensor {name} holds NaN or infinite values as {kind.name}"
                        )
                    writer.write_tensor_data(data)
        finally:
            writer.close()

    atomic_write(out, write, overwrite=force)
    return ExportedGGUF(out, architecture, outtype, len(planned), out.stat().st_size)
