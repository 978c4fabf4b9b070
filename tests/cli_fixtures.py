"""What the CLI tests run against: tiny real checkpoints written to disk, the real `manas` run as a subprocess, and
the uncached reference generation run in-process on the same checkpoint.

Test modules import the fixtures by name; the checkpoints are built once per session however many modules do.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

import pytest
import torch

from manas_cli.engine.generation import generate_reference, prompt_batch
from manas_cli.engine.sampling import Sampler
from manas_cli.formats.bpe import train_bpe
from manas_cli.formats.checkpoint import load_checkpoint, save_checkpoint
from manas_cli.formats.header import Checkpoint
from manas_cli.formats.tokenizer import bpe_spec, build_encoding, end_of_text_id
from manas_cli.models import choose_engine
from manas_cli.torch_engine.model import GPT, GPTConfig
from manas_cli.torch_engine.quantize import quantize_model

DATA = Path(__file__).resolve().parent / "data"  # public data carried with the tests (data/SOURCES.md)
BLOCK_SIZE = 32
BPE_VOCAB_SIZE = 320  # 256 bytes, 63 merges learned from Shakespeare, <|endoftext|>
TRAINING_CHARS = 20_000
TRAINING_STEPS = 100

# Every model-running command gets these: one thread (the suite shares 2 cores with a background job) and the CPU,
# so the in-process float32 reference computes exactly what the subprocess does.
RUN_OPTIONS = ("--device", "cpu", "--threads", "1")
# A prompt whose characters are 2, 3 and 4 bytes long in UTF-8: the byte-level BPE splits them across tokens.
MULTIBYTE_PROMPT = "ROMEO: café, 日本 🎉"
# Longer than the window: generate crops it, with a notice on stderr.
LONG_PROMPT = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\n" * 2


@dataclass
class TinyCheckpoint:
    name: str
    path: Path
    quantize: bool | str = False  # True or "int8": as `--quantize int8` runs it; "int4" as `--quantize int4`

    @cached_property
    def loaded(self) -> Checkpoint:
        checkpoint = load_checkpoint(self.path)
        if self.quantize:
            quantize_model(checkpoint.model, "int8" if self.quantize is True else self.quantize)
        return checkpoint

    @cached_property
    def runner(self):
        """The engine the CLI's default `--engine auto` runs here: the native core where it builds."""
        return choose_engine("auto", self.loaded.model, 1).engine

    @property
    def encoding(self):
        return self.loaded.encoding

    @property
    def eot_id(self) -> int:
        return end_of_text_id(self.encoding)

    def prompt_ids(self, text: str) -> list[int]:
        """The prompt as the contract defines it: its last block_size tokens, or end-of-text when it is empty."""
        return self.encoding.encode_ordinary(text)[-BLOCK_SIZE:] or [self.eot_id]

    def reference(
        self,
        prompt: str,
        max_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        num_samples: int = 1,
    ) -> list[list[int]]:
        """Each sample's new tokens from crop-and-recompute generation (end-of-text ends a sample and is not one of
        its tokens), sampled with the generator the CLI seeds for --seed."""
        engine = self.runner
        generator = engine.generator(seed) if seed is not None else None
        sampler = Sampler(temperature, top_k, top_p, generator, seed=seed or 0)
        prompt_ids = prompt_batch(self.prompt_ids(prompt), num_samples)
        samples: list[list[int]] = [[] for _ in range(num_samples)]
        ended = [False] * num_samples
        for step in generate_reference(engine, prompt_ids, sampler, max_tokens, self.eot_id):
            for row, token in enumerate(step.tokens):
                ended[row] = ended[row] or token == self.eot_id
                if not ended[row]:
                    samples[row].append(token)
        return samples


def train_tiny(model: GPT, ids: torch.Tensor, steps: int) -> GPT:
    """A few AdamW steps: enough that samples are made of the text's letters and merges, not arbitrary bytes (an
    escape byte in the generated text would blur the check that no escape codes reach a pipe)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    offsets = torch.arange(BLOCK_SIZE + 1)
    model.train()
    for _ in range(steps):
        windows = ids[torch.randint(len(ids) - BLOCK_SIZE - 1, (16,), generator=generator)[:, None] + offsets]
        _, loss = model(windows[:, :-1], windows[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model.eval()


def widen_weights(model: GPT, seed: int) -> GPT:
    """Random weights wider than GPT-2's init, so the next-token distribution is far from uniform and the model
    emits every kind of byte: lone continuation bytes, characters split across tokens, control bytes."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.15)
    return model.eval()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, TinyCheckpoint]:
    """'rope-gqa': rotary, grouped-query (4 query heads, 2 kv heads), briefly trained on Shakespeare.
    'learned-mha': GPT-2's learned positions and multi-head attention, random weights."""
    return build_checkpoints(tmp_path_factory.getbasetemp() / "cli-checkpoints")


