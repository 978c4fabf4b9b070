"""A GGUF file's hyperparameters as the Hugging Face config of its architecture (as llama.cpp's converter wrote
them from one), and the check of its layer count: what both readers of a GGUF take, the conversion (gguf_model.py)
and the core's in-place run (gguf_weights.py). No torch."""

from __future__ import annotations

import math
import re
from pathlib import Path

from ..engine.config import GPTConfig, as_float32
from ..errors import CheckpointError
from .gemma import GEMMA3_27B_LAYERS
from .gguf_metadata import Layout, TensorInfo
from .importing import make_config

# llama.cpp's names of the models manas runs
ARCHITECTURES = ("llama", "qwen2", "qwen3", "smollm3", "gemma3", "phi3", "gpt2", "starcoder2")
LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "smollm3")  # RMSNorm, rope and SwiGLU: formats/llama.py's models
# Those whose converter stores queries and keys in interleaved rope pairs (llama.cpp's NORM rope), manas' layout; the
# others keep Hugging Face's rotate-half pairs (NEOX).
INTERLEAVED = ("llama", "smollm3")
# What a refusal lists: the architectures, and models they hold
RUNS = (
    f"{', '.join(ARCHITECTURES)}: SmolLM2, TinyLlama, Llama 2 and 3.x, Qwen2, 2.5 and 3, SmolLM3, Gemma 3 (text), "
    "Phi-3 and Phi-4-mini, GPT-2, StarCoder2"
)
# llama.cpp's smollm3 leaves rope out of every fourth layer (its n_no_rope_layer_step, not read from the file)
SMOLLM3_NO_ROPE_INTERVAL = 4
# llama.cpp's gemma3 without a sliding_window_pattern: five window layers of every six; and its local rope base
GEMMA3_WINDOW_PATTERN, GEMMA3_LOCAL_ROPE_BASE = 6, 10000.0
HF_MODEL_TYPES = {"gemma3": "gemma3_text"}  # the Hugging Face model_type of an architecture, where it differs
# A phi3 file's LongRoPE factors (one per rope pair): manas runs within the original context, by the short ones
PHI3_SHORT_FACTORS, PHI3_LONG_FACTORS = "rope_factors_short.weight", "rope_factors_long.weight"


def check_block_count(layout: Layout, architecture: str, path: Path) -> None:
    """The block_count the metadata claims is the number of layers its tensors hold (blk.0. to blk.N−1.): a claim
    of 2^31 layers in a small file is refused before anything is sized by it."""
    layers = {int(match[1]) for tensor in layout.tensors if (match := re.match(r"blk\.(\d+)\.", tensor.name))}
    claimed = _field(layout.fields, architecture, "block_count")
    if type(claimed) is not int or claimed != len(layers) or max(layers, default=-1) != claimed - 1:
        raise CheckpointError(
            f"{path}: its {architecture}.block_count {claimed!r} does not match its tensors' layers "
            f"({len(layers):,} numbered blk.N)"
        )


def _field(fields: dict, architecture: str, key: str, default: object = None) -> object:
    return fields.get(f"{architecture}.{key}", default)


def hf_config(
    fields: dict, architecture: str, shapes: dict[str, tuple[int, ...]], path: Path, short_factors: list | None = None
) -> dict:
    """The Hugging Face config.json of the file's hyperparameters (as llama.cpp's converter wrote them from one);
    `shapes`: its tensors' shapes by name, PyTorch's order; short_factors: a phi3 file's rope_factors_short."""

    def value(key: str, default: object = None) -> object:
        return _field(fields, architecture, key, default)

    if len(shapes.get("token_embd.weight", ())) != 2:
        raise CheckpointError(f"{path}: the file has no token_embd.weight matrix")
    vocab_size, _ = shapes["token_embd.weight"]
    if architecture == "gpt2":
        values = {
            "n_embd": value("embedding_length"),
            "n_inner": value("feed_forward_length"),
            "n_layer": value("block_count"),
            "n_head": value("attention.head_count"),
            "n_positions": value("context_length", 1024),
            "layer_norm_epsilon": _decimal(value("attention.layer_norm_epsilon", 1e-5)),
            "activation_function": "gelu_new",  # llama.cpp's gpt2 computes GELU's tanh approximation
        }
    else:
        values = {
            "hidden_size": value("embedding_length"),
            "intermediate_size": value("feed_forward_length"),
            "num_hidden_layers": value("block_count"),
            "num_attention_heads": value("attention.head_count"),
            "num_key_value_heads": value("attention.head_count_kv"),
            "max_position_embeddings": value("context_length", 2048),
            "rope_theta": _decimal(value("rope.freq_base", 10000.0)),
        }
    if architecture == "starcoder2":
        values |= {
            "norm_epsilon": _decimal(value("attention.layer_norm_epsilon", 1e-5)),
            "hidden_act": "gelu_pytorch_tanh",
        }
    if architecture == "smollm3":
        values["no_rope_layer_interval"] = SMOLLM3_NO_ROPE_INTERVAL
    if architecture in LLAMA_FAMILY:
        values |= {
            "rms_norm_eps": _decimal(value("attention.layer_norm_rms_epsilon", 1e-6)),
            "head_dim": value("attention.key_length"),
            "tie_word_embeddings": "output.weight" not in shapes,
        }
    if (scaling := value("rope.scaling.type")) not in (None, "none"):  # another than linear refused by name
        values["rope_scaling"] = {"type": scaling, "factor": _decimal(value("rope.scaling.factor"))}
    if architecture == "gemma3":
        values |= _gemma3_config(value, shapes, path)
    if architecture == "phi3":
        values |= _phi3_config(value, shapes, short_factors)
    if architecture in INTERLEAVED and "blk.0.attn_q.bias" in shapes:
        values["attention_bias"] = values["mlp_bias"] = "blk.0.ffn_up.bias" in shapes
    values |= {"model_type": HF_MODEL_TYPES.get(architecture, architecture), "vocab_size": vocab_size}
    return {key: item for key, item in values.items() if item is not None}


