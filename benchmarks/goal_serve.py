"""`manas serve` (issue 27) on the shipped model, a real server process on a loopback port, clients in threads:
1. 64 concurrent requests of 64 tokens against the same 64 sent one after another, every answer checked against
   `manas generate --jsonl` (each record equals its request alone);
2. the time from a request's prefill (its first token sampled: the server's --verbose access line gives that
   instant on CLOCK_MONOTONIC, which every process on the machine shares) to its first streamed chunk reaching the
   client (the client's time.monotonic());
3. 1,000 requests from 32 clients, a tenth malformed, a tenth disconnecting mid-stream: the answers, the crashes,
   the server's RSS from the 100th request to the last."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import threading
import time

from harness import MANAS, realtime, run_goals
from manas_cli.models import resolve_checkpoint

READY = re.compile(r"manas serve: http://127\.0\.0\.1:(\d+)/v1")


def start_server(*flags: str, priority: bool = False) -> tuple[subprocess.Popen, int]:
    """A `manas serve` on a free port, under `chrt -f 1` with priority (as its peer llama-server is)."""
    command = [*MANAS, "serve", "--port", "0", *flags]
    process = subprocess.Popen(realtime(command) if priority else command, stderr=subprocess.PIPE, text=True)
    while line := process.stderr.readline():
        if found := READY.search(line):
            threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()
            return process, int(found.group(1))
    raise RuntimeError("the server did not start")


def post(port: int, body: dict, path: str = "/v1/completions"):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    return connection, response


def complete(port: int, body: dict, path: str = "/v1/completions") -> dict:
    connection, response = post(port, body, path)
    data = json.loads(response.read())
    connection.close()
    return data


def requests_of(count: int, tokens: int) -> list[dict]:
    names = ["ROMEO", "JULIET", "KING RICHARD", "QUEEN", "NURSE", "FRIAR", "MERCUTIO", "TYBALT"]
    return [
        {"prompt": f"{names[i % len(names)]}:", "max_tokens": tokens, "temperature": 0.8, "seed": i}
        for i in range(count)
    ]


def alone_texts(requests: list[dict]) -> list[str]:
    done = subprocess.run(
        [*MANAS, "generate", "--jsonl"],
        input="".join(json.dumps(r) + "\n" for r in requests),
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    return [json.loads(line)["text"] for line in done.stdout.splitlines()]


def concurrent(port: int, requests: list[dict], clients: int, path: str = "/v1/completions") -> tuple[list, float]:
    answers = [None] * len(requests)
    pending = iter(range(len(requests)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                index = next(pending, None)
            if index is None:
                return
            answers[index] = complete(port, requests[index], path)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers, time.perf_counter() - started


def goal_throughput(process_flags: list[str]) -> dict:
    requests = requests_of(64, 64)
    process, port = start_server(*process_flags, "--batch-size", "64")
    try:
        complete(port, {"prompt": "warm", "max_tokens": 8})
        started = time.perf_counter()
        one_by_one = [complete(port, request) for request in requests]
        sequential_s = time.perf_counter() - started
        together, concurrent_s = concurrent(port, requests, 64)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    expected = alone_texts(requests)
    texts = [answer["choices"][0]["text"] for answer in together]
    return {
        "sequential_s": round(sequential_s, 2),
        "concurrent_s": round(concurrent_s, 2),
        "speed_up": round(sequential_s / concurrent_s, 2),
        "all_equal_generate_alone": texts == expected and [a["choices"][0]["text"] for a in one_by_one] == expected,
        "goal": "≥ 10× and every answer equal",
    }


def goal_first_token(process_flags: list[str], runs: int = 20) -> dict:
    """Each streamed request's first chunk, on the client's clock, against its first token's sampling, on the
    server's (the same clock)."""
    process = subprocess.Popen(
        [*MANAS, "serve", "--port", "0", "--verbose", *process_flags], stderr=subprocess.PIPE, text=True
    )
    port = int(next(found for line in process.stderr if (found := READY.search(line))).group(1))
    gaps = []
    try:
        for index in range(runs + 1):
            connection, response = post(port, {"prompt": "ROMEO:", "max_tokens": 32, "stream": True})
            while not response.readline().startswith(b"data: "):
                pass
            received = time.monotonic()
            response.read()
            connection.close()
            line = next(line for line in process.stderr if "first token at" in line)
            if index:
                gaps.append(received - float(line.rsplit(" ", 1)[1]))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    gaps.sort()
    return {
        "median_extra_ms": round(1000 * gaps[len(gaps) // 2], 2),
        "worst_extra_ms": round(1000 * gaps[-1], 2),
        "goal": "first token within 50 ms of the prefill's end",
    }


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def goal_soak(process_flags: list[str], total: int = 1000, clients: int = 32) -> dict:
    process, port = start_server(*process_flags, "--batch-size", "16", "--max-queue", "64")
    outcomes = {"ok": 0, "429": 0, "400": 0, "disconnected": 0, "wrong": 0, "other": 0}
    rss = {}
    lock = threading.Lock()
    counter = iter(range(total))

    def one(index: int) -> str:
        if index % 10 == 3:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            connection.request("POST", "/v1/completions", b'{"prompt": 1', {"Content-Type": "application/json"})
            status = connection.getresponse().status
            connection.close()
            return "400" if status == 400 else "other"
        if index % 10 == 7:
            connection, response = post(port, {"prompt": "ROMEO:", "max_tokens": 200, "stream": True})
            response.readline()
            connection.close()
            return "disconnected"
        answer = complete(port, {"prompt": "KING:", "max_tokens": 16, "temperature": 0})
        if "error" in answer:
            return "429" if answer["error"]["type"] == "rate_limit_error" else "other"
        return "ok" if answer["choices"][0]["text"] == expected else "wrong"

    def client() -> None:
        while True:
            with lock:
                index = next(counter, None)
            if index is None:
                return
            outcome = one(index)
            with lock:
                outcomes[outcome] += 1
                if index in (100, total - 1):
                    rss[index] = rss_kib(process.pid)

    try:
        expected = complete(port, {"prompt": "KING:", "max_tokens": 16, "temperature": 0})["choices"][0]["text"]
        threads = [threading.Thread(target=client) for _ in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        alive = process.poll() is None
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
    return {
        "outcomes": outcomes,
        "server_alive_after": alive,
        "exit_code": code,
        "rss_kib_at_100th_and_last": [rss.get(100), rss.get(total - 1)],
        "rss_change": round(rss[total - 1] / rss[100] - 1, 3) if len(rss) == 2 else None,
        "goal": "no crash, every well-formed answer right or 429, RSS within ±10%",
    }


def goal_serve(args) -> dict:
    flags = ["-c", str(resolve_checkpoint(None)), "--threads", str(args.threads)]
    return {"throughput_64": goal_throughput(flags), "first_token": goal_first_token(flags), "soak": goal_soak(flags)}


GOALS = {"serve": goal_serve}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
