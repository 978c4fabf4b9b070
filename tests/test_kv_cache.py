"""The cache session: per-step logits equal the full forward, every refusal, honest storage accounting."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from conftest import BLOCK_SIZE, all_logits, make_model, step_logits, tiny_config
from manas_cli.torch_engine.kv_cache import CacheSession
from manas_cli.torch_engine.model import CausalSelfAttention, RotaryAttention

FLOAT32_TOLERANCE = dict(atol=1e-5, rtol=1e-4)


def random_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(300, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("batch", [1, 3])
def test_prefill_and_decode_logits_equal_the_full_forward_last_position(tiny_model, batch, engine, run_on):
    """Through the first fill, and through re-prefills of the cropped window past block_size: within float32
    rounding on torch, bit for bit on the native core."""
    model = run_on(tiny_model)
    session = model.new_session()
    sequence = random_ids(batch, 5)
    next_ids = random_ids(batch, 3 * BLOCK_SIZE, seed=1)  # teacher-forced continuation
    with torch.no_grad():
        logits = step_logits(session.prefill(sequence))
        for column in range(next_ids.size(1)):
            expected = all_logits(model, sequence[:, -BLOCK_SIZE:])[:, -1:]
            assert logits.shape == (batch, 1, tiny_model.config.vocab_size)
            if engine == "native":
                assert torch.equal(logits, expected)
            torch.testing.assert_close(logits, expected, **FLOAT32_TOLERANCE)
            sequence = torch.cat((sequence, next_ids[:, column : column + 1]), dim=1)
            if session.positions == BLOCK_SIZE:
                logits = step_logits(session.prefill(sequence[:, -BLOCK_SIZE:]))
            else:
                logits = step_logits(session.decode(sequence[:, -1:]))
            assert session.positions == min(sequence.size(1), BLOCK_SIZE)


def training_mode():
    return make_model("learned").train()


def learned_without_position_table():
    model = make_model("learned")
    del model.position_embedding
    return model


def learned_with_rotary_attention():
    model = make_model("learned")
    model.blocks[1].attention = RotaryAttention(tiny_config("rope"))
    return model


def rope_with_plain_attention():
    model = make_model("rope", "gqa")
    model.blocks[0].attention = CausalSelfAttention(tiny_config("rope", "gqa"))
    return model


def qkv_width_mismatch():
    model = make_model("rope", "gqa")
    model.blocks[0].attention.qkv = nn.Linear(32, 3 * 32)  # MHA's width in a GQA model
    return model


def head_count_mismatch():
    model = make_model("learned", "gqa")
    model.blocks[1].attention.n_kv_head = 4
    return model


@pytest.mark.parametrize(
    ("broken_model", "message"),
    [
        (training_mode, "training mode"),
        (learned_without_position_table, "position_embedding"),
        (learned_with_rotary_attention, r"blocks\[1\]\.attention is RotaryAttention.*'learned'"),
        (rope_with_plain_attention, r"blocks\[0\]\.attention is CausalSelfAttention.*'rope'"),
        (qkv_width_mismatch, r"blocks\[0\]\.attention\.qkv maps 32 to 96 features, expected 32 to 64"),
        (head_count_mismatch, r"blocks\[1\]\.attention has n_head=4, n_kv_head=4.*n_kv_head=2"),
    ],
    ids=lambda case: getattr(case, "__name__", None),
)
def test_session_refuses_a_model_that_does_not_match_its_config(broken_model, message):
    with pytest.raises(ValueError, match=message):
        CacheSession(broken_model())


@pytest.fixture
def session(run_on):
    """A session of each engine: both refuse alike and account alike."""
    return run_on(make_model("rope", "gqa")).new_session()


def test_decode_before_any_prefill_is_refused(session):
    with pytest.raises(ValueError, match="decode before prefill"):
        session.decode(random_ids(1, 1))


@pytest.mark.parametrize("shape", [(3, 1), (1, 2), (1,), (1, 1, 1)])
def test_decode_of_the_wrong_shape_is_refused(session, shape):
    session.prefill(random_ids(1, 4))
    with pytest.raises(ValueError, match=r"decode takes \(1, 1\) token ids"):
        session.decode(torch.zeros(shape, dtype=torch.long))
    assert session.positions == 4


def test_decode_into_a_full_cache_is_refused(session):
    session.prefill(random_ids(2, BLOCK_SIZE))
    with pytest.raises(ValueError, match="cache is full.*prefill the cropped window"):
        session.decode(random_ids(2, 1))
    assert session.positions == BLOCK_SIZE


@pytest.mark.parametrize(
    ("token_ids", "message"),
    [
        (random_ids(1, BLOCK_SIZE + 1), f"exceeds block_size {BLOCK_SIZE}"),
        (torch.zeros(1, 0, dtype=torch.long), "non-empty"),
        (torch.zeros(3, dtype=torch.long), "non-empty"),
        (torch.zeros(1, 3), "LongTensor"),
    ],
    ids=["too-long", "empty", "one-dimensional", "float"],
)
def test_prefill_refuses_and_leaves_the_session_empty(session, token_ids, message):
    session.prefill(random_ids(1, 6))  # whatever was cached before must not survive a failed prefill
    with pytest.raises(ValueError, match=message):
        session.prefill(token_ids)
    assert_empty(session)


def test_prefill_failing_inside_the_model_leaves_the_session_empty(session):
    session.prefill(random_ids(1, 6))
    with pytest.raises(IndexError):
        session.prefill(torch.tensor([[1, 2, 300]]))  # token id past vocab_size: the embedding lookup fails
    assert_empty(session)


def test_prefill_failing_after_some_layers_appended_leaves_the_session_empty():
    """A failure in the last block, when the first block has already cached its keys, must not half-fill it."""
    session = CacheSession(make_model("rope", "gqa"))

    def fail(module, inputs):
        raise RuntimeError("simulated failure in the last block")

    handle = session.model.blocks[-1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="simulated"):
        session.prefill(random_ids(1, 6))
    handle.remove()
    assert_empty(session)
    session.prefill(random_ids(1, 6))  # and the session is still usable
    assert session.positions == 6


def assert_empty(session: CacheSession) -> None:
    assert session.positions == 0
    assert session.storage() == {
        "positions": 0,
        "logical_bytes": 0,
        "storage_bytes": 0,
        "dtype": None,
        "allocation": session.allocation,
    }
    with pytest.raises(ValueError, match="decode before prefill"):
        session.decode(random_ids(1, 1))


def test_storage_of_an_empty_session_is_zero_with_no_dtype(session):
    assert_empty(session)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
def test_storage_holds_the_logical_bytes_of_the_kv_heads_at_most_doubled(tiny_model, batch, dtype):
    model = tiny_model.to(dtype)
    config = model.config
    session = CacheSession(model)
    element_size = torch.tensor([], dtype=dtype).element_size()

    def expected_bytes(positions: int) -> int:
        # K and V, per layer, only the n_kv_head heads: grouped-query attention caches less
        return 2 * config.n_layer * batch * config.n_kv_head * positions * config.head_size * element_size

    session.prefill(random_ids(batch, 5))
    for positions in range(5, BLOCK_SIZE + 1):
        if positions > 5:
            session.decode(random_ids(batch, 1, seed=positions))
        report = session.storage()
        assert report["positions"] == positions
        assert report["logical_bytes"] == expected_bytes(positions)
        # grown by doubling: at most half unused, never the qkv projection kept alive, and exact at the full window
        assert report["logical_bytes"] <= report["storage_bytes"] <= 2 * report["logical_bytes"]
        assert positions < BLOCK_SIZE or report["storage_bytes"] == report["logical_bytes"]
        assert report["dtype"] == str(dtype).removeprefix("torch.")
        assert isinstance(report["allocation"], str) and report["allocation"]


def test_prefill_resets_what_was_cached(session):
    session.prefill(random_ids(2, 9))
    session.decode(random_ids(2, 1))
    session.prefill(random_ids(1, 3))
    assert session.positions == 3
    assert session.storage()["logical_bytes"] == 2 * 2 * 1 * 2 * 3 * 8 * 4
    session.decode(random_ids(1, 1))  # the new batch size is the one decode now expects
