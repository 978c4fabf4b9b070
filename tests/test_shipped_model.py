"""The model that ships in checkpoints/: it loads, matches its model card, and meets the quality bar."""

import re
from pathlib import Path

import pytest
import torch

from manas_cli.checkpoint import load_checkpoint
from manas_cli.training import evaluate, split_text

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "checkpoints" / "shakespeare.safetensors"
MODEL_CARD = ROOT / "checkpoints" / "README.md"
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
QUALITY_BAR_NATS_PER_CHAR = 1.75


def model_card_facts() -> dict[str, str]:
    """The `| key | value |` rows of the model card's tables."""
    rows = re.findall(r"^\|\s*`?([\w ]+?)`?\s*\|\s*([^|]+?)\s*\|$", MODEL_CARD.read_text(encoding="utf-8"), re.M)
    return {key: value for key, value in rows}


@pytest.fixture(scope="module")
def shipped():
    return load_checkpoint(CHECKPOINT)


def test_shipped_model_matches_its_model_card(shipped):
    facts = model_card_facts()
    config = shipped.model.config
    for field in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "position_encoding"):
        assert facts[field] == str(getattr(config, field)), field
    assert int(facts["parameters"].replace(",", "")) == shipped.model.num_parameters()


def test_shipped_model_is_rope_with_grouped_query_attention_and_small(shipped):
    config = shipped.model.config
    assert config.position_encoding == "rope"
    assert config.n_kv_head < config.n_head
    assert 1024 <= config.vocab_size <= 8192
    assert config.block_size >= 256
    assert CHECKPOINT.stat().st_size <= 40 * 10**6


def test_shipped_model_loss_per_character_on_held_out_text_meets_the_bar(shipped):
    torch.set_num_threads(1)
    _, held_out = split_text(SHAKESPEARE.read_text(encoding="utf-8"), 0.1)
    text = held_out[:30_000]  # a bounded slice keeps the test fast
    ids = torch.tensor(shipped.encoding.encode_ordinary(text))
    loss_per_token = evaluate(shipped.model, ids)
    loss_per_char = loss_per_token * len(ids) / len(text)
    assert loss_per_char <= QUALITY_BAR_NATS_PER_CHAR
