"""Pipelines: `pipelines`, 100 prompts of 5-60 tokens, 64 new tokens each, shipped model: `--jsonl` against a shell
loop of `manas generate` processes and against `--batch-size 1`; `batch`, continuous batching's total decode
tokens/s at batch 1 to 16, GPT-2-124M shape and shipped model."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import torch

from harness import DATA, GREEDY, MANAS, gpt2_checkpoint, median_rate, run_goals
from manas_cli.engine.bench import bench_prompt
from manas_cli.formats.checkpoint import load_checkpoint
from manas_cli.models import resolve_checkpoint
from manas_cli.torch_engine.engine import TorchEngine
from manas_cli.torch_engine.model import GPT, use_decode_layout


def pipeline_prompts(count: int, seed: int = 0) -> list[str]:
    """count prompts of 5 to 60 tokens of the shipped model, cut from Tiny Shakespeare."""
    import random

    text = (DATA / "tinyshakespeare-head.txt").read_text()
    encoding = load_checkpoint(resolve_checkpoint(None)).encoding
    rng, prompts = random.Random(seed), []
    for _ in range(count):
        start, length = rng.randrange(len(text) - 1000), rng.randint(5, 60)
        prompts.append(encoding.decode(encoding.encode_ordinary(text[start : start + 1000])[:length]))
    return prompts


def goal_pipelines(count: int = 100, new_tokens: int = 64) -> dict:
    """Pipelines, goal 1: `count` prompts, `new_tokens` each, on the shipped model: one `--jsonl` process (its
    default batch size, and --batch-size 1) against a shell loop of one `manas generate` process per prompt."""
    prompts = pipeline_prompts(count)
    lines = "".join(json.dumps({"prompt": p, "max_tokens": new_tokens, "temperature": 0}) + "\n" for p in prompts)
    manas = [*MANAS, "generate"]

    def timed(*command: str, stdin: str = "") -> float:
        started = time.perf_counter()
        subprocess.run(command, input=stdin.encode(), capture_output=True, check=True)
        return time.perf_counter() - started

    batched = timed(*manas, "--jsonl", stdin=lines)
    one_row = timed(*manas, "--jsonl", "--batch-size", "1", stdin=lines)
    loop = sum(timed(*manas, "-p", prompt, "-n", str(new_tokens), "-t", "0") for prompt in prompts)
    return {
        "prompts": count,
        "new_tokens": new_tokens,
        "shell_loop_s": round(loop, 1),
        "jsonl_s": round(batched, 2),
        "jsonl_batch_1_s": round(one_row, 2),
        "vs_shell_loop": round(loop / batched, 1),
        "vs_batch_1": round(one_row / batched, 2),
        "goal": "≥ 20× the shell loop, ≥ 3× --batch-size 1",
    }


def batched_decode_rate(model: GPT, batch: int, new_tokens: int) -> float:
    """Total decode tokens/s of `batch` greedy requests of a 64-token prompt decoding together."""
    from manas_cli.engine.batching import Request, generate_batched

    prompt = bench_prompt(model, 64, 1)[0].tolist()
    requests = iter([Request(i, prompt, GREEDY, new_tokens) for i in range(batch)])
    decoded, seconds = 0, 0.0
    for tokens in generate_batched(TorchEngine(model), lambda wait: next(requests, None), batch):
        if tokens[0].kind == "decode":
            decoded, seconds = decoded + len(tokens), seconds + tokens[0].seconds
    return decoded / seconds


def goal_batch_sizes(runs: int) -> dict:
    """Pipelines, goal 2 and the default batch size: total decode tokens/s of continuous batching at batch 1 to 16,
    on the GPT-2-124M shape (weight-bound: more rows read the weights once) and the shipped model."""
    import tempfile

    result = {}
    with tempfile.TemporaryDirectory() as folder:
        models = {"gpt2-124M": (gpt2_checkpoint(Path(folder)), 32), "shipped": (resolve_checkpoint(None), 128)}
        for name, (path, new_tokens) in models.items():
            model = use_decode_layout(load_checkpoint(path).model)
            rates = {
                batch: median_rate(runs, lambda: batched_decode_rate(model, batch, new_tokens))
                for batch in (1, 2, 4, 8, 16)
            }
            result[name] = {f"batch_{batch}_tok_s": round(rate, 1) for batch, rate in rates.items()}
            result[name]["batch_8_vs_1"] = round(rates[8] / rates[1], 2)
    result["threads"] = torch.get_num_threads()
    result["goal"] = "GPT-2-124M shape: batch 8 ≥ 4× batch 1"
    return result


GOALS = {
    "pipelines": lambda args: goal_pipelines(),
    "batch": lambda args: goal_batch_sizes(args.runs),
}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
