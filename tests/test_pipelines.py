"""Pipelines: --jsonl requests decoded together by continuous batching, each record equal to the request alone; the
controls scripts need (penalties, min-p, log-probabilities); scoring a text; seeds a script can keep. Through the
real CLI, against the in-process crop-and-recompute reference."""

from __future__ import annotations

import json
import math
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cli_fixtures import (  # noqa: F401 (fixtures)
    BLOCK_SIZE,
    MANAS,
    RUN_OPTIONS,
    TinyCheckpoint,
    checkpoints,
    cli,
    cli_env,
    learned,
    manas,
    rope,
)
from conftest import engine_of
from manas_cli.engine.generation import generate_reference, prompt_batch
from manas_cli.engine.sampling import choose_seed, make_sampler
from manas_cli.formats.tokenizer import decodable
from manas_cli.settings import GenerationSettings, with_overrides

SHIPPED = TinyCheckpoint("shipped", Path(__file__).resolve().parents[1] / "checkpoints" / "shakespeare.safetensors")
WORDS = "ROMEO JULIET KING The what love thou art sweet night day O speak me no my lord".split()


def reference_tokens(
    checkpoint: TinyCheckpoint, prompt: str, settings: GenerationSettings, engine: str = "auto"
) -> list[int]:
    """The request alone, as crop-and-recompute (which `manas generate` equals, token for token) computes it on
    the engine the CLI runs, up to end-of-text or the token that completes a stop string."""
    model = engine_of(checkpoint.loaded.model) if engine == "torch" else checkpoint.runner
    encoding = checkpoint.encoding
    sampler = make_sampler(settings, choose_seed(settings.seed), decodable(encoding), model)
    ids = encoding.encode_ordinary(prompt)[-model.config.block_size :] or [checkpoint.eot_id]
    tokens, text = [], b""
    for step in generate_reference(model, prompt_batch(ids, 1), sampler, settings.max_tokens, checkpoint.eot_id):
        if step.tokens[0] == checkpoint.eot_id:
            break
        tokens.append(step.tokens[0])
        text += encoding.decode_single_token_bytes(step.tokens[0])
        if any(stop in text.decode("utf-8", errors="ignore") for stop in settings.stop):
            break
    return tokens


def mixed_requests(count: int, seed: int, max_tokens: tuple[int, int]) -> list[dict]:
    """Prompts of 1 to 40 words, budgets in a range, half greedy and half seeded, some with penalties."""
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        request = {
            "prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 40))),
            "max_tokens": rng.randint(*max_tokens),
            "id": f"r{index}",
        }
        if index % 2:
            request |= {"temperature": 0.9, "seed": rng.randrange(2**53), "top_k": 40}
        else:
            request["temperature"] = 0.0
        if index % 5 == 0:
            request |= {"repetition_penalty": 1.3, "repeat_last_n": 16, "frequency_penalty": 0.2, "min_p": 0.02}
        if index % 3 == 0:  # stop strings that match early, late or never: a stopped row leaves the batch mid-run
            request["stop"] = [rng.choice(["e", "\n", " the", "O", "zzz"])]
        requests.append(request)
    return requests


def jsonl(checkpoint_path: Path, lines: list[str], *args: str) -> subprocess.CompletedProcess:
    return cli(
        "generate",
        "-c",
        checkpoint_path,
        *RUN_OPTIONS,
        "--jsonl",
        *args,
        stdin="".join(line + "\n" for line in lines).encode(),
    )


@pytest.mark.parametrize(
    "model, batch_size, budgets",
    [
        ("rope", "8", (5, 70)),  # past the 32-position window, re-prefilling
        ("rope", "1", (5, 70)),
        ("rope", "16", (5, 70)),
        ("learned", "3", (5, 70)),
        ("shipped", "8", (3, 12)),
    ],
)
def test_every_jsonl_record_equals_the_request_alone(checkpoints, model, batch_size, budgets, engine):
    checkpoint = {"rope": checkpoints["rope-gqa"], "learned": checkpoints["learned-mha"], "shipped": SHIPPED}[model]
    requests = mixed_requests(52, seed=len(model), max_tokens=budgets)
    done = jsonl(checkpoint.path, [json.dumps(r) for r in requests], "--batch-size", batch_size, "--engine", engine)
    assert done.returncode == 0, done.stderr.decode()
    records = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert [record["id"] for record in records] == [request["id"] for request in requests]  # input order
    stops = 0
    for request, record in zip(requests, records):
        settings = with_overrides(GenerationSettings(), {k: v for k, v in request.items() if k not in ("prompt", "id")})
        assert record["tokens"] == reference_tokens(checkpoint, request["prompt"], settings, engine), request
        assert record["engine"] == engine
        if record["finish_reason"] == "stop":
            stops += 1
            assert settings.stop[0] not in record["text"]
            assert record["text"] in checkpoint.encoding.decode(record["tokens"])
        else:
            assert record["text"] == checkpoint.encoding.decode(record["tokens"])
        assert record["temperature"] == settings.temperature and record["min_p"] == settings.min_p
    assert stops >= (1 if model == "learned" else 3)  # stops matched mid-batch (random weights emit fewer letters)


