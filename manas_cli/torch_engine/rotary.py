"""Rotary position embedding (RoPE) by interleaved pairs, as in the original LLaMA reference code."""

from __future__ import annotations

import torch


def rope_tables(
    head_size: int, positions: int, base: float, factors: list[float] | None = None, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The angles pos · base^(-2i/head_size) / factor_i laid out for rotate_pairs, each table (positions, head_size):
    every pair's cos twice, and its sin as (-sin, sin). Full width, so a rotation is two products and a sum.
    head_size: the dimensions that turn (a partial rotary's fewer); factors: each pair's divisor (Llama 3's scaled
    rope, config.rope_factors), 1 where None; scale: cos and sin multiplied by it (LongRoPE's attention factor)."""
    inv_freq = base ** (-torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    if factors is not None:
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float64)
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    if scale is not None:
        cos, sin = cos * scale, sin * scale
    cos, sin = cos.float(), sin.float()
    return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[..., 2i], x[..., 2i+1]) of x (..., T, hs) by its angle, tables (T, hs) from rope_tables:
    (a, b) → (a cos − b sin, b cos + a sin), i.e. x · cos + (b, a) · (−sin, sin)."""
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin)
