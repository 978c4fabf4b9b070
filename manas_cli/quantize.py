"""Weight-only int8: the blocks' linear layers and the output layer as int8 matrices with one scale per output row."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .model import GPT

INT8_MAX = 127  # symmetric: -127 … 127, so a row's largest magnitude maps to ±127 exactly
# The products run in bfloat16: torch's int8 CPU kernel is vectorized for bfloat16 inputs only (float32 inputs take
# a scalar loop, several times slower than float32 BLAS).
COMPUTE_DTYPE = torch.bfloat16
# The kernel works row by row; above this many rows (a prompt's prefill) one float32 GEMM over the dequantized
# weight is faster (768 → 2304: 4.0 ms against 3.2 ms at 64 rows, 0.99 against 2.1 ms at 16, on 1 thread).
KERNEL_MAX_ROWS = 32
# What torch's kernel silently assumes (torch 2.13; tested in tests/test_quantize.py): rows of a multiple of 16
# values (others read garbage or crash), and inputs on 64-byte boundaries (its aligned vector loads crash on a
# tensor mapped from a file, or a view into the middle of one).
KERNEL_IN_FEATURES_MULTIPLE = 16
KERNEL_ALIGNMENT = 64
QUANTIZE_SLICE_ELEMENTS = 1 << 18  # 1 MiB of float32 rows: quantize_rows' temporaries fit in cache


def has_int8_kernel() -> bool:
    """Whether this torch has _weight_int8pack_mm (2.4 and later)."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """tensor, or a copy of it on a 64-byte boundary (a fresh allocation is; a slice or a mapped file may not be)."""
    return tensor if tensor.data_ptr() % KERNEL_ALIGNMENT == 0 else tensor.clone()


@torch.no_grad()
def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one absmax scale per row: (int8 (out, in) contiguous, scales (out,) in COMPUTE_DTYPE).

    Each scale is rounded to its stored dtype before its row is divided by it, so the int8 values fit the scale
    that will really multiply them. Done a slice of rows at a time, so the float temporaries stay in cache (several
    times faster on a 124M model than whole-matrix passes through memory)."""
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.size(0), dtype=COMPUTE_DTYPE, device=weight.device)
    rows = max(1, QUANTIZE_SLICE_ELEMENTS // weight.size(1))
    for w, s, out in zip(weight.split(rows), scales.split(rows), q.split(rows)):
        s.copy_((w.abs().amax(dim=1).float() / INT8_MAX).clamp_(min=torch.finfo(COMPUTE_DTYPE).tiny))
        out.copy_((w.float() / s.float()[:, None]).round_().clamp_(-INT8_MAX, INT8_MAX))
    return q, scales


def dequantize_rows(weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (weight.to(torch.float32) * scales.to(torch.float32)[:, None]).to(dtype)


class Int8Linear(nn.Module):
    """y = x·Wᵀ·s + b, W int8 (out, in), s one scale per output row, b float.

    Both ways of computing it give the same numbers up to float32 summation order, so the tokens do not depend on
    which runs: x is rounded to bfloat16, its products with the int8 weights are summed in float32 (exact products),
    scaled, and the result rounded to bfloat16, as torch's int8 CPU kernel does; a few rows (decoding) run that
    kernel, many rows (a prefill), another device or an older torch multiply by the weights dequantized to float32,
    as gpt-fast does. `kernel=False` forces the latter everywhere.

    Move or cast the model before quantizing it: `.to(dtype)` would cast the scales too.
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: nn.Parameter | None = None,
                 kernel: bool | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", _aligned(weight.contiguous()))
        self.register_buffer("scales", _aligned(scales.contiguous()))
        self.bias = bias
        fits = weight.size(1) % KERNEL_IN_FEATURES_MULTIPLE == 0
        self.kernel = fits and has_int8_kernel() and kernel is not False

    @property
    def in_features(self) -> int:
        return self.weight.size(1)

    @property
    def out_features(self) -> int:
        return self.weight.size(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.size(-1)).to(self.scales.dtype).contiguous()
        if self.kernel and rows.device.type == "cpu" and rows.size(0) <= KERNEL_MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(_aligned(rows), self.weight, self.scales)
        else:
            y = (F.linear(rows.float(), self.weight.float()) * self.scales.float()).to(self.scales.dtype)
        y = y.view(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = torch.add(self.bias, y)  # one op: the sum takes the bias's (the model's) dtype
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantizable(model: GPT) -> list[str]:
    """Qualified names of the layers int8 replaces: every linear layer of the blocks, then the output layer."""
    blocks = [name for name, module in model.blocks.named_modules(prefix="blocks")
              if isinstance(module, (nn.Linear, Int8Linear))]
    return blocks + ["lm_head"]


def is_quantized(model: GPT) -> bool:
    return isinstance(model.lm_head, Int8Linear)


def int8_tensor_names(model: GPT) -> list[str]:
    return [name for name, tensor in model.state_dict().items() if tensor.dtype == torch.int8]


def _replace(model: GPT, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


@torch.no_grad()
def quantize_model(model: GPT, kernel: bool | None = None) -> GPT:
    """Replace the blocks' linear layers and the output layer by Int8Linear, in place; embeddings and norms stay.

    The output layer is tied to the token embedding: it gets a quantized copy, and the embedding lookup keeps the
    float rows. `kernel`: None uses torch's int8 CPU kernel where it exists, False always dequantizes.
    """
    if is_quantized(model):
        raise ValueError("the model is already quantized to int8")
    for name in quantizable(model):
        linear = model.get_submodule(name)
        _replace(model, name, Int8Linear(*quantize_rows(linear.weight), linear.bias, kernel))
    return model


def load_int8(model: GPT, tensors: dict[str, torch.Tensor], kernel: bool | None = None) -> GPT:
    """Install stored int8 layers in a float model, in place: `{name}.weight` (int8) and `{name}.scales` for each
    quantizable name, moved to the model's device, the float layers' biases kept."""
    for name in quantizable(model):
        linear = model.get_submodule(name)
        device = linear.weight.device
        weight, scales = tensors[f"{name}.weight"].to(device), tensors[f"{name}.scales"].to(device, COMPUTE_DTYPE)
        _replace(model, name, Int8Linear(weight, scales, linear.bias, kernel))
    return model


@torch.no_grad()
def dequantize_model(model: GPT) -> GPT:
    """Float nn.Linear layers again, in place, holding the int8 weights times their scales (for exporting an int8
    checkpoint to tools that read float weights). The output layer is tied to the token embedding again, which in
    a checkpoint of version 2 holds those same rows, dequantized. A float model is returned as it is."""
    if not is_quantized(model):
        return model
    for name in quantizable(model)[:-1]:
        layer = model.get_submodule(name)
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        linear.weight = nn.Parameter(dequantize_rows(layer.weight, layer.scales, model.token_embedding.weight.dtype))
        linear.bias = layer.bias
        _replace(model, name, linear)
    model.lm_head = nn.Linear(model.config.n_embd, model.config.vocab_size, bias=False, device="meta")
    model.lm_head.weight = model.token_embedding.weight
    return model


def weights_name(model: GPT) -> str:
    """What the weights are, as reports name them: "int8" or the float dtype."""
    return "int8" if is_quantized(model) else str(model.token_embedding.weight.dtype).removeprefix("torch.")


def weights_bytes(model: GPT) -> int:
    """Bytes of the weights in memory: every stored tensor once (the tied output layer is the embedding itself;
    a quantized one is an int8 copy with its scales)."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())