@cache  # each module that imports the fixture has its own copy of it: build once per session all the same
def build_checkpoints(folder: Path) -> dict[str, TinyCheckpoint]:
    text = (DATA / "tinyshakespeare-head.txt").read_text(encoding="utf-8")[:TRAINING_CHARS]
    spec = bpe_spec(train_bpe(text, BPE_VOCAB_SIZE))
    encoding = build_encoding(spec)
    folder.mkdir()

    def config(position_encoding: str, n_kv_head: int) -> GPTConfig:
        return GPTConfig(
            vocab_size=encoding.n_vocab,
            block_size=BLOCK_SIZE,
            n_layer=2,
            n_head=4,
            n_kv_head=n_kv_head,
            n_embd=32,
            position_encoding=position_encoding,
        )

    torch.manual_seed(0)
    ids = torch.tensor(encoding.encode_ordinary(text))
    models = {
        "rope-gqa": train_tiny(GPT(config("rope", 2)), ids, TRAINING_STEPS),
        "learned-mha": widen_weights(GPT(config("learned", 4)), seed=1),
    }
    result = {}
    for name, model in models.items():
        path = folder / f"{name}.safetensors"
        save_checkpoint(path, model, spec)
        result[name] = TinyCheckpoint(name, path)
    return result


@pytest.fixture(scope="session")
def rope(checkpoints) -> TinyCheckpoint:
    return checkpoints["rope-gqa"]


@pytest.fixture(scope="session")
def learned(checkpoints) -> TinyCheckpoint:
    return checkpoints["learned-mha"]


# ---- the CLI as a subprocess ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    args: tuple[str, ...]
    returncode: int
    stdout: bytes
    stderr: bytes

    @property
    def out(self) -> str:
        return self.stdout.decode("utf-8")

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8")

    def json_lines(self) -> list[dict]:
        return [json.loads(line) for line in self.out.splitlines()]

    def json(self) -> dict:
        (record,) = self.json_lines()
        return record

    def ok(self) -> Run:
        assert self.returncode == 0, f"manas {' '.join(self.args)} exited {self.returncode}:\n{self.err}"
        return self


def cli_env(**overrides: str | None) -> dict[str, str]:
    """The caller's environment without anything that picks a model or forces colour, with a terminal type that
    colours happily: only the pipe itself may keep escape codes out."""
    env = dict(os.environ)
    for name in ("MANAS_CHECKPOINT", "NO_COLOR", "FORCE_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE", "COLUMNS"):
        env.pop(name, None)
    env.update(TERM="xterm-256color", OMP_NUM_THREADS="1")
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


MANAS = (sys.executable, "-m", "manas_cli")
_runs: dict[tuple, Run] = {}


def manas(*args: str | Path, stdin: bytes = b"", fresh: bool = False, **env: str | None) -> Run:
    """Run the CLI with stdout and stderr as pipes. A run is deterministic in what the tests compare, so identical
    runs are shared between tests; fresh=True runs again (to compare two runs of one command)."""
    args = tuple(str(arg) for arg in args)
    key = (args, stdin, tuple(sorted(env.items())))
    if fresh or key not in _runs:
        returncode, stdout, stderr = run_cli(args, stdin, cli_env(**env))
        _runs[key] = Run(args, returncode, stdout, stderr)
    return _runs[key]


# ---- the CLI's processes forked from a zygote that has imported torch ------------------------------------------
# A run spends 1-2 s importing torch and the CLI before it reads its arguments, and the suite runs the CLI about a
# thousand times: cli_zygote.py imports them once and forks each run from there. A run whose environment differs
# from the zygote's in what is read at start-up gets a fresh interpreter, as does every run with MANAS_TEST_FRESH=1.
STARTUP = ("PYTHON", "LC_", "LANG", "OMP_", "GOMP_", "KMP_", "MKL_")  # read as the interpreter and torch start
ZYGOTE = Path(__file__).resolve().parent / "cli_zygote.py"
TIMEOUT = 300


def cli(
    *args: str | Path,
    stdin: bytes | str = b"",
    env: dict[str, str] | None = None,
    text: bool = False,
    umask: int | None = None,
    address_space: int | None = None,
) -> subprocess.CompletedProcess:
    """`manas ARGS` as subprocess.run(capture_output=True) runs it, forked from the zygote where it can be: env is
    the whole environment (cli_env() when None), umask and address_space (RLIMIT_AS) the child's."""
    args = tuple(str(arg) for arg in args)
    stdin = stdin.encode() if isinstance(stdin, str) else stdin
    returncode, stdout, stderr = run_cli(args, stdin, cli_env() if env is None else env, umask, address_space)
    if text:
        stdout, stderr = stdout.decode(), stderr.decode()
    return subprocess.CompletedProcess([*MANAS, *args], returncode, stdout, stderr)


def run_cli(
    args: tuple[str, ...],
    stdin: bytes,
    env: dict[str, str],
    umask: int | None = None,
    address_space: int | None = None,
    fork: bool = True,
) -> tuple[int, bytes, bytes]:
    """(returncode, stdout, stderr) of `manas ARGS`: forked from this worker's zygote where it can be (fork=False:
    never), else a fresh interpreter."""
    zygote = _zygote() if fork else None
    if zygote is None or _startup(env) != zygote.startup or not zygote.lock.acquire(blocking=False):
        limited = umask is not None or address_space is not None
        done = subprocess.run(
            [*MANAS, *args], input=stdin, capture_output=True, env=env, timeout=TIMEOUT,
            preexec_fn=(lambda: _limit(umask, address_space)) if limited else None,
        )  # fmt: skip
        return done.returncode, done.stdout, done.stderr
    try:
        return zygote.run(args, stdin, env, umask, address_space)
    finally:
        zygote.lock.release()


