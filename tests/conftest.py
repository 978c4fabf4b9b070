"""Shared fixtures: tiny real models over every position encoding and head layout, a tiny embedded BPE, the data."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest
import torch

from manas_cli.formats.tokenizer import bpe_spec
from manas_cli.native.engine import NativeEngine
from manas_cli.native.model import Logits, NativeGPT
from manas_cli.native.session import NativeSession
from manas_cli.torch_engine.engine import TorchEngine
from manas_cli.torch_engine.model import GPT, GPTConfig

# The test extra's packages by the module each is imported as (pyproject.toml's [test]): a missing one is named
# at the start, not found as a worker's crash (the CLI zygote preloads tokenizers: without it, a ConnectionResetError)
TEST_EXTRA = {
    "xdist": "pytest-xdist", "transformers": "transformers", "tokenizers": "transformers", "pyte": "pyte",
    "gguf": "gguf", "openai": "openai", "jinja2": "jinja2", "huggingface_hub": "huggingface_hub",
    "langchain_openai": "langchain-openai", "llm": "llm", "ray": "ray[data]", "sentencepiece": "sentencepiece",
    "google.protobuf": "protobuf", "llguidance": "llguidance", "jsonschema": "jsonschema",
}  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    missing = sorted({package for module, package in TEST_EXTRA.items() if not _importable(module)})
    if missing:
        raise pytest.UsageError(
            f'the tests need the test extra: pip install -e ".[test]" ({", ".join(missing)} not installed)'
        )
    config.addinivalue_line(
        "markers", "slow: runs for tens of seconds; scheduled first (pytest_collection_modifyitems)"
    )


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent is missing
        return False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests first, in their order: one started last would end the run alone on one worker while the other
    worker waits. (xdist hands out the tests in this order, after test_batch_ray's one group.)"""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def shared_folder(tmp_path_factory: pytest.TempPathFactory, worker_id: str, name: str, fill) -> Path:
    """A folder that every worker of this run shares, filled once: the first worker to take its lock calls
    fill(folder), the others wait for it and find it filled. For what costs a worker many seconds to make."""
    base = tmp_path_factory.getbasetemp()
    root = base if worker_id == "master" else base.parent  # under xdist, the workers' folders' common parent
    folder = root / f"shared-{name}"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".filled").exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a worker that failed while filling it left
            folder.mkdir()
            fill(folder)
            (folder / ".filled").touch()
    return folder


# One thread for the whole session: the suite is tiny, CI has 2 cores, and a background job may hold the rest.
torch.set_num_threads(1)

DATA = Path(__file__).resolve().parent / "data"  # public data carried with the tests (data/SOURCES.md)

VOCAB_SIZE = 300
BLOCK_SIZE = 16
N_HEAD = 4
HEAD_LAYOUTS = {"mha": N_HEAD, "gqa": 2, "mqa": 1}  # name -> n_kv_head
POSITION_ENCODINGS = ("learned", "rope")
MODEL_VARIANTS = [(pe, layout) for pe in POSITION_ENCODINGS for layout in HEAD_LAYOUTS]


def tiny_config(position_encoding: str = "learned", layout: str = "mha", **overrides) -> GPTConfig:
    values = dict(
        vocab_size=VOCAB_SIZE,
        block_size=BLOCK_SIZE,
        n_layer=2,
        n_head=N_HEAD,
        n_kv_head=HEAD_LAYOUTS[layout],
        n_embd=32,
        position_encoding=position_encoding,
    )
    values.update(overrides)
    return GPTConfig(**values)


