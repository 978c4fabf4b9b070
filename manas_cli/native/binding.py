"""core.c's structs in ctypes, and the entry points' signatures. A ManasModel is filled with pointers into memory
Python owns (weights.py: the mapped checkpoint, or a torch model's tensors): the core copies nothing."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_double, c_float, c_int, c_int32, c_int64, c_size_t, c_uint16, c_uint32, c_uint64, c_void_p

WEIGHTS_F32, WEIGHTS_INT8, WEIGHTS_INT4, WEIGHTS_GGML = 0, 1, 2, 5


class ManasLinear(ctypes.Structure):
    _fields_ = [
        ("kind", c_int32),
        ("n_in", c_int32),
        ("n_out", c_int32),
        ("group", c_int32),
        ("weight", c_void_p),
        ("scales", POINTER(c_uint16)),
        ("zeros", POINTER(c_uint16)),
        ("bias", POINTER(c_float)),
        ("panels", c_void_p),
    ]


class ManasNorm(ctypes.Structure):
    _fields_ = [("weight", POINTER(c_float)), ("bias", POINTER(c_float))]


class ManasLayer(ctypes.Structure):
    _fields_ = [
        ("ln_attention", ManasNorm),
        ("qkv", ManasLinear),
        ("output", ManasLinear),
        ("ln_ffn", ManasNorm),
        ("gate", ManasLinear),
        ("up", ManasLinear),
        ("down", ManasLinear),
        ("key", ManasLinear),
        ("value", ManasLinear),
        ("q_norm", ManasNorm),
        ("k_norm", ManasNorm),
        ("no_rope", c_int32),
        ("ln_attention_out", ManasNorm),
        ("ln_ffn_out", ManasNorm),
        ("window", c_int32),
    ]


class ManasModel(ctypes.Structure):
    _fields_ = [
        ("vocab_size", c_int32),
        ("block_size", c_int32),
        ("n_layer", c_int32),
        ("n_head", c_int32),
        ("n_kv_head", c_int32),
        ("n_embd", c_int32),
        ("head_size", c_int32),
        ("ffn_width", c_int32),
        ("rope", c_int32),
        ("gelu_tanh", c_int32),
        ("rms_norm", c_int32),
        ("swiglu", c_int32),
        ("norm_eps", c_float),
        ("rope_base", c_double),
        ("token_embedding", POINTER(c_float)),
        ("position_embedding", POINTER(c_float)),
        ("layers", POINTER(ManasLayer)),
        ("final_norm", ManasNorm),
        ("lm_head", ManasLinear),
        ("integer_products", c_int32),
        ("rope_halves", c_int32),
        ("token_table", ManasLinear),
        ("rope_factors", POINTER(c_float)),
        ("geglu", c_int32),
        ("embedding_scale", c_float),
        ("local_rope_base", c_double),
        ("rotary_dims", c_int32),
        ("rope_scale", c_double),
        ("attention_scalar", c_float),
    ]


class ManasCache(ctypes.Structure):
    _fields_ = [("k", POINTER(c_float)), ("v", POINTER(c_float)), ("capacity", c_int32)]


MAX_LOGPROBS = 20  # core.c's, and settings.py's


class ManasSampler(ctypes.Structure):
    _fields_ = [
        ("temperature", c_float),
        ("top_k", c_int32),
        ("top_p", c_float),
        ("min_p", c_float),
        ("repetition", c_float),
        ("last_n", c_int32),
        ("frequency", c_float),
        ("presence", c_float),
        ("seed", c_uint64),
        ("logprobs", c_int32),
    ]


class ManasRow(ctypes.Structure):
    _fields_ = [
        ("logits", c_void_p),
        ("window", POINTER(c_int32)),
        ("window_len", c_int32),
        ("counts", POINTER(c_int32)),
        ("row", c_uint64),
        ("position", c_uint64),
    ]


class ManasDraw(ctypes.Structure):
    _fields_ = [
        ("token", c_int32),
        ("logprob", c_float),
        ("top_ids", c_int32 * MAX_LOGPROBS),
        ("top_logprobs", c_float * MAX_LOGPROBS),
    ]


def declare(library: ctypes.CDLL) -> ctypes.CDLL:
    """The entry points' argument and result types (ctypes would otherwise pass and return C ints)."""
    library.manas_pool_new.argtypes, library.manas_pool_new.restype = [c_int, c_int], c_void_p
    library.manas_pool_free.argtypes, library.manas_pool_free.restype = [c_void_p], None
    library.manas_scratch_bytes.argtypes = [POINTER(ManasModel), c_int, c_int]
    library.manas_scratch_bytes.restype = c_size_t
    library.manas_forward.argtypes = [
        POINTER(ManasModel),
        c_void_p,
        c_int,
        POINTER(c_int32),
        POINTER(c_int32),
        POINTER(ManasCache),
        c_int,
        POINTER(c_int32),
        POINTER(c_float),
        c_void_p,
    ]
    library.manas_forward.restype = None
    library.manas_convert.argtypes, library.manas_convert.restype = [c_void_p, c_int, c_int64, c_int, c_void_p], c_int64
    library.manas_first_not_finite.argtypes, library.manas_first_not_finite.restype = [c_void_p, c_int64], c_int64
    library.manas_quantized_overflow.argtypes = [POINTER(ManasLinear)]
    library.manas_panel_bytes.argtypes, library.manas_panel_bytes.restype = [POINTER(ManasLinear)], c_size_t
    library.manas_pack.argtypes, library.manas_pack.restype = [POINTER(ManasLinear), c_void_p], None
    library.manas_dequantized_finite.argtypes = [POINTER(ManasLinear), c_void_p]
    library.manas_ggml_row.argtypes, library.manas_ggml_row.restype = [POINTER(ManasLinear), c_int, c_void_p], None
    library.manas_ggml_products.argtypes = [POINTER(ManasLinear), c_int, c_void_p, c_int, c_void_p, c_void_p, c_void_p]
    library.manas_ggml_products.restype = None
    library.manas_quantized_row_floats.argtypes, library.manas_quantized_row_floats.restype = [c_int], c_size_t
    library.manas_philox.argtypes, library.manas_philox.restype = (
        [POINTER(c_uint32), POINTER(c_uint32), POINTER(c_uint32)],
        None,
    )
    library.manas_uniform.argtypes, library.manas_uniform.restype = [c_uint64, c_uint64, c_uint64], c_double
    library.manas_arithmetic_version.argtypes, library.manas_arithmetic_version.restype = [], c_int
    library.manas_contraction_probe.argtypes = [c_float, c_float, c_float]
    library.manas_contraction_probe.restype = c_float
    library.manas_sample_scratch_bytes.argtypes, library.manas_sample_scratch_bytes.restype = [c_int], c_size_t
    library.manas_sample.argtypes = [
        POINTER(ManasSampler),
        POINTER(ManasRow),
        c_int,
        c_int,
        c_void_p,
        c_void_p,
        POINTER(ManasDraw),
    ]
    library.manas_target_logprobs.argtypes = [c_void_p, c_int, c_int, POINTER(c_int32), POINTER(c_double)]
    return library


