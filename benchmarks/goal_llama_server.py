"""`manas serve` beside llama.cpp's `llama-server` (issue 34, goal 4; needs `bash ../shared/tools/build-llamacpp.sh`,
skipped with a message without it): the shipped model on both, the same weights (manas's float32 checkpoint and
the f32 GGUF manas exports from it), llama-server with as many slots (`-np`) as manas's `--batch-size`, each server
under `chrt -f 1` on the same threads. Requests of 64 greedy tokens from 1, 16 and 64 clients at once; the figure is
the aggregate completion tokens/s (the servers' own `usage` counts over the wall time), the two servers taking
turns round after round. Every manas answer is checked against `manas generate --jsonl` with each request alone.

  llama-server: the shipped model, /v1/completions, 64 tokens a request (issue 34).
  smollm2:      the SmolLM2-135M shape (random weights from transformers' config, GPT-2's tokenizer, a ChatML
                template given to both servers), /v1/chat/completions, 128 tokens a request (issue 60, goal 5); every
                concurrent answer is checked against the same messages' answer with one client.

    python benchmarks/goal_llama_server.py --goal smollm2 --runs 1 --threads 2
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from goal_llama_cpp import LLAMA_CPP_DIR, LLAMA_CPP_TYPES, llama_cpp_files
from goal_serve import alone_texts, concurrent, start_server
from harness import MANAS, realtime, run_goals
from manas_cli.models import resolve_checkpoint

CLIENTS = (1, 16, 64)
BATCH_SIZE = 16  # manas serve's --batch-size default, and llama-server's -np
NEW_TOKENS = 64
CHAT_TOKENS = 128
CHAT_WINDOW = 512  # a chat request's positions at most: its prompt and CHAT_TOKENS
CHAT_TOPICS = ["Lyon", "the sea", "bread", "owls", "the number 7", "rain", "chess", "copper"]


def requests_for(clients: int) -> list[dict]:
    """Greedy requests, enough that every client sends several."""
    names = ["ROMEO", "JULIET", "KING RICHARD", "QUEEN", "NURSE", "FRIAR", "MERCUTIO", "TYBALT"]
    count = max(32, 2 * clients)
    return [{"prompt": f"{names[i % len(names)]}:", "max_tokens": NEW_TOKENS, "temperature": 0} for i in range(count)]


def free_port() -> int:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        return listener.getsockname()[1]


def start_llama_server(
    gguf: Path, threads: int, block_size: int, *flags: str, slots: int = BATCH_SIZE
) -> tuple[subprocess.Popen, int]:
    port = free_port()
    command = [
        str(LLAMA_CPP_DIR / "llama-server"),
        *("-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
        *("-t", str(threads), "-np", str(slots), "-c", str(slots * block_size), *flags),
    ]
    process = subprocess.Popen(realtime(command), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return process, port
        except OSError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("llama-server did not start")


def tokens_per_s(port: int, clients: int) -> tuple[float, list[str]]:
    requests = requests_for(clients)
    answers, seconds = concurrent(port, requests, clients)
    tokens = sum(answer["usage"]["completion_tokens"] for answer in answers)
    return tokens / seconds, [answer["choices"][0]["text"] for answer in answers]


def taking_turns(
    manas_port: int, llama_port: int, measure: Callable[[int, int], tuple[float, list[str]]], runs: int
) -> tuple[dict[str, float], dict[int, list[str]]]:
    """Both servers warmed by one client, then round after round each number of clients on manas, then on
    llama-server: the median tokens/s of each, and manas's texts of the last round by clients."""
    rates: dict[str, list[float]] = {}
    texts: dict[int, list[str]] = {}
    for port in (manas_port, llama_port):
        measure(port, 1)
    for _ in range(runs):
        for clients in CLIENTS:
            rate, texts[clients] = measure(manas_port, clients)
            rates.setdefault(f"manas_{clients}", []).append(rate)
            rate, _ = measure(llama_port, clients)
            rates.setdefault(f"llama_server_{clients}", []).append(rate)
            print(clients, {name: values[-1] for name, values in rates.items()}, file=sys.stderr, flush=True)
    return {name: round(statistics.median(values), 1) for name, values in rates.items()}, texts


