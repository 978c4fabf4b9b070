"""Issue 37's goals: a 20-turn chat on the SmolLM2-135M shape (random weights from transformers' config, GPT-2's
tokenizer, a ChatML-shaped template), the time to the first token of each turn.

  server: through /v1/chat/completions (streamed), with the prefix cache and without it (--prefix-cache-mb 0),
          every answer compared between the two. Goal: turn 20's time to first token within 1.5× turn 1's.
  chat:   `manas chat --json` through a pipe, the same 20 messages. Goal: the same.

    python benchmarks/goal_chat.py --goal server --goal chat
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import time
from pathlib import Path

from goal_llama_family import hf_model_and_checkpoint
from harness import MANAS, run_goals

TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TURNS = 20
ANSWER_TOKENS = 32
MESSAGES = [f"Question {i}: tell me one thing about the number {i * 7} and the city of Lyon." for i in range(TURNS)]
READY = re.compile(r"http://([\d.]+):(\d+)/v1")


def model(folder: Path) -> tuple[Path, Path]:
    _, checkpoint = hf_model_and_checkpoint("smollm2-135m", folder)
    template = folder / "chatml.jinja"
    template.write_text(TEMPLATE)
    return checkpoint, template


def server_turns(checkpoint: Path, template: Path, *flags: str) -> list[tuple[float, str]]:
    """(seconds to the first streamed token, the answer) of each turn of one conversation, on a server of its own."""
    import openai

    process = subprocess.Popen(
        [*MANAS, "serve", "-c", str(checkpoint), "--chat-template", str(template), "--port", "0", "--threads", "2"]
        + ["--ctx", "2048", "--batch-size", "4"]
        + list(flags),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        while not (found := READY.search(line := process.stderr.readline())):
            lines.append(line)
            if not line:
                raise RuntimeError("manas serve did not start: " + "".join(lines))
        client = openai.OpenAI(base_url=f"http://{found[1]}:{found[2]}/v1", api_key="none", timeout=600)
        # a process's first request pays for its first touch of the weights (about 50 ms here, whichever server
        # runs first): a warm-up that shares no token with the chat, so the prefix cache holds nothing it can use
        client.completions.create(model="m", prompt="x", max_tokens=1)
        messages, turns = [], []
        for text in MESSAGES:
            messages.append({"role": "user", "content": text})
            started, first, pieces = time.perf_counter(), None, []
            stream = client.chat.completions.create(
                model="m", messages=messages, max_tokens=ANSWER_TOKENS, temperature=0, stream=True
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter() - started
                    pieces.append(chunk.choices[0].delta.content)
            answer = "".join(pieces)
            turns.append((first or 0.0, answer))
            messages.append({"role": "assistant", "content": answer})
        return turns
    finally:
        process.terminate()
        process.wait(timeout=60)


def summary(turns: list[tuple[float, str]]) -> dict:
    first, last = turns[0][0], turns[-1][0]
    return {"ttft_turn_1_s": round(first, 3), "ttft_turn_20_s": round(last, 3), "ratio": round(last / first, 2)}


def goal_server(args) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        checkpoint, template = model(Path(folder))
        cached = server_turns(checkpoint, template)
        plain = server_turns(checkpoint, template, "--prefix-cache-mb", "0")
    return {
        "with_prefix_cache": summary(cached),
        "without": summary(plain),
        "answers_equal": sum(a == b for (_, a), (_, b) in zip(cached, plain)),
        "turns": TURNS,
    }


def goal_chat(args) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        checkpoint, template = model(Path(folder))
        done = subprocess.run(
            [*MANAS, "chat", "-c", str(checkpoint), "--chat-template", str(template), "--json", "-t", "0", "-n"]
            + [str(ANSWER_TOKENS), "--threads", "2"],
            input="\n".join(MESSAGES) + "\n",
            capture_output=True,
            text=True,
            check=True,
        )
    records = [json.loads(line) for line in done.stdout.splitlines()]
    return {
        **summary([(record["ttft_s"], record["text"]) for record in records]),
        "prompt_tokens_turn_20": records[-1]["prompt_tokens"],
        "reused_tokens_turn_20": records[-1]["reused_tokens"],
    }


GOALS = {"server": goal_server, "chat": goal_chat}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
