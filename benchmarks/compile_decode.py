"""Does torch.compile pay for decoding? Compile time against decode tokens/s, eager vs compiled, same tokens.

    python benchmarks/compile_decode.py [--threads 2] [--tokens 200]

Compiles the model's forward over cached positions (GPT.hidden_states, dynamic shapes: the cache grows) with
the CPU inductor backend, on the shipped model.
"""

from __future__ import annotations

import argparse
import time

import torch

from manas_cli.engine.bench import run_once
from manas_cli.engine.generation import generate
from manas_cli.engine.sampling import Sampler
from manas_cli.formats.checkpoint import load_checkpoint
from manas_cli.models import resolve_checkpoint
from manas_cli.torch_engine.engine import TorchEngine
from manas_cli.torch_engine.kv_cache import CacheSession
from manas_cli.torch_engine.model import use_decode_layout


def decode(model, tokens: int, allocation: str):
    prompt = torch.zeros(1, 8, dtype=torch.long)
    steps = list(
        generate(TorchEngine(model), prompt, Sampler(temperature=0.0), tokens, session=CacheSession(model, allocation))
    )
    stats = run_once(iter(steps), 8, 1)
    return [s.tokens for s in steps], stats.decode_tokens_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    def shipped_model():
        return use_decode_layout(load_checkpoint(resolve_checkpoint(None)).model)

    model = shipped_model()
    for allocation in ("dynamic", "static"):
        decode(model, 16, allocation)  # warm-up
        eager_tokens, eager_rate = decode(model, args.tokens, allocation)
        compiled = shipped_model()
        compiled.hidden_states = torch.compile(compiled.hidden_states, dynamic=True)
        started = time.perf_counter()
        decode(compiled, 16, allocation)  # compiles prefill and decode graphs
        compile_s = time.perf_counter() - started
        compiled_tokens, compiled_rate = decode(compiled, args.tokens, allocation)
        print(
            f"{allocation}: eager {eager_rate:.0f} tok/s, compiled {compiled_rate:.0f} tok/s "
            f"({compiled_rate / eager_rate:.2f}x) after {compile_s:.1f} s of compilation; "
            f"same tokens: {compiled_tokens == eager_tokens}"
        )


if __name__ == "__main__":
    main()
