"""A torch model's tensors as the native core reads them: the loader native/model.py's NativeGPT is given to run a
torch GPT (formats/mapped_weights.py is the same loader over a checkpoint file's bytes)."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_uint16

from ..native.binding import WEIGHTS_F32, WEIGHTS_INT4, WEIGHTS_INT8, ManasLinear
from .model import GPT
from .quantize import Int8Linear, QuantizedLinear, weights_bytes, weights_name


class TorchWeights:
    """A torch GPT's own tensors (float32 on the CPU, nn.Linear's (out, in) layout), and its int8/int4 layers'
    stored codes, scales and zeros as they are in memory. Its token embedding is its own float table (a model
    quantized in memory keeps the original rows there; one loaded from a file, the dequantized ones)."""

    def __init__(self, model: GPT) -> None:
        if native_unsupported(model) is not None:
            embedding = model.token_embedding.weight
            raise ValueError(
                f"the native core runs float32 weights on the CPU, not {embedding.dtype} on {embedding.device}"
            )
        self.model, self.config = model.eval(), model.config
        self.name, self.nbytes = weights_name(model), weights_bytes(model)

    def vector(self, name: str):
        module_name, _, attribute = name.rpartition(".")
        if module_name == "position_embedding" and getattr(self.model, "position_embedding", None) is None:
            return None
        return pointer(getattr(self.model.get_submodule(module_name), attribute, None))  # RMSNorm has no bias

    def linear(self, name: str) -> ManasLinear:
        layer = self.model.get_submodule(name)
        bias = pointer(layer.bias)
        if isinstance(layer, QuantizedLinear):
            kind = WEIGHTS_INT8 if isinstance(layer, Int8Linear) else WEIGHTS_INT4
            zeros, group = (pointer(layer.zeros, c_uint16), layer.group_size) if kind == WEIGHTS_INT4 else (None, 0)
            return ManasLinear(
                kind,
                layer.in_features,
                layer.out_features,
                group,
                layer.weight.data_ptr(),
                pointer(layer.scales, c_uint16),
                zeros,
                bias,
            )
        pointer(layer.weight)  # checks the layout
        return ManasLinear(
            WEIGHTS_F32, layer.in_features, layer.out_features, 0, layer.weight.data_ptr(), None, None, bias
        )

    def release(self, linear: ManasLinear) -> None:
        """The model's tensors stay: they are torch's, and torch may run the model too."""


def pointer(tensor, kind=c_float):
    """A tensor's memory as a C pointer; it must be contiguous in the layout core.c reads (nn.Linear's (out, in))."""
    if tensor is None:
        return None
    if not tensor.is_contiguous():
        raise ValueError(f"the native core reads contiguous tensors, got strides {tensor.stride()}")
    return ctypes.cast(tensor.data_ptr(), POINTER(kind))


def native_unsupported(model: GPT) -> str | None:
    """Why the core cannot run this torch model, or None: it runs float32, int8 and int4 weights on the CPU."""
    weights = model.token_embedding.weight
    if weights.device.type != "cpu":
        return f"the model is on {weights.device.type.upper() if weights.device.type == 'cuda' else weights.device}"
    if str(weights.dtype) != "torch.float32":
        return f"the core runs float32, int8 and int4 weights, not {str(weights.dtype).removeprefix('torch.')}"
    return None