def _phi3_config(value, shapes: dict[str, tuple[int, ...]], short_factors: list | None) -> dict:
    """A phi3 file's Phi-3 fields as llama.cpp reads them: its rotary dimensions, its LongRoPE short factors and
    attention factor, no sliding window (llama.cpp runs Phi-3's without one)."""
    width, heads = value("embedding_length"), value("attention.head_count")
    head_size = width // heads if type(width) is int and type(heads) is int and heads > 0 else None
    rotary = value("rope.dimension_count", head_size)
    values = {
        "rms_norm_eps": _decimal(value("attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_word_embeddings": "output.weight" not in shapes,
        "partial_rotary_factor": rotary / head_size if type(rotary) is int and head_size else 1.0,
        "original_max_position_embeddings": value("rope.scaling.original_context_length"),
    }
    if short_factors is not None:
        attention = _decimal(value("rope.scaling.attn_factor", 1.0))
        values["rope_scaling"] = {"rope_type": "longrope", "short_factor": short_factors,
                                  "long_factor": short_factors, "attention_factor": attention}  # fmt: skip
    return values


def _gemma3_config(value, shapes: dict[str, tuple[int, ...]], path: Path) -> dict:
    """A gemma3 file's Gemma 3 fields as llama.cpp reads them: its window, which layers slide (sliding_window_pattern,
    an array of flags or every n-th layer global, 6 without it), the local layers' rope base (10,000 without it)."""
    layers, window = value("block_count"), value("attention.sliding_window", 0)
    if type(layers) is not int or type(window) is not int:
        raise CheckpointError(f"{path}: its gemma3.block_count and attention.sliding_window must be integers")
    width, heads, head_dim = value("embedding_length"), value("attention.head_count"), value("attention.key_length")
    scalar = head_dim  # llama.cpp scales Gemma 3 27B's attention (62 layers) by 1/√(n_embd / n_head), in integers
    if layers == GEMMA3_27B_LAYERS and type(width) is int and type(heads) is int and heads > 0:
        scalar = width // heads
    pattern = value("attention.sliding_window_pattern", GEMMA3_WINDOW_PATTERN)
    if isinstance(pattern, list):
        slides = [bool(flag) for flag in pattern]
    elif type(pattern) is int and pattern >= 0:
        slides = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    else:
        raise CheckpointError(f"{path}: its gemma3.attention.sliding_window_pattern {pattern!r} is not a pattern")
    return {
        "head_dim": head_dim,
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": value("final_logit_softcapping") or None,  # llama.cpp caps where set; manas refuses
        "sliding_window": window if window > 0 else None,
        "layer_types": ["sliding_attention" if slide and window > 0 else "full_attention" for slide in slides],
        "rope_local_base_freq": _decimal(value("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
        "rms_norm_eps": _decimal(value("attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "output.weight" not in shapes,
    }


def with_rope_factors(config: GPTConfig, factors: list[float] | None, path: Path) -> GPTConfig:
    """The config with a llama file's rope_freqs.weight as its rope_factors (Llama 3.1's and 3.2's scaled rope),
    each checked as the config checks them: one per rope pair, positive and finite."""
    if factors is None:
        return config
    return make_config(path, **{**config.__dict__, "rope_factors": factors})


def _decimal(value: object) -> object:
    """A float GGUF stores as float32, as the shortest decimal that is that float32 (1e-06, not 9.99999997e-07):
    the config.json's value it was written from."""
    if not isinstance(value, float) or not math.isfinite(value):
        return value
    stored = as_float32(value)
    # the fewest significant digits that read back as the same float32 (9 always do); not numpy's str(), which a
    # GGUF run would import for this alone (some 10 MB of its memory)
    for digits in range(1, 10):
        if as_float32(shortest := float(f"{stored:.{digits}g}")) == stored:
            return shortest
    return stored


def tensor_extent(tensor: TensorInfo, layout: Layout, block: tuple[int, int], path: Path) -> tuple[int, int]:
    """Where a tensor of `block` (values, bytes per block) lies in the file, (start, bytes), checked: whole blocks
    along its rows, every byte its shape implies inside the file (an offset that would wrap in 64 bits is past the
    end) and aligned, before anything reads it."""
    values, block_bytes = block
    if not tensor.dims or any(n <= 0 for n in tensor.dims) or tensor.dims[0] % values:
        raise CheckpointError(
            f"{path}: tensor {tensor.name}'s shape {list(tensor.dims)} is not whole blocks of {values} values"
        )
    size = math.prod(tensor.dims) // values * block_bytes
    start = layout.data_start + tensor.offset
    if tensor.offset % layout.alignment or start + size > layout.size:
        raise CheckpointError(
            f"{path}: tensor {tensor.name}'s data (offset {tensor.offset:,}, {size:,} bytes) is "
            + ("not aligned" if tensor.offset % layout.alignment else "past the end of the file")
        )
    return start, size


def check_apart(extents: list[tuple[int, int, str]], path: Path) -> None:
    """No two tensors' (start, end, name) share a byte."""
    extents = sorted(extents)
    for (_, end, name), (start, _, other) in zip(extents, extents[1:]):
        if start < end:
            raise CheckpointError(f"{path}: tensors {name} and {other} overlap in the file")