def test_a_jsonl_record_is_the_generate_record_of_the_request_alone(rope):
    request = {
        "prompt": "ROMEO:",
        "max_tokens": 40,
        "temperature": 0.8,
        "seed": 11,
        "stop": ["\n\n"],
        "presence_penalty": 0.5,
        "logprobs": 2,
    }
    (record,) = [json.loads(line) for line in jsonl(rope.path, [json.dumps(request)]).stdout.decode().splitlines()]
    alone = (
        manas(
            "generate",
            "-c",
            rope.path,
            *RUN_OPTIONS,
            "-p",
            "ROMEO:",
            "-n",
            "40",
            "-t",
            "0.8",
            "--seed",
            "11",
            "--stop",
            "\n\n",
            "--presence-penalty",
            "0.5",
            "--logprobs",
            "2",
            "--json",
        )
        .ok()
        .json()
    )
    timing = {"ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s", "cache"}
    assert {k: v for k, v in record.items() if k not in timing | {"id"}} == {
        k: v for k, v in alone.items() if k not in timing
    }
    assert record["id"] == 1


BAD_LINES = {
    "not-json": ("{prompt", "not JSON"),
    "not-an-object": ('["ROMEO:"]', "not a JSON object but list"),
    "no-prompt": ('{"max_tokens": 3}', "no 'prompt' string"),
    "unknown-key": ('{"prompt": "a", "temprature": 1}', "unknown key 'temprature'"),
    "out-of-range": ('{"prompt": "a", "top_p": 1.5}', "top_p must be a number with 0 < top_p <= 1, got 1.5"),
    "bad-stop": ('{"prompt": "a", "stop": [""]}', "stop must be a list of non-empty strings"),
}


