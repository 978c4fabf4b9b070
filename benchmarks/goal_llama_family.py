"""Issue 36's goals for Llama-family models, on random weights of the real shapes built with transformers' config
classes (no weights can be downloaded here), each converted by `manas convert` from the folder transformers saves.

  exact:   logits of both engines against transformers' (SmolLM2-135M, Qwen2.5-0.5B, TinyLlama-1.1B with 4 layers),
           and the GGUF export's greedy text in llama-completion against manas' (SmolLM2 shape, 8 prompts).
  speed:   decode and prefill against llama.cpp on the same weights (manas' GGUF, q8_0/q4_0 by llama-quantize).
  startup: a whole `manas generate -n 100` process against llama-completion's (SmolLM2 shape, float32).
  depth:   pp512 and tg128 after 2,048 tokens in the cache against llama-bench -d 2048 (SmolLM2 shape).

The tokenizer is GPT-2's (byte-level BPE), so the vocabularies of SmolLM2 (49,152) and TinyLlama (32,000) are
GPT-2's 50,257 here; Qwen2.5 keeps its 151,936 rows, more than the tokenizer has (as the real one does).

    python benchmarks/goal_llama_family.py --goal exact --goal speed --goal startup --runs 1
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from goal_llama_cpp import LLAMA_CPP_DIR, against_llama_cpp
from harness import MANAS, Unavailable, realtime, run_goals
from manas_cli.formats.huggingface import tokenizer_files
from manas_cli.formats.tokenizer import shipped_gpt2

GPT2_VOCAB = 50257
SHAPES = {
    "smollm2-135m": (
        "LlamaConfig",
        dict(
            vocab_size=GPT2_VOCAB,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5-0.5b": (
        "Qwen2Config",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    "tinyllama-1.1b-4-layers": (
        "LlamaConfig",
        dict(
            vocab_size=GPT2_VOCAB,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=4,
            max_position_embeddings=2048,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
}
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "ROMEO: But soft, what light",
    "1, 2, 3, 4,",
    "The weather today",
    "In 1969, the first",
    "Dear Sir or Madam,",
]


def hf_model_and_checkpoint(name: str, folder: Path) -> tuple[torch.nn.Module, Path]:
    """The shape's random model as transformers saves it (with GPT-2's tokenizer files), converted by manas."""
    import transformers

    config_class, values = SHAPES[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**values)).eval()
    hf = folder / name
    model.save_pretrained(hf)
    for file, text in tokenizer_files(shipped_gpt2(), values["max_position_embeddings"], hf).items():
        (hf / file).write_text(text, encoding="utf-8")
    checkpoint = folder / f"{name}.safetensors"
    subprocess.run([*MANAS, "convert", str(hf), "--out", str(checkpoint)], check=True, capture_output=True)
    return model, checkpoint


def relative_errors(model: torch.nn.Module, checkpoint: Path) -> dict[str, float]:
    """Both engines' logits over 64 random tokens against transformers', relative to the logits' largest value."""
    from manas_cli.models import ModelOptions, open_model

    ids = torch.randint(0, 50000, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits[0]
    errors = {}
    for engine in ("native", "torch"):
        runner = open_model(ModelOptions(checkpoint=checkpoint, engine=engine, threads=2)).engine
        if engine == "native":
            logits = runner.logits_from(ids.tolist(), 0)
            got = torch.frombuffer(logits.buffer, dtype=torch.float32).view(-1, logits.vocab)[: ids.size(1)]
        else:
            with torch.no_grad():
                got = runner.model(ids)[0]
        errors[engine] = float((got - expected).abs().max() / expected.abs().max())
    return errors


def gguf_greedy_equal(checkpoint: Path, folder: Path, tokens: int = 32) -> dict[str, int]:
    """manas' greedy tokens and llama-completion's on manas' f32 GGUF export, as bytes, prompt by prompt."""
    from manas_cli.formats.checkpoint import load_checkpoint

    gguf = folder / "model.gguf"
    subprocess.run(
        [*MANAS, "export", str(checkpoint), "--format", "gguf", "--outtype", "f32", "--out", str(gguf)],
        check=True,
        capture_output=True,
    )
    encoding = load_checkpoint(checkpoint).encoding
    equal = 0
    for prompt in PROMPTS:
        run = [*MANAS, "generate", "-c", str(checkpoint), "-p", prompt, "-n", str(tokens), "-t", "0", "--json"]
        mine = encoding.decode_bytes(json.loads(subprocess.run(run, check=True, capture_output=True).stdout)["tokens"])
        theirs = subprocess.run(
            [str(LLAMA_CPP_DIR / "llama-completion"), "-m", str(gguf), "-p", prompt, "-n", str(tokens), "--temp", "0"]
            + ["-no-cnv", "--no-warmup", "-t", "2", "--simple-io"],
            capture_output=True,
            check=True,
        ).stdout
        equal += theirs.startswith(prompt.encode() + mine)
    return {"prompts": len(PROMPTS), "equal": equal}


def goal_exact(args) -> dict:
    if not (LLAMA_CPP_DIR / "llama-completion").is_file():
        raise Unavailable(f"llama.cpp is not built in {LLAMA_CPP_DIR}: run `bash ../shared/tools/build-llamacpp.sh`")
    report = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in SHAPES:
            model, checkpoint = hf_model_and_checkpoint(name, Path(folder))
            report[name] = relative_errors(model, checkpoint)
            if name == "smollm2-135m":
                report["gguf_greedy_in_llama_completion"] = gguf_greedy_equal(checkpoint, Path(folder))
            del model
    return report


def goal_speed(args) -> dict:
    """pp64 and 64 new tokens, manas float32/int8/int4 beside llama.cpp f32/q8_0/q4_0, 1 and 2 threads."""
    report = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in ("smollm2-135m", "qwen2.5-0.5b"):
            _, checkpoint = hf_model_and_checkpoint(name, Path(folder))
            report[name] = against_llama_cpp(checkpoint, 64, 64, args.runs)
    return report


def goal_startup(args) -> dict:
    """Whole processes, taking turns: `manas generate -n 100` and llama-completion -n 100 on the SmolLM2 shape."""
    with tempfile.TemporaryDirectory() as folder:
        _, checkpoint = hf_model_and_checkpoint("smollm2-135m", Path(folder))
        gguf = Path(folder) / "model.gguf"
        subprocess.run([*MANAS, "export", str(checkpoint), "--format", "gguf", "--outtype", "f32", "--out", str(gguf)])
        commands = {
            "manas": [
                *MANAS,
                "generate",
                "-c",
                str(checkpoint),
                "-p",
                "Hello",
                "-n",
                "100",
                "-t",
                "0",
                "--threads",
                "2",
            ],
            "llama_completion": [str(LLAMA_CPP_DIR / "llama-completion"), "-m", str(gguf), "-p", "Hello", "-n", "100"]
            + ["--temp", "0", "-no-cnv", "-t", "2", "--simple-io"],
        }
        seconds = {name: [] for name in commands}
        for _ in range(args.runs + 1):
            for name, command in commands.items():
                start = time.perf_counter()
                subprocess.run(realtime(command), capture_output=True, check=True)
                seconds[name].append(time.perf_counter() - start)
    best = {name: round(min(taken[1:]), 2) for name, taken in seconds.items()}
    return {"seconds": best, "manas_over_llama_completion": round(best["manas"] / best["llama_completion"], 2)}


def goal_depth(args) -> dict:
    """Issue 60's goal 2 on the SmolLM2 shape: prefill of 512 tokens and 128 decoded after 2,048 already in the
    cache (manas bench --depth, llama-bench -d), float32/int8/int4 beside f32/q8_0/q4_0, 1 and 2 threads. Goal:
    decode ≥ 1.2× and prefill ≥ 1.0× llama.cpp."""
    with tempfile.TemporaryDirectory() as folder:
        _, checkpoint = hf_model_and_checkpoint("smollm2-135m", Path(folder))
        return against_llama_cpp(checkpoint, 512, 128, args.runs, depth=2048)


GOALS = {"exact": goal_exact, "speed": goal_speed, "startup": goal_startup, "depth": goal_depth}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
