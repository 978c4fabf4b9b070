"""Rotary position embedding (RoPE) by interleaved pairs, as in the original LLaMA reference code."""

from __future__ import annotations

import torch


def rope_tables(head_size: int, positions: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles pos · base^(-2i/head_size), each (positions, head_size // 2)."""
    inv_freq = base ** (-torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[..., 2i], x[..., 2i+1]) of x (..., T, hs) by the angle whose cos/sin are (T, hs/2)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2)
