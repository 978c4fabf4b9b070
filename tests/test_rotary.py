"""Rotary position embedding by interleaved pairs, LLaMA's reference convention."""

from __future__ import annotations

import pytest
import torch

from conftest import complex_rotate, make_model
from manas_cli.torch_engine.rotary import rope_tables, rotate_pairs


def rotate(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    cos, sin = rope_tables(x.size(-1), int(positions.max()) + 1, base)
    return rotate_pairs(x, cos[positions], sin[positions])


@pytest.mark.parametrize("base", [10000.0, 500.0])
@pytest.mark.parametrize("head_size", [2, 8, 16])
def test_rotate_pairs_equals_complex_multiplication(head_size, base):
    x = torch.randn(2, 3, 24, head_size, generator=torch.Generator().manual_seed(head_size))
    positions = torch.arange(24)
    torch.testing.assert_close(rotate(x, positions, base), complex_rotate(x, positions, base), atol=1e-5, rtol=1e-5)


def test_rotate_pairs_rotates_interleaved_pairs_not_halves():
    # GPT-NeoX's "rotate half" pairs x[i] with x[i + hs/2]; manas (like LLaMA's reference code) pairs x[2i], x[2i+1].
    x = torch.zeros(1, 4)
    x[0, 0] = 1.0
    cos, sin = rope_tables(4, 2, 10000.0)
    rotated = rotate_pairs(x, cos[1:2], sin[1:2])  # position 1, pair 0 turns by exactly 1 radian
    torch.testing.assert_close(
        rotated, torch.tensor([[torch.cos(torch.tensor(1.0)), torch.sin(torch.tensor(1.0)), 0.0, 0.0]])
    )


def test_rotation_at_position_zero_is_the_identity():
    x = torch.randn(3, 4, 5, 16, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_tables(16, 1, 10000.0)
    assert torch.equal(rotate_pairs(x, cos, sin), x)


def test_rotated_query_key_dot_product_depends_only_on_their_distance():
    generator = torch.Generator().manual_seed(1)
    q, k = torch.randn(16, generator=generator), torch.randn(16, generator=generator)

    def score(query_pos: int, key_pos: int) -> torch.Tensor:
        rotated_q = rotate(q.view(1, 16), torch.tensor([query_pos]))
        rotated_k = rotate(k.view(1, 16), torch.tensor([key_pos]))
        return (rotated_q * rotated_k).sum()

    for distance in (0, 1, 5, 13):
        scores = torch.stack([score(key_pos + distance, key_pos) for key_pos in (0, 3, 17, 40)])
        torch.testing.assert_close(scores, scores[:1].expand(4), atol=1e-4, rtol=1e-5)
    # and it does depend on the distance: otherwise the check above would hold for no rotation at all
    assert not torch.allclose(score(5, 0), score(6, 0), atol=1e-3)


def test_rotation_preserves_the_length_of_every_pair():
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(2))
    rotated = rotate(x, torch.arange(7))
    torch.testing.assert_close(rotated.view(7, 8, 2).norm(dim=-1), x.view(7, 8, 2).norm(dim=-1))


def test_rope_tables_grow_with_the_positions_used_up_to_block_size_and_are_not_saved():
    """A block_size that no tensor backs allocates nothing: the tables cover the positions run so far."""
    model = make_model("rope", "gqa")
    attention = model.blocks[0].attention
    width = model.config.head_size  # full-width tables: each pair's angle twice
    assert attention.cos.shape == (0, width)
    with torch.inference_mode():
        model(torch.zeros(1, 3, dtype=torch.long))
    assert attention.cos.shape == attention.sin.shape == (3, width)
    with torch.inference_mode():
        model(torch.zeros(1, model.config.block_size, dtype=torch.long))
    assert attention.cos.shape == (model.config.block_size, width)
    torch.testing.assert_close(attention.cos, rope_tables(width, model.config.block_size, model.config.rope_base)[0])
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()  # tables built in inference mode still train
    assert not any(name.endswith((".cos", ".sin")) for name in model.state_dict())


def test_rotary_attention_rotates_by_absolute_position_from_start_pos():
    """Projecting one token at start_pos (what decode does) equals that row of projecting the whole prefix."""
    attention = make_model("rope", "gqa").blocks[1].attention
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = attention.project(attention.heads(x), 0)
        last = attention.project(attention.heads(x[:, -1:]), 9)
    for whole, single in zip(full, last):
        torch.testing.assert_close(single, whole[:, :, -1:], atol=1e-6, rtol=1e-5)