def ratios(median: dict[str, float]) -> dict[int, float]:
    return {clients: round(median[f"manas_{clients}"] / median[f"llama_server_{clients}"], 2) for clients in CLIENTS}


def stop(*processes: subprocess.Popen) -> None:
    for process in processes:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def goal_llama_server(args) -> dict:
    checkpoint = resolve_checkpoint(None)
    with tempfile.TemporaryDirectory() as folder:
        gguf = llama_cpp_files(checkpoint, Path(folder))["f32"]
        block_size = json.loads(
            subprocess.run([*MANAS, "inspect-cache", "--json"], capture_output=True, text=True, check=True).stdout
        )["block_size"]
        # --max-connections: 64 clients reconnecting for each request outrun the default of 64 on 2 cores (a
        # client's next connection arrives before its last one's thread has ended)
        flags = ("--threads", str(args.threads), "--batch-size", str(BATCH_SIZE), "--max-connections", "256")
        manas, manas_port = start_server("-c", str(checkpoint), *flags, priority=True)
        llama, llama_port = start_llama_server(gguf, args.threads, block_size)
        try:
            median, texts = taking_turns(manas_port, llama_port, tokens_per_s, args.runs)
        finally:
            stop(manas, llama)
    return {
        "tokens_per_s": median,
        "manas_over_llama_server": ratios(median),
        "every_answer_equals_generate_alone": all(texts[c] == alone_texts(requests_for(c)) for c in CLIENTS),
        "goal": "≥ 1.0× at 1 client, ≥ 1.5× at 16 and 64, every answer equal",
    }


def chat_requests(clients: int) -> list[dict]:
    """Greedy chat requests of CHAT_TOKENS, each of the eight questions at least once, every client sending two."""
    count = max(len(CHAT_TOPICS), 2 * clients)
    return [
        {"messages": [{"role": "user", "content": f"Tell me about {CHAT_TOPICS[i % len(CHAT_TOPICS)]}."}]}
        | {"max_tokens": CHAT_TOKENS, "temperature": 0}
        for i in range(count)
    ]


def chat_rate(port: int, clients: int) -> tuple[float, list[str]]:
    answers, seconds = concurrent(port, chat_requests(clients), clients, "/v1/chat/completions")
    tokens = sum(answer["usage"]["completion_tokens"] for answer in answers)
    return tokens / seconds, [answer["choices"][0]["message"]["content"] for answer in answers]


def goal_smollm2(args) -> dict:
    from goal_chat import model

    with tempfile.TemporaryDirectory() as folder:
        checkpoint, template = model(Path(folder))
        gguf = llama_cpp_files(checkpoint, Path(folder))[LLAMA_CPP_TYPES[args.weights]]
        quantize = [] if args.weights == "float32" else ["--quantize", args.weights]
        flags = ("--threads", str(args.threads), "--batch-size", str(args.slots), "--max-connections", "256")
        manas, manas_port = start_server(
            "-c", str(checkpoint), "--chat-template", str(template), *flags, *quantize, priority=True
        )
        llama, llama_port = start_llama_server(
            gguf, args.threads, CHAT_WINDOW, "--jinja", "--chat-template-file", str(template), slots=args.slots
        )
        try:
            median, texts = taking_turns(manas_port, llama_port, chat_rate, args.runs)
        finally:
            stop(manas, llama)
    alone = dict(zip(map(json.dumps, chat_requests(1)), texts[1]))
    return {
        "weights": args.weights,
        "slots": args.slots,
        "tokens_per_s": median,
        "manas_over_llama_server": ratios(median),
        "every_answer_equals_one_client": all(
            alone[json.dumps(request)] == text
            for clients in CLIENTS
            for request, text in zip(chat_requests(clients), texts[clients])
        ),
        "goal": "≥ 1.0× at 1 client, ≥ 1.5× at 16 and 64, every answer equal",
    }


GOALS = {"llama-server": goal_llama_server, "smollm2": goal_smollm2}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
