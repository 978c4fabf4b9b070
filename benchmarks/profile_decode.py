"""Where a decode step's time goes: torch.profiler over cached decode steps of a GPT-2-124M-shaped model
(random weights) or of the shipped model, in float32, half precision, int8 or int4 weights.

    python benchmarks/profile_decode.py [--threads 2] [--steps 32] [--context 64] [--cache static]
    python benchmarks/profile_decode.py --shipped --weights int8
"""

from __future__ import annotations

import argparse

import torch

from manas_cli.formats.checkpoint import load_checkpoint
from manas_cli.models import resolve_checkpoint
from manas_cli.torch_engine.kv_cache import CacheSession
from manas_cli.torch_engine.model import GPT, GPTConfig, use_decode_layout

GPT2_124M = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--context", type=int, default=64, help="prompt positions cached before the profiled steps")
    parser.add_argument("--cache", choices=("dynamic", "static"), default="static")
    parser.add_argument("--plain-layout", action="store_true", help="keep nn.Linear's (out, in) weight layout")
    parser.add_argument("--shipped", action="store_true", help="the shipped model instead of the GPT-2 shape")
    parser.add_argument("--weights", choices=("float32", "bfloat16", "float16", "int8", "int4"), default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_checkpoint(resolve_checkpoint(None)).model if args.shipped else GPT(GPT2_124M).eval()
    if args.weights in ("int8", "int4"):
        from manas_cli.torch_engine.quantize import quantize_model

        quantize_model(model, args.weights)  # quantized layers keep their own layout, as in the CLI
    else:
        model.to(getattr(torch, args.weights))
        if not args.plain_layout:
            use_decode_layout(model)
    session = CacheSession(model, args.cache)
    token = torch.zeros(1, 1, dtype=torch.long)
    session.prefill(torch.zeros(1, args.context, dtype=torch.long))
    for _ in range(4):  # warm-up
        session.decode(token)
    with torch.profiler.profile() as profile:
        for _ in range(args.steps):
            session.decode(token)
    table = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    print(table)
    total_ms = sum(e.self_cpu_time_total for e in profile.key_averages()) / 1000 / args.steps
    print(
        f"{total_ms:.1f} ms of torch ops per decode step ({args.weights}, {args.threads} threads, {args.cache} cache)"
    )


if __name__ == "__main__":
    main()
