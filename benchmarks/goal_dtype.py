"""Half precision (`--dtype bfloat16`, `float16`) against float32: the shipped model and the GPT-2-124M shape,
prefill and decode, on 1 and 2 threads."""

from __future__ import annotations

import copy

import torch

from harness import GPT2_NEW_TOKENS, GPT2_PROMPT_TOKENS, gpt2_pair, interleaved, run_goals, speeds
from manas_cli.engine.bench import bench_prompt
from manas_cli.formats.checkpoint import load_checkpoint
from manas_cli.models import resolve_checkpoint
from manas_cli.torch_engine.model import use_decode_layout


def goal_dtypes(runs: int) -> dict:
    """Half-precision weights (and activations) against float32, as `--dtype` runs them."""
    _, gpt2 = gpt2_pair()
    shipped = load_checkpoint(resolve_checkpoint(None)).model
    cases = {  # name: (float32 model, prompt tokens, new tokens): the shipped model stays within its window
        "gpt2": (gpt2, GPT2_PROMPT_TOKENS, GPT2_NEW_TOKENS),
        "shipped": (shipped, 64, shipped.config.block_size - 64),
    }
    variants = {}
    for case, (model, prompt_tokens, new_tokens) in cases.items():
        prompt = bench_prompt(model, prompt_tokens, 1)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            typed = use_decode_layout(copy.deepcopy(model).to(dtype))
            for threads in (1, 2):
                variants[f"{case}_{str(dtype).removeprefix('torch.')}_{threads}_threads"] = (
                    threads,
                    lambda typed=typed, prompt=prompt, new_tokens=new_tokens: speeds(typed, prompt, new_tokens),
                )
    rates = interleaved(variants, runs)
    return {
        "tokens_per_s": rates,
        "over_float32": {
            f"{case}_{half}_{t}_threads_{figure}": rates[f"{case}_{half}_{t}_threads"][figure]
            / rates[f"{case}_float32_{t}_threads"][figure]
            for case in cases
            for half in ("bfloat16", "float16")
            for t in (1, 2)
            for figure in ("prefill", "decode")
        },
    }


GOALS = {
    "dtype": lambda args: goal_dtypes(args.runs),
}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