WEIGHTS_KINDS = {"float32": WEIGHTS_F32, "int8": WEIGHTS_INT8, "int4": WEIGHTS_INT4}


def stored_bytes(linear: ManasLinear) -> int:
    """The bytes of a layer's weight rows as stored (core.c's row_bytes times n_out): float32 values, int8 codes,
    int4 nibble pairs. (A GGUF's ggml layers are never released: read in place.)"""
    per_value = {WEIGHTS_F32: 4.0, WEIGHTS_INT8: 1.0, WEIGHTS_INT4: 0.5}[linear.kind]
    return int(linear.n_out * linear.n_in * per_value)


def bind(config, weights, integer_products: bool = True) -> ManasModel:
    """The ManasModel of a GPT of `config` whose tensors `weights` points at (formats/mapped_weights.py,
    torch_engine/native_weights.py): vector(name), a float32 pointer or None where the model has no such tensor;
    linear(name), a ManasLinear. integer_products: int8 and int4 layers multiply activations quantized per block
    of 32 in integers (else in float32, as torch's reference does)."""

    def norm(name: str) -> ManasNorm:
        return ManasNorm(weights.vector(f"{name}.weight"), weights.vector(f"{name}.bias"))

    swiglu, gated = config.mlp == "swiglu", config.mlp != "gelu"
    separate = getattr(weights, "separate_qkv", False)  # a GGUF's: queries, keys and values apart

    def attention(i: int) -> tuple[ManasLinear, ManasLinear, ManasLinear]:
        if not separate:
            return weights.linear(f"blocks.{i}.attention.qkv"), ManasLinear(), ManasLinear()
        return tuple(weights.linear(f"blocks.{i}.attention.{part}") for part in ("qkv", "key", "value"))

    layers = (ManasLayer * config.n_layer)()
    for i in range(config.n_layer):
        qkv, key, value = attention(i)
        layers[i] = ManasLayer(
            norm(f"blocks.{i}.ln_attention"),
            qkv,
            weights.linear(f"blocks.{i}.attention.output"),
            norm(f"blocks.{i}.ln_ffn"),
            weights.linear(f"blocks.{i}.ffn.gate") if gated else ManasLinear(),
            weights.linear(f"blocks.{i}.ffn.up"),
            weights.linear(f"blocks.{i}.ffn.down"),
            key,
            value,
            norm(f"blocks.{i}.attention.q_norm") if config.qk_norm else ManasNorm(),
            norm(f"blocks.{i}.attention.k_norm") if config.qk_norm else ManasNorm(),
            not config.uses_rope(i),
            norm(f"blocks.{i}.ln_attention_out") if config.post_norms else ManasNorm(),
            norm(f"blocks.{i}.ln_ffn_out") if config.post_norms else ManasNorm(),
            config.window(i) or 0,
        )
    learned = config.position_encoding == "learned"
    embedding = weights.vector("token_embedding.weight")
    table = weights.token_table() if embedding is None and hasattr(weights, "token_table") else ManasLinear()
    return ManasModel(
        config.vocab_size,
        config.block_size,
        config.n_layer,
        config.n_head,
        config.n_kv_head,
        config.n_embd,
        config.head_size,
        config.ffn_width,
        not learned,
        config.gelu_approximate == "tanh",
        config.norm == "rmsnorm",
        swiglu,
        config.norm_eps,
        config.rope_base,
        embedding,
        weights.vector("position_embedding.weight") if learned else None,
        layers,
        norm("final_norm"),
        weights.linear("lm_head"),
        integer_products,
        getattr(weights, "rope_halves", False),
        table,
        None if config.rope_factors is None else (c_float * len(config.rope_factors))(*config.rope_factors),
        config.mlp == "geglu",
        config.embedding_scale or 0.0,
        config.local_rope_base or 0.0,
        config.rotary_dims,
        config.rope_scale or 0.0,
        config.attention_scalar or 0.0,
    )
