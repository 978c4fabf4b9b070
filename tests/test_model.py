"""The model: config validation, GPT-2's architecture and module names, and the GQA head grouping."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import HEAD_LAYOUTS, complex_rotate, make_model, tiny_config
from manas_cli.torch_engine.model import GPT, CausalSelfAttention, GPTConfig, RotaryAttention


def layer_norm(x: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    variance = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(variance + norm.eps) * norm.weight + norm.bias


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def explicit_attention(attention: CausalSelfAttention, x: torch.Tensor, rope_base: float | None) -> torch.Tensor:
    """Attention spelled out with matrix products: kv head h // group serves query head h (repeat_interleave)."""
    B, T, C = x.shape
    n_head, n_kv_head, head_size = attention.n_head, attention.n_kv_head, attention.head_size
    qkv = x @ attention.qkv.weight.T + attention.qkv.bias
    q, k, v = qkv.split((C, n_kv_head * head_size, n_kv_head * head_size), dim=-1)
    q = q.view(B, T, n_head, head_size).transpose(1, 2)
    k = k.view(B, T, n_kv_head, head_size).transpose(1, 2)
    v = v.view(B, T, n_kv_head, head_size).transpose(1, 2)
    if rope_base is not None:
        positions = torch.arange(T)
        q, k = complex_rotate(q, positions, rope_base), complex_rotate(k, positions, rope_base)
    group = n_head // n_kv_head
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_size)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
    return y @ attention.output.weight.T + attention.output.bias


def explicit_forward(model: GPT) -> callable:
    """GPT-2 (or its rotary variant) written out from the paper's equations, sharing only the weights."""
    config = model.config

    def forward(idx: torch.Tensor) -> torch.Tensor:
        x = model.token_embedding.weight[idx]
        if config.position_encoding == "learned":
            x = x + model.position_embedding.weight[: idx.size(1)]
        rope_base = config.rope_base if config.position_encoding == "rope" else None
        for block in model.blocks:
            x = x + explicit_attention(block.attention, layer_norm(x, block.ln_attention), rope_base)
            hidden = gelu_tanh(layer_norm(x, block.ln_ffn) @ block.ffn.up.weight.T + block.ffn.up.bias)
            x = x + hidden @ block.ffn.down.weight.T + block.ffn.down.bias
        return layer_norm(x, model.final_norm) @ model.token_embedding.weight.T

    return forward


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"block_size": -1}, "block_size"),
        ({"n_layer": 0}, "n_layer"),
        ({"n_layer": True}, "n_layer"),
        ({"n_head": 0}, "n_head"),
        ({"n_kv_head": 0}, "n_kv_head"),
        ({"n_embd": 0}, "n_embd"),
        ({"block_size": 16.0}, "block_size"),
        ({"n_embd": 30, "n_head": 4}, "n_embd"),
        ({"n_head": 4, "n_kv_head": 3}, "n_kv_head"),
        ({"n_embd": 12, "n_head": 4, "n_kv_head": 4, "position_encoding": "rope"}, "head size"),
        ({"position_encoding": "alibi"}, "position_encoding"),
        ({"rope_base": 0.0}, "rope_base"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"gelu_approximate": "sigmoid"}, "gelu_approximate"),
        ({"dropout": 1.0}, "dropout"),
        ({"position_encoding": "rope", "nope_layers": [9]}, "nope_layers"),
        ({"position_encoding": "rope", "nope_layers": [1, 0]}, "nope_layers"),
        ({"position_encoding": "rope", "nope_layers": [0, 0]}, "nope_layers"),
        ({"position_encoding": "rope", "nope_layers": [True]}, "nope_layers"),
        ({"position_encoding": "rope", "nope_layers": 1}, "nope_layers"),
        ({"nope_layers": [0]}, "nope_layers needs position_encoding 'rope'"),
    ],
)
def test_invalid_config_raises_value_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


def test_odd_head_size_is_fine_with_learned_positions():
    assert tiny_config("learned", n_embd=12, n_head=4, n_kv_head=4).head_size == 3


def test_n_kv_head_defaults_to_n_head():
    config = GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=4, n_embd=16)
    assert config.n_kv_head == 4
    assert (config.position_encoding, config.rope_base, config.bias, config.norm_eps, config.dropout) == (
        "learned",
        10000.0,
        True,
        1e-5,
        0.0,
    )


def test_config_round_trips_through_a_dict_and_names_unknown_fields():
    config = tiny_config("rope", "gqa")
    assert GPTConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="n_embed"):
        GPTConfig.from_dict({**config.to_dict(), "n_embed": 32})


