"""Weight-only quantization of the blocks' linear layers and the output layer: int8 with one scale per output row,
or int4 with a scale and a zero per group of 32 values along a row."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..engine.config import INT4_GROUP_SIZE, stored_names
from ..errors import InputError
from .model import GPT, GPTConfig

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
INT4_LEVELS = 15  # codes 0 … 15
INT4_MIDDLE_CODE = 8  # a group's zero is the value this code stands for
INT4_KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 CPU kernel accepts
INT4_KERNEL_ROWS_MULTIPLE = 16  # and its packing requires of the output rows


def has_int8_kernel() -> bool:
    """Whether this torch has _weight_int8pack_mm (2.4 and later)."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def has_int4_kernel() -> bool:
    """Whether this torch has the int4 CPU kernel (2.6 and later)."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


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


@torch.no_grad()
def quantize_groups(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, ...]:
    """Asymmetric 4-bit codes by groups of `group_size` along each row: (codes (out, in/2) uint8, scales and zeros
    (out, in/group) in COMPUTE_DTYPE). A group's 16 levels span its minimum to its maximum; scale and zero are
    rounded to their stored dtype before the codes are chosen, so the codes fit what will really dequantize them."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"int4 groups of {group_size} must divide the rows' {in_features} values")
    codes = torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(out_features, in_features // group_size, dtype=COMPUTE_DTYPE, device=weight.device)
    zeros = torch.empty_like(scales)
    rows = max(1, QUANTIZE_SLICE_ELEMENTS // in_features)
    for w, s, z, out in zip(weight.split(rows), scales.split(rows), zeros.split(rows), codes.split(rows)):
        groups = w.float().unflatten(1, (-1, group_size))
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        s.copy_(((high - low) / INT4_LEVELS).clamp_(min=torch.finfo(COMPUTE_DTYPE).tiny))
        z.copy_(low + s.float() * INT4_MIDDLE_CODE)
        q = ((groups - z.float()[..., None]) / s.float()[..., None]).round_().add_(INT4_MIDDLE_CODE)
        out.copy_(pack_codes(q.clamp_(0, INT4_LEVELS).flatten(1)))
    return codes, scales, zeros


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0…15 (out, in) two to a byte, (out, in/2) uint8: column 2i in the low four bits, 2i+1 in the high."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(1)


def dequantize_groups(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    groups = unpack_codes(codes).float().unflatten(1, (scales.size(1), -1)) - INT4_MIDDLE_CODE
    weight = torch.addcmul(zeros.float()[..., None], groups, scales.float()[..., None])
    return weight.flatten(1).to(dtype)


class QuantizedLinear(nn.Module):
    """y = x·Wᵀ + b with W stored quantized, b float: the computation int8 and int4 share.

    Both ways of computing it give the same numbers up to float32 summation order, so the tokens do not depend on
    which runs: x is rounded to bfloat16, its products with the dequantized weights are summed in float32, and the
    result rounded to bfloat16, as torch's CPU kernels do; up to `kernel_max_rows` rows run the kernel, more rows,
    another device or an older torch multiply by the weights dequantized to float32, as gpt-fast does.

    Move or cast the model before quantizing it: `.to(dtype)` would cast the scales too.
    """

    kernel_max_rows: int
    kernel: bool
    bias: nn.Parameter | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.size(-1)).to(COMPUTE_DTYPE).contiguous()
        if self.kernel and rows.device.type == "cpu" and rows.size(0) <= self.kernel_max_rows:
            y = self.kernel_product(rows)
        else:
            y = self.float_product(rows.float()).to(COMPUTE_DTYPE)
        y = y.view(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = torch.add(self.bias, y)  # one op: the sum takes the bias's (the model's) dtype
        return y.to(x.dtype)

    def kernel_product(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def float_product(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight matrix (out, in) as the products see it."""
        raise NotImplementedError

    def overflowing_tensor(self) -> str | None:
        """The stored tensor ("scales" or "zeros") whose values make a dequantized weight infinite in float32."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(QuantizedLinear):
    """W = int8 (out, in) × one scale per output row."""

    kernel_max_rows = KERNEL_MAX_ROWS

    def __init__(
        self, weight: torch.Tensor, scales: torch.Tensor, bias: nn.Parameter | None = None, kernel: bool | None = None
    ) -> None:
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

    def kernel_product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(_aligned(rows), self.weight, self.scales)

    def float_product(self, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, self.weight.float()) * self.scales.float()

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_rows(self.weight, self.scales, dtype)

    def overflowing_tensor(self) -> str | None:
        return None if torch.isfinite(self.scales.float().abs().amax() * INT8_MAX) else "scales"


class Int4Linear(QuantizedLinear):
    """W in groups of `group_size` consecutive values of a row, each group g: (code − 8) × scale_g + zero_g, codes
    0…15 stored two to a byte (FORMAT.md, "int4"). zero_g is the value code 8 stands for: torch's int4 kernels
    take the scales and zeros in this form."""

    # torch's int4 CPU kernel is faster than a float32 GEMM at every row count measured (3072 × 768, 1 thread:
    # 1.8 against 3.3 ms at 64 rows, 14 against 24 ms at 512), so it runs prefills too.
    kernel_max_rows = 1 << 62

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bias: nn.Parameter | None = None,
        kernel: bool | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer("weight", codes.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("zeros", zeros.contiguous())
        self.bias = bias
        self.group_size = 2 * codes.size(1) // scales.size(1)
        self.kernel = (
            kernel is not False
            and has_int4_kernel()
            and codes.device.type == "cpu"
            and self.group_size in INT4_KERNEL_GROUP_SIZES
        )
        if self.kernel:
            self._pack_for_kernel()

    @property
    def in_features(self) -> int:
        return 2 * self.weight.size(1)

    @property
    def out_features(self) -> int:
        return self.weight.size(0)

    def _pack_for_kernel(self) -> None:
        """The kernel's own layout of codes, scales and zeros (it depends on the CPU's vector width, so it is made
        here, never stored), with the rows padded to a multiple of 16 as the kernel requires."""
        padding = (0, 0, 0, -self.out_features % INT4_KERNEL_ROWS_MULTIPLE)
        codes = F.pad(unpack_codes(self.weight).to(torch.int32), padding)
        groups = torch.stack((self.scales, self.zeros), dim=-1).to(COMPUTE_DTYPE)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2), persistent=False)
        self.register_buffer(
            "packed_groups", F.pad(groups, (0, 0, *padding)).transpose(0, 1).contiguous(), persistent=False
        )

    def kernel_product(self, rows: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.packed_groups)
        return y[:, : self.out_features].contiguous() if y.size(1) != self.out_features else y

    def float_product(self, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, self.dequantized(torch.float32))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_groups(self.weight, self.scales, self.zeros, dtype)

    def overflowing_tensor(self) -> str | None:
        spread = self.scales.float().abs() * INT4_MIDDLE_CODE  # codes reach 8 steps either side of the zero
        if not torch.isfinite(spread).all():
            return "scales"
        return None if torch.isfinite(spread + self.zeros.float().abs()).all() else "zeros"


def quantizable(model: GPT) -> list[str]:
    """Qualified names of the layers quantization replaces: every linear layer of the blocks, then the output layer."""
    blocks = [
        name
        for name, module in model.blocks.named_modules(prefix="blocks")
        if isinstance(module, (nn.Linear, QuantizedLinear))
    ]
    return blocks + ["lm_head"]


def quantization(model: GPT) -> str | None:
    """ "int8", "int4", or None for float weights."""
    return {Int8Linear: "int8", Int4Linear: "int4"}.get(type(model.lm_head))


def is_quantized(model: GPT) -> bool:
    return quantization(model) is not None


def quantized_tensor_names(model: GPT) -> list[str]:
    return [name for name, tensor in model.state_dict().items() if tensor.dtype in (torch.int8, torch.uint8)]


def _replace(model: GPT, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def check_quantizable(config: GPTConfig, kind: str) -> None:
    """int4's groups must divide every row: the rows are n_embd, the MLP's or the heads' widths long."""
    widths = config.row_widths
    if kind == "int4" and (odd := [name for name, width in widths.items() if width % INT4_GROUP_SIZE]):
        raise ValueError(
            f"int4 quantizes groups of {INT4_GROUP_SIZE} values: {odd[0]} ({widths[odd[0]]}) must be a "
            f"multiple of {INT4_GROUP_SIZE}; use int8 for this model"
        )


def check_quantizable_from(config: GPTConfig, kind: str, source: object) -> None:
    """check_quantizable, a width int4's groups do not divide being one InputError naming source (the file the
    model comes from)."""
    try:
        check_quantizable(config, kind)
    except ValueError as exc:
        raise InputError(f"{source}: {exc}") from None


def quantize_checked(model: GPT, kind: str, source: object) -> None:
    """quantize_model, after check_quantizable_from."""
    check_quantizable_from(model.config, kind, source)
    quantize_model(model, kind)


@torch.no_grad()
def quantize_model(model: GPT, kind: str = "int8", kernel: bool | None = None) -> GPT:
    """Replace the blocks' linear layers and the output layer by quantized ones, in place; embeddings and norms stay.

    A tied output layer gets a quantized copy, and the embedding lookup keeps the float rows. `kernel`: None uses
    torch's CPU kernel where it exists, False always dequantizes.
    """
    if is_quantized(model):
        raise ValueError(f"the model is already quantized to {quantization(model)}")
    check_quantizable(model.config, kind)
    for name in quantizable(model):
        linear = model.get_submodule(name)
        if kind == "int8":
            layer = Int8Linear(*quantize_rows(linear.weight), linear.bias, kernel)
        else:
            layer = Int4Linear(*quantize_groups(linear.weight), linear.bias, kernel)
        _replace(model, name, layer)
    return model


def _stored(tensors: dict[str, torch.Tensor], name: str, kind: str) -> list[torch.Tensor]:
    """`{name}.weight` and its scales (and int4's zeros), the latter in COMPUTE_DTYPE."""
    weight, *groups = (tensors[f"{name}.{suffix}"] for suffix in stored_names(kind))
    return [weight, *(g.to(COMPUTE_DTYPE) for g in groups)]


def dequantize_stored(tensors: dict[str, torch.Tensor], name: str, kind: str) -> torch.Tensor:
    """The float32 matrix that `{name}.weight` and its companions stand for."""
    return (dequantize_rows if kind == "int8" else dequantize_groups)(*_stored(tensors, name, kind))


def load_quantized(model: GPT, tensors: dict[str, torch.Tensor], kind: str, kernel: bool | None = None) -> GPT:
    """Install stored quantized layers in a float model, in place: for each quantizable name, its stored tensors
    (`{name}.weight`, `{name}.scales`, and int4's `{name}.zeros`), moved to the model's device, the float layers'
    biases kept."""
    layer_class = Int8Linear if kind == "int8" else Int4Linear
    for name in quantizable(model):
        linear = model.get_submodule(name)
        stored = [t.to(linear.weight.device) for t in _stored(tensors, name, kind)]
        _replace(model, name, layer_class(*stored, linear.bias, kernel))
    return model


@torch.no_grad()
def dequantize_model(model: GPT) -> GPT:
    """Float nn.Linear layers again, in place, holding the quantized weights dequantized (for exporting a quantized
    checkpoint to tools that read float weights). A tied output layer is tied to the token embedding again, which
    in a quantized checkpoint holds those same rows, dequantized. A float model is returned as it is."""
    if not is_quantized(model):
        return model
    tied = model.config.tie_embeddings
    for name in quantizable(model)[:-1] if tied else quantizable(model):
        layer = model.get_submodule(name)
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        linear.weight = nn.Parameter(layer.dequantized(model.token_embedding.weight.dtype))
        linear.bias = layer.bias
        _replace(model, name, linear)
    if tied:
        model.lm_head = nn.Linear(model.config.n_embd, model.config.vocab_size, bias=False, device="meta")
        model.lm_head.weight = model.token_embedding.weight
    return model


def weights_name(model: GPT) -> str:
    """What the weights are, as reports name them: "int8", "int4" or the float dtype."""
    return quantization(model) or str(model.token_embedding.weight.dtype).removeprefix("torch.")


def weights_bytes(model: GPT) -> int:
    """Bytes of the weights in memory: every stored tensor once (the tied output layer is the embedding itself;
    a quantized one is a copy with its scales), and the int4 kernel's own packing of its layers."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    for layer in model.modules():
        if isinstance(layer, Int4Linear) and layer.kernel:
            tensors.update({t.data_ptr(): t for t in (layer.packed, layer.packed_groups)})
    return sum(t.numel() * t.element_size() for t in tensors.values())