def _limit(umask: int | None, address_space: int | None) -> None:
    if umask is not None:
        os.umask(umask)
    if address_space is not None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))


def _startup(env: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if name.startswith(STARTUP)}


class Zygote:
    """cli_zygote.py, started with cli_env() and spoken to over a socket pair; one run at a time (the lock)."""

    def __init__(self) -> None:
        self.channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = cli_env()
        self.startup = _startup(env)
        self.process = subprocess.Popen(
            [sys.executable, str(ZYGOTE), str(theirs.fileno())], pass_fds=[theirs.fileno()], env=env,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        theirs.close()
        self.lock = threading.Lock()

    def run(
        self, args: tuple[str, ...], stdin: bytes, env: dict[str, str], umask: int | None, address_space: int | None
    ) -> tuple[int, bytes, bytes]:
        """One run forked from the zygote, its pipes fed and drained here as subprocess.run does."""
        (stdin_read, stdin_write), (out_read, out_write), (err_read, err_write) = os.pipe(), os.pipe(), os.pipe()
        request = {"args": list(args), "env": env, "cwd": os.getcwd(), "umask": umask, "address_space": address_space}
        request = json.dumps(request).encode()
        socket.send_fds(self.channel, [request], [stdin_read, out_write, err_write])
        for descriptor in (stdin_read, out_write, err_write):
            os.close(descriptor)
        pid = json.loads(self.channel.recv(1 << 16))["pid"]
        try:
            stdout, stderr = _exchange(stdin_write, out_read, err_read, stdin, time.monotonic() + TIMEOUT)
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            raise
        finally:
            status = json.loads(self.channel.recv(1 << 16))["status"]
        return status, stdout, stderr

    def close(self) -> None:
        self.channel.send(b"")
        self.process.wait(timeout=30)
        self.channel.close()


def _exchange(stdin: int, out: int, err: int, data: bytes, deadline: float) -> tuple[bytes, bytes]:
    """Write data to stdin, then close it, while reading out and err to their ends; or TimeoutExpired. Closes all
    three."""
    chunks: dict[int, list[bytes]] = {out: [], err: []}
    written = 0
    with selectors.DefaultSelector() as selector:
        os.set_blocking(stdin, False)
        for descriptor, events in (
            (stdin, selectors.EVENT_WRITE),
            (out, selectors.EVENT_READ),
            (err, selectors.EVENT_READ),
        ):
            selector.register(descriptor, events)
        try:
            while selector.get_map():
                ready = selector.select(max(deadline - time.monotonic(), 0))
                if not ready:
                    raise subprocess.TimeoutExpired(MANAS, TIMEOUT)
                for key, _ in ready:
                    if key.fd != stdin:
                        chunk = os.read(key.fd, 65536)
                        chunks[key.fd].append(chunk)
                        if not chunk:
                            selector.unregister(key.fd)
                            os.close(key.fd)
                        continue
                    try:
                        written += os.write(stdin, data[written : written + 65536])
                    except BrokenPipeError:  # the run stopped reading: as subprocess.run, not an error
                        written = len(data)
                    if written >= len(data):
                        selector.unregister(stdin)
                        os.close(stdin)
        finally:
            for descriptor in list(selector.get_map()):
                os.close(descriptor)
    return b"".join(chunks[out]), b"".join(chunks[err])


_zygotes: list[Zygote | None] = []


def _zygote() -> Zygote | None:
    """This test process's zygote, started at its first run; None with MANAS_TEST_FRESH=1."""
    if not _zygotes:
        _zygotes.append(None if os.environ.get("MANAS_TEST_FRESH") == "1" else Zygote())
        if _zygotes[0] is not None:
            atexit.register(_zygotes[0].close)
    return _zygotes[0]


def generate(
    checkpoint: TinyCheckpoint, *args: str | Path, stdin: bytes = b"", fresh: bool = False, **env: str | None
) -> Run:
    return manas("generate", "-c", checkpoint.path, *RUN_OPTIONS, *args, stdin=stdin, fresh=fresh, **env)


def generate_with_compiler(checkpoint: TinyCheckpoint, folder: Path, before: str = "", after: str = "") -> Run:
    """`generate --json` (greedy, a few tokens) with $CC a wrapper adding flags before or after the build's own,
    the core built into an empty cache under folder (folder / "cache" / "manas")."""
    wrapper = folder / "cc"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which(os.environ.get("CC") or "cc")} {before} "$@" {after}\n')
    wrapper.chmod(0o755)
    cache = str(folder / "cache")
    return generate(checkpoint, "-p", "ROMEO:", "-n", "5", "-t", "0", "--json", CC=str(wrapper), XDG_CACHE_HOME=cache)