def expected_state_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The persistent tensors, named and shaped as FORMAT.md documents them."""
    C, V, hs = config.n_embd, config.vocab_size, config.head_size
    shapes = {"token_embedding.weight": (V, C), "final_norm.weight": (C,), "final_norm.bias": (C,)}
    if config.position_encoding == "learned":
        shapes["position_embedding.weight"] = (config.block_size, C)
    for i in range(config.n_layer):
        p = f"blocks.{i}."
        shapes |= {
            p + "ln_attention.weight": (C,),
            p + "ln_attention.bias": (C,),
            p + "attention.qkv.weight": (C + 2 * config.n_kv_head * hs, C),
            p + "attention.qkv.bias": (C + 2 * config.n_kv_head * hs,),
            p + "attention.output.weight": (C, C),
            p + "attention.output.bias": (C,),
            p + "ln_ffn.weight": (C,),
            p + "ln_ffn.bias": (C,),
            p + "ffn.up.weight": (4 * C, C),
            p + "ffn.up.bias": (4 * C,),
            p + "ffn.down.weight": (C, 4 * C),
            p + "ffn.down.bias": (C,),
        }
    return shapes


def test_module_names_and_shapes_follow_the_config(tiny_model):
    state = {name: tuple(t.shape) for name, t in tiny_model.state_dict().items()}
    tied = state.pop("lm_head.weight")
    assert tied == (tiny_model.config.vocab_size, tiny_model.config.n_embd)
    assert state == expected_state_shapes(tiny_model.config)


def test_lm_head_is_tied_to_the_token_embedding_and_has_no_bias(tiny_model):
    assert tiny_model.lm_head.weight is tiny_model.token_embedding.weight
    assert tiny_model.lm_head.bias is None
    assert tiny_model.num_parameters() == sum(math.prod(s) for s in expected_state_shapes(tiny_model.config).values())


def test_attention_kind_follows_the_position_encoding(tiny_model):
    rope = tiny_model.config.position_encoding == "rope"
    assert all(
        type(block.attention) is (RotaryAttention if rope else CausalSelfAttention) for block in tiny_model.blocks
    )
    assert hasattr(tiny_model, "position_embedding") is not rope


def test_full_forward_equals_the_architecture_written_out(tiny_model):
    idx = torch.randint(
        tiny_model.config.vocab_size, (2, tiny_model.config.block_size), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        torch.testing.assert_close(tiny_model(idx), explicit_forward(tiny_model)(idx), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("n_kv_head", [2, 1])
def test_gqa_query_head_h_reads_kv_head_h_floor_group(n_kv_head):
    torch.manual_seed(3)
    attention = CausalSelfAttention(tiny_config("learned", n_head=4, n_kv_head=n_kv_head)).eval()
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        got = attention(x)
        torch.testing.assert_close(got, explicit_attention(attention, x, rope_base=None), atol=1e-5, rtol=1e-5)
        if n_kv_head > 1:
            # The other convention (kv heads tiled: query head h reads h % n_kv_head) gives a different answer,
            # so the comparison above really pins the grouping down.
            tiled = _tiled_grouping_attention(attention, x)
            assert not torch.allclose(got, tiled, atol=1e-3)


def _tiled_grouping_attention(attention: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    q, k, v = attention.project(attention.heads(x), 0)
    group = attention.n_head // attention.n_kv_head
    k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attention.output(y.transpose(1, 2).reshape(x.shape))


@pytest.mark.parametrize(
    ("gelu_approximate", "gelu"),
    [("tanh", gelu_tanh), ("none", lambda x: 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0))))],
)
def test_feed_forward_is_four_times_wide_with_the_configured_gelu(gelu_approximate, gelu):
    """GPT-2's tanh approximation by default; the exact erf GELU for nanoGPT-trained weights."""
    model = make_model("learned", gelu_approximate=gelu_approximate)
    ffn = model.blocks[0].ffn
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(4)) * 3
    with torch.no_grad():
        expected = gelu(x @ ffn.up.weight.T + ffn.up.bias) @ ffn.down.weight.T + ffn.down.bias
        torch.testing.assert_close(ffn(x), expected, atol=1e-6, rtol=1e-5)
    assert ffn.up.out_features == 4 * model.config.n_embd


def test_default_gelu_is_gpt2s_tanh_approximation():
    assert tiny_config().gelu_approximate == "tanh"


def test_forward_with_targets_returns_the_mean_cross_entropy():
    model = make_model("rope", "gqa")
    idx = torch.randint(model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    targets = torch.roll(idx, -1, dims=1)
    with torch.no_grad():
        logits, loss = model(idx, targets)
        log_probs = logits.log_softmax(-1).gather(-1, targets[..., None])
    torch.testing.assert_close(loss, -log_probs.mean())


def test_forward_refuses_more_tokens_than_block_size():
    model = make_model("learned")
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, model.config.block_size + 1, dtype=torch.long))


@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
def test_gqa_shrinks_only_the_key_value_part_of_qkv(layout):
    attention = make_model("rope", layout).blocks[0].attention
    n_kv_head = HEAD_LAYOUTS[layout]
    assert attention.qkv.out_features == 32 + 2 * n_kv_head * 8
    _, k, v = attention.project(attention.heads(torch.zeros(1, 3, 32)), 0)
    assert k.shape == v.shape == (1, n_kv_head, 3, 8)
