"""core.c's structs in ctypes, filled with pointers to the torch model's own tensors (no copy), and the entry
points' signatures."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_double, c_float, c_int, c_int32, c_size_t, c_uint16, c_void_p

import torch
import torch.nn as nn

from ..engine.model import GPT
from ..engine.quantize import Int4Linear, Int8Linear

WEIGHTS_F32, WEIGHTS_INT8, WEIGHTS_INT4 = 0, 1, 2


class ManasLinear(ctypes.Structure):
    _fields_ = [("kind", c_int32), ("n_in", c_int32), ("n_out", c_int32), ("weight", c_void_p),
                ("scales", POINTER(c_uint16)), ("zeros", POINTER(c_uint16)), ("bias", POINTER(c_float))]


class ManasNorm(ctypes.Structure):
    _fields_ = [("weight", POINTER(c_float)), ("bias", POINTER(c_float))]


class ManasLayer(ctypes.Structure):
    _fields_ = [("ln_attention", ManasNorm), ("qkv", ManasLinear), ("output", ManasLinear), ("ln_ffn", ManasNorm),
                ("up", ManasLinear), ("down", ManasLinear)]


class ManasModel(ctypes.Structure):
    _fields_ = [("vocab_size", c_int32), ("block_size", c_int32), ("n_layer", c_int32), ("n_head", c_int32),
                ("n_kv_head", c_int32), ("n_embd", c_int32), ("rope", c_int32), ("gelu_tanh", c_int32),
                ("norm_eps", c_float), ("rope_base", c_double), ("token_embedding", POINTER(c_float)),
                ("position_embedding", POINTER(c_float)), ("layers", POINTER(ManasLayer)),
                ("final_norm", ManasNorm), ("lm_head", ManasLinear)]


class ManasCache(ctypes.Structure):
    _fields_ = [("k", POINTER(c_float)), ("v", POINTER(c_float)), ("capacity", c_int32)]


def declare(library: ctypes.CDLL) -> ctypes.CDLL:
    """The entry points' argument and result types (ctypes would otherwise pass and return C ints)."""
    library.manas_pool_new.argtypes, library.manas_pool_new.restype = [c_int], c_void_p
    library.manas_pool_free.argtypes, library.manas_pool_free.restype = [c_void_p], None
    library.manas_pool_threads.argtypes, library.manas_pool_threads.restype = [c_void_p], c_int
    library.manas_scratch_bytes.argtypes = [POINTER(ManasModel), c_int, c_int]
    library.manas_scratch_bytes.restype = c_size_t
    library.manas_forward.argtypes = [POINTER(ManasModel), c_void_p, c_int, POINTER(c_int32), POINTER(c_int32),
                                      POINTER(ManasCache), c_int, POINTER(c_int32), POINTER(c_float), c_void_p]
    library.manas_forward.restype = c_int
    return library


def pointer(tensor: torch.Tensor | None, kind=c_float):
    """The tensor's memory as a C pointer; it must be contiguous in the layout core.c reads (nn.Linear's (out, in))."""
    if tensor is None:
        return None
    if not tensor.is_contiguous():
        raise ValueError(f"the native core reads contiguous tensors, got strides {tensor.stride()}")
    return ctypes.cast(tensor.data_ptr(), POINTER(kind))


def norm(layer: nn.LayerNorm) -> ManasNorm:
    return ManasNorm(pointer(layer.weight), pointer(layer.bias))


def linear(layer: nn.Module) -> ManasLinear:
    """A float nn.Linear, or int8/int4 layers: their stored codes, scales (and zeros) as they are in memory."""
    bias = pointer(layer.bias)
    if isinstance(layer, Int8Linear):
        return ManasLinear(WEIGHTS_INT8, layer.in_features, layer.out_features, layer.weight.data_ptr(),
                           pointer(layer.scales, c_uint16), None, bias)
    if isinstance(layer, Int4Linear):
        return ManasLinear(WEIGHTS_INT4, layer.in_features, layer.out_features, layer.weight.data_ptr(),
                           pointer(layer.scales, c_uint16), pointer(layer.zeros, c_uint16), bias)
    pointer(layer.weight)  # checks the layout
    return ManasLinear(WEIGHTS_F32, layer.in_features, layer.out_features, layer.weight.data_ptr(), None, None, bias)


def bind(model: GPT) -> tuple[ManasModel, list]:
    """The ManasModel of a float32 (or int8/int4) GPT in eval mode, and what must stay alive while it is used."""
    config = model.config
    layers = (ManasLayer * config.n_layer)(*(
        ManasLayer(norm(block.ln_attention), linear(block.attention.qkv), linear(block.attention.output),
                   norm(block.ln_ffn), linear(block.ffn.up), linear(block.ffn.down))
        for block in model.blocks))
    positions = model.position_embedding.weight if config.position_encoding == "learned" else None
    bound = ManasModel(
        config.vocab_size, config.block_size, config.n_layer, config.n_head, config.n_kv_head, config.n_embd,
        config.position_encoding == "rope", config.gelu_approximate == "tanh", config.norm_eps, config.rope_base,
        pointer(model.token_embedding.weight), pointer(positions), layers, norm(model.final_norm),
        linear(model.lm_head))
    return bound, [layers, model]