def make_model(position_encoding: str = "learned", layout: str = "mha", seed: int = 0, **overrides) -> GPT:
    """A tiny GPT in eval mode with seeded weights, spread wider than GPT-2's init: with std 0.02 the softmax is
    nearly uniform, and greedy ties or top-p cut-offs would then test nothing."""
    torch.manual_seed(seed)
    model = GPT(tiny_config(position_encoding, layout, **overrides))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.15)
            elif name.endswith("bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.eval()


def complex_rotate(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """LLaMA's reference rotary embedding, written independently: pair (x[2i], x[2i+1]) is the complex number
    x[2i] + j·x[2i+1], multiplied by e^(j·pos·base^(-2i/head_size))."""
    head_size = x.size(-1)
    frequencies = base ** (-torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    angles = positions.double()[:, None] * frequencies
    rotation = torch.polar(torch.ones_like(angles), angles)
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], head_size // 2, 2).contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


@pytest.fixture(params=MODEL_VARIANTS, ids=[f"{pe}-{layout}" for pe, layout in MODEL_VARIANTS])
def tiny_model(request) -> GPT:
    """Each position encoding × head layout (multi-head, grouped-query, multi-query)."""
    return make_model(*request.param)


@pytest.fixture(scope="session")
def tiny_bpe_spec() -> dict:
    """An embedded BPE tokenizer written by hand (independent of the trainer): the 256 bytes, a few English
    merges, and merges that cut multi-byte characters mid-way (' ' + the first byte of '€', its last two bytes)."""
    ranks = {bytes([i]): i for i in range(256)}
    merges = [b"th", b"he", b"the", b" t", b" the", b"in", b"er", b"\xc3\xa9", b" \xe2", b"\x82\xac", b"\xf0\x9f"]
    for token in merges:
        ranks[token] = len(ranks)
    return bpe_spec(ranks)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory, tiny_bpe_spec) -> tuple[Path, Path]:
    """(a SmolLM2-shaped random model as transformers saves it, with SmolLM2's real tokenizer; its conversion):
    the chat, tool and thinking tests' model, read only."""
    from test_llama_family import converted
    from test_real_tokenizers import smollm2_folder

    folder = tmp_path_factory.mktemp("smollm2-chat")
    smollm2_folder(folder / "hf", tiny_bpe_spec)
    return folder / "hf", converted(folder, folder / "hf")


@pytest.fixture(scope="session")
def test_data() -> Path:
    return DATA


@pytest.fixture(scope="session")
def shakespeare() -> str:
    """Tiny Shakespeare's first 60,000 characters."""
    return (DATA / "tinyshakespeare-head.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def shakespeare_held_out() -> str:
    """The first 30,000 characters of Tiny Shakespeare's held-out last 10%."""
    return (DATA / "tinyshakespeare-held-out.txt").read_text(encoding="utf-8")


HAS_COMPILER = shutil.which(os.environ.get("CC") or "cc") is not None
DEFAULT_ENGINE = "native" if HAS_COMPILER else "torch"  # what `--engine auto` runs on this machine's CPU
NO_COMPILER = "no C compiler: the native engine cannot be built here"
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason=NO_COMPILER)


@pytest.fixture(scope="session")
def native_library():
    """The native core, built (or found in the cache) as the CLI builds it. Only a machine with no C compiler at
    all skips the native tests; a compiler that fails on core.c fails them."""
    from manas_cli.native.build import build

    if not HAS_COMPILER:
        pytest.skip(NO_COMPILER)
    return build().library


ENGINES = ("torch", "native")


@pytest.fixture(params=ENGINES)
def engine(request) -> str:
    if request.param == "native" and not HAS_COMPILER:
        pytest.skip(NO_COMPILER)
    return request.param


@pytest.fixture
def run_on(engine, request):
    """The model as `engine` runs it (an engines.Engine): torch, or the C core over the model's own tensors. Tests
    that take it hold on both engines."""
    if engine == "torch":
        return engine_of
    library = request.getfixturevalue("native_library")
    return lambda model, threads=1: NativeEngine(native_model(model, library, threads))


def engine_of(model):
    """The engine running `model`: an Engine as it is, a torch GPT on the torch engine (the tests' own switch; the
    library's callers open engines with manas_cli.models)."""
    return model if hasattr(model, "new_session") else TorchEngine(model)


def sample(sampler, logits: torch.Tensor) -> torch.Tensor:
    """The torch engine's draw from logits (B, vocab): next token ids (B, 1)."""
    from manas_cli.torch_engine.sampling import adjust, draw

    return draw(sampler, adjust(sampler, logits))


def native_model(source, library, threads: int = 1, float_activations: bool = False) -> NativeGPT:
    """The core over a torch GPT's tensors, or over a mapped checkpoint's bytes (formats.header.open_checkpoint).
    float_activations: int8 products in float32, the torch-comparable path (else in integers, the default)."""
    from manas_cli.formats.mapped_weights import MappedWeights
    from manas_cli.torch_engine.native_weights import TorchWeights

    weights = TorchWeights(source) if isinstance(source, GPT) else MappedWeights(source, library)
    return NativeGPT(weights, library, threads, float_activations)


def all_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """What GPT.forward gives without targets, the logits of every position, (B, T, vocab), from either engine (or
    a torch GPT or NativeGPT as such), each row from position 0."""
    model = getattr(model, "model", model)  # an engine's model
    if isinstance(model, GPT):
        with torch.inference_mode():
            return model(ids)
    rows = ids.tolist()
    return logits_view(NativeEngine(model).logits_from(rows, 0)).view(len(rows), len(rows[0]), -1)


def logits_view(logits: Logits) -> torch.Tensor:
    """The core's logits as a (rows, vocab) tensor over its own memory (writable)."""
    whole = torch.frombuffer(logits.buffer, dtype=torch.float32).view(-1, logits.vocab)
    return whole[logits.first : logits.first + logits.rows]


def step_logits(logits) -> torch.Tensor:
    """A session's prefill or decode logits as a (B, 1, vocab) tensor, from either engine."""
    return logits_view(logits)[:, None] if isinstance(logits, Logits) else logits


def cache_layers(session) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the cached K and V as (B, n_kv_head, positions, head_size) tensors, from either engine's session."""
    if not isinstance(session, NativeSession):
        return [(layer.k, layer.v) for layer in session.layers]
    if session.k is None:
        return []
    config = session.model.config
    shape = (session.batch_size, config.n_layer, session.size, config.n_kv_head, config.head_size)
    k, v = (torch.frombuffer(buffer, dtype=torch.float32).view(shape) for buffer in (session.k, session.v))
    return [
        (k[:, i, : session.positions].transpose(1, 2), v[:, i, : session.positions].transpose(1, 2))
        for i in range(config.n_layer)
    ]