def test_bad_lines_get_an_error_record_and_the_others_go_on(rope):
    good = json.dumps({"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0})
    lines = [good]
    for text, _ in BAD_LINES.values():
        lines += [text, good]
    done = jsonl(rope.path, lines)
    assert done.returncode == 1
    records = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert len(records) == len(lines)
    for number, (record, line) in enumerate(zip(records, lines), start=1):
        if line == good:
            assert record["tokens"] == rope.reference("ROMEO:", 4)[0] and record["id"] == number
        else:
            assert set(record) == {"id", "line", "error"} and record["line"] == number
    errors = [record["error"] for record in records if "error" in record]
    for error, (_, fragment) in zip(errors, BAD_LINES.values()):
        assert fragment in error
    assert done.stderr.decode().strip().endswith("6 of 13 lines failed (their records have an 'error' field)")


def test_characters_outside_a_character_vocabulary_fail_only_their_line(tmp_path):
    from test_convert import convert_character_model  # a nanoGPT character-level model, converted

    path, _ = convert_character_model(tmp_path, "First Citizen:\nBefore we proceed any further, hear me speak.\n")
    done = jsonl(
        path, [json.dumps({"prompt": "First", "max_tokens": 2}), json.dumps({"prompt": "Zebra", "max_tokens": 2})]
    )
    records = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert done.returncode == 1 and "error" not in records[0] and "'Z'" in records[1]["error"]


def test_an_empty_input_writes_nothing_and_succeeds(rope):
    done = jsonl(rope.path, [])
    assert done.returncode == 0 and done.stdout == b""


def test_ctrl_c_keeps_the_records_done_in_order_and_exits_130(rope):
    lines = [json.dumps({"prompt": "ROMEO:", "max_tokens": 3, "temperature": 0})] * 4
    lines += [json.dumps({"prompt": "KING:", "max_tokens": 1_000_000, "temperature": 0})]
    process = subprocess.Popen(
        [*MANAS, "generate", "-c", rope.path, *RUN_OPTIONS, "--jsonl"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    process.stdin.write("".join(line + "\n" for line in lines).encode())
    process.stdin.close()
    first = process.stdout.readline()  # a record is out: the model is loaded and decoding
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    rest = process.stdout.read()  # through the same buffer as readline: it may hold the records after the first
    process.wait(timeout=60)
    records = [json.loads(line) for line in (first + rest).decode().splitlines()]
    assert process.returncode == 130
    assert [record["id"] for record in records] == [1, 2, 3, 4]


def test_a_closed_pipe_ends_quietly(rope):
    lines = "".join(json.dumps({"prompt": "ROMEO:", "max_tokens": 5}) + "\n" for _ in range(50))
    done = subprocess.run(
        f"{' '.join(MANAS)} generate -c {rope.path} --threads 1 --jsonl | head -3",
        shell=True,
        input=lines.encode(),
        capture_output=True,
        env=cli_env(),
        timeout=300,
    )
    assert len(done.stdout.decode().splitlines()) == 3 and done.stderr == b""


# ---- the controls ---------------------------------------------------------------------------------------------------


def test_a_repetition_penalty_breaks_the_loop_a_greedy_small_model_falls_into():
    looping = manas("generate", *RUN_OPTIONS, "-p", "JULIET:", "-n", "60", "-t", "0", "--json").ok().json()
    penalized = (
        manas("generate", *RUN_OPTIONS, "-p", "JULIET:", "-n", "60", "-t", "0", "--repetition-penalty", "1.3", "--json")
        .ok()
        .json()
    )
    assert looping["text"].count("JULIET:") > 2  # "JULIET: O, how now!" over and over
    assert penalized["text"].count("JULIET:") < looping["text"].count("JULIET:")
    assert penalized["repetition_penalty"] == 1.3 and penalized["repeat_last_n"] == 64


def test_logprobs_name_each_token_and_the_likeliest_alternatives(rope):
    record = (
        manas(
            "generate", "-c", rope.path, *RUN_OPTIONS, "-p", "ROMEO:", "-n", "6", "-t", "0", "--logprobs", "3", "--json"
        )
        .ok()
        .json()
    )
    assert [entry["id"] for entry in record["logprobs"]] == record["tokens"]
    for entry in record["logprobs"]:
        top = [alternative["logprob"] for alternative in entry["top_logprobs"]]
        assert len(top) == 3 and top == sorted(top, reverse=True) and entry["logprob"] <= 0
        assert entry["logprob"] == top[0]  # greedy takes the likeliest
        assert bytes(entry["bytes"]).decode(errors="replace") == entry["text"]
    refused = manas("generate", "-c", rope.path, *RUN_OPTIONS, "-p", "a", "--logprobs", "2")
    assert refused.returncode == 2 and "--json" in refused.err


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--min-p", "1.5"),
        ("--repetition-penalty", "0"),
        ("--repeat-last-n", "-2"),
        ("--frequency-penalty", "3"),
        ("--logprobs", "21"),
    ],
)
def test_controls_out_of_range_are_usage_errors(rope, flag, value):
    run = manas("generate", "-c", rope.path, *RUN_OPTIONS, "-p", "a", flag, value)
    assert run.returncode == 2 and "must be" in run.err


def test_a_chosen_seed_is_exact_in_json_and_shown_in_the_stats():
    run = manas("generate", *RUN_OPTIONS, "-p", "ROMEO:", "-n", "3", "--json", "--stats", fresh=True).ok()
    seed = run.json()["seed"]
    assert 0 <= seed < 2**53 and float(seed) == seed
    assert run.err.rstrip().endswith(f"seed {seed}")


# ---- score -----------------------------------------------------------------------------------------------------------


def test_score_equals_the_loss_computed_by_hand_within_one_window(rope, tmp_path):
    text = "ROMEO:\nWhat light through yonder"
    ids = rope.encoding.encode_ordinary(text)
    assert len(ids) <= BLOCK_SIZE
    with torch.no_grad():
        logits = rope.loaded.model(torch.tensor([ids]))[0, :-1]
        nats = F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()
    (tmp_path / "t.txt").write_text(text)
    report = manas("score", tmp_path / "t.txt", "-c", rope.path, *RUN_OPTIONS, "--json").ok().json()
    assert report["tokens"] == len(ids) - 1 and report["characters"] == len(text)
    assert report["nats_per_token"] == pytest.approx(nats / (len(ids) - 1), rel=1e-5)
    assert report["perplexity"] == pytest.approx(math.exp(report["nats_per_token"]), rel=1e-9)


def test_score_slides_a_window_so_each_token_is_scored_once(rope, shakespeare):
    text = shakespeare[:3000]
    run = manas("score", "-", "-c", rope.path, *RUN_OPTIONS, "--stride", "8", "--json", stdin=text.encode()).ok()
    report = run.json()
    assert report["tokens"] == len(rope.encoding.encode_ordinary(text)) - 1 and report["stride"] == 8
    whole = manas("score", "-", "-c", rope.path, *RUN_OPTIONS, "--stride", "32", "--json", stdin=text.encode()).ok()
    windows = math.ceil((report["tokens"] + 1) / BLOCK_SIZE)
    assert whole.json()["tokens"] == report["tokens"] - (windows - 1)  # a window's first token has no context in it


def test_score_reads_an_int8_file(rope, tmp_path, shakespeare):
    quantized = tmp_path / "int8.safetensors"
    manas("quantize", rope.path, "--out", quantized).ok()
    (tmp_path / "t.txt").write_text(shakespeare[:2000])
    floats = manas("score", tmp_path / "t.txt", "-c", rope.path, *RUN_OPTIONS, "--json").ok().json()
    int8 = manas("score", tmp_path / "t.txt", "-c", quantized, *RUN_OPTIONS, "--json").ok().json()
    assert int8["weights"] == "int8" and abs(int8["nats_per_char"] - floats["nats_per_char"]) < 0.05
