"""Rotary position embedding (RoPE) by interleaved pairs, as in the original LLaMA reference code."""

from __future__ import annotations

import torch

from .model import CausalSelfAttention, GPTConfig


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


class RotaryAttention(CausalSelfAttention):
    """Causal self-attention whose queries and keys are rotated by their absolute position."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.rope_base, self.block_size = config.rope_base, config.block_size
        # Derived from the config, so never saved: a checkpoint holds only learned weights. Built for the positions
        # used so far (doubling, up to block_size), so a block_size that no tensor backs allocates nothing.
        self.register_buffer("cos", torch.empty(0, config.head_size // 2), persistent=False)
        self.register_buffer("sin", torch.empty(0, config.head_size // 2), persistent=False)

    def encode_positions(self, qk: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Rotate queries and keys (B, heads, T, hs) together: they share positions, and one call is half the ops."""
        end = start_pos + qk.size(2)
        if end > self.cos.size(0):
            positions = min(max(end, 2 * self.cos.size(0)), self.block_size)
            with torch.inference_mode(False):  # plain tensors: a later training step may save them for backward
                cos, sin = rope_tables(self.head_size, positions, self.rope_base)
            self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)
        positions = slice(start_pos, end)
        return rotate_pairs(qk, self.cos[positions].to(qk.dtype), self.sin[positions].to(qk.dtype))
