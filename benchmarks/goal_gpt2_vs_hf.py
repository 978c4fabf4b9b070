"""Goal 1: GPT-2-124M shape, batch 1, 64-token prompt, 256 new tokens, float32: manas decode tokens/s against
Hugging Face `generate` on the same random weights, and against the weight-bandwidth limit (needs transformers:
pip install -e ".[test]")."""

from __future__ import annotations

import torch

from harness import (
    GPT2_NEW_TOKENS,
    GPT2_PROMPT_TOKENS,
    gpt2_pair,
    hf_decode_rate,
    manas_decode_rate,
    median_rate,
    run_goals,
    timed,
)
from manas_cli.engine.bench import bench_prompt
from manas_cli.torch_engine.model import use_decode_layout


def read_bandwidth_bytes_per_s(gib: float = 1.0) -> float:
    """Streaming read bandwidth: the best of a few sums over a buffer far larger than the caches."""
    buffer = torch.ones(int(gib * 2**30) // 4)
    buffer.sum()
    best = min(timed(buffer.sum) for _ in range(5))
    return buffer.numel() * 4 / best


def matvec_bandwidth_bytes_per_s(in_features: int = 768, out_features: int = 3072, total_gib: float = 0.5) -> float:
    """How fast BLAS streams weights through matrix-vector products (decode's case): layer-shaped matrices,
    stored (in, out), far more of them than the caches hold, the best of a few passes."""
    count = int(total_gib * 2**30) // (in_features * out_features * 4)
    weights = [torch.randn(out_features, in_features).t().contiguous().t() for _ in range(count)]
    x = torch.randn(1, in_features)

    def stream() -> None:
        for weight in weights:
            torch.nn.functional.linear(x, weight)

    stream()
    best = min(timed(stream) for _ in range(3))
    return count * in_features * out_features * 4 / best


def goal_gpt2_vs_hf(threads: int, runs: int) -> dict:
    torch.set_num_threads(threads)
    hf, manas = gpt2_pair()
    new_tokens = GPT2_NEW_TOKENS
    prompt = bench_prompt(manas, GPT2_PROMPT_TOKENS, 1)
    results = {"hf_generate": median_rate(runs, lambda: hf_decode_rate(hf, prompt, new_tokens))}
    results["manas_plain_layout_dynamic"] = median_rate(
        runs, lambda: manas_decode_rate(manas, prompt, new_tokens, "dynamic")
    )
    use_decode_layout(manas)
    for allocation in ("dynamic", "static"):
        results[f"manas_{allocation}"] = median_rate(
            runs, lambda: manas_decode_rate(manas, prompt, new_tokens, allocation)
        )
    weight_bytes = sum(p.numel() * p.element_size() for p in manas.parameters())
    weight_bytes -= manas.position_embedding.weight.numel() * 4  # one row read per token, not the table
    read_bandwidth = read_bandwidth_bytes_per_s()
    matvec_bandwidth = matvec_bandwidth_bytes_per_s()
    best = max(results["manas_dynamic"], results["manas_static"])
    return {
        "tokens_per_s": results,
        "weight_bytes_per_token": weight_bytes,
        "read_bandwidth_gb_per_s": read_bandwidth / 1e9,
        "matvec_bandwidth_gb_per_s": matvec_bandwidth / 1e9,
        "read_limit_tokens_per_s": read_bandwidth / weight_bytes,
        "matvec_limit_tokens_per_s": matvec_bandwidth / weight_bytes,
        "ratio_vs_hf": best / results["hf_generate"],
        "fraction_of_read_limit": best * weight_bytes / read_bandwidth,
        "fraction_of_matvec_limit": best * weight_bytes / matvec_bandwidth,
    }


GOALS = {
    "1": lambda args: goal_gpt2_vs_hf(args.threads, args.runs),
}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
