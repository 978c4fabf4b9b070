"""`manas generate` through the real CLI: prompt sources, sampling flags, stop strings, batches, overflow policies,
byte-exact streaming, JSON lines, stats on stderr, Ctrl-C and closed pipes."""

from __future__ import annotations

import re
import signal
import subprocess

import pytest

from cli_fixtures import (  # noqa: F401 (checkpoints, learned and rope are fixtures)
    BLOCK_SIZE,
    LONG_PROMPT,
    MANAS,
    MULTIBYTE_PROMPT,
    RUN_OPTIONS,
    checkpoints,
    cli_env,
    generate,
    learned,
    manas,
    rope,
)

PAST_WINDOW = 5 * BLOCK_SIZE // 2  # 80 new tokens: the window overflows again and again
CONTRACT_FIELDS = {
    "text",
    "tokens",
    "finish_reason",
    "prompt_tokens",
    "generated_tokens",
    "ttft_s",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "re_prefills",
    "cache",
}
CACHE_FIELDS = {"positions", "logical_bytes", "storage_bytes", "dtype", "allocation"}
# name -> (Sampler settings for the in-process reference, the same settings as CLI flags)
SAMPLERS = {
    "greedy": (dict(temperature=0.0), ("-t", "0")),
    "top-k": (dict(temperature=1.0, top_k=8, seed=11), ("-t", "1.0", "--top-k", "8", "--seed", "11")),
    "top-p": (dict(temperature=0.9, top_p=0.7, seed=12), ("-t", "0.9", "--top-p", "0.7", "--seed", "12")),
    "top-k-top-p": (
        dict(temperature=1.2, top_k=20, top_p=0.9, seed=13),
        ("-t", "1.2", "--top-k", "20", "--top-p", "0.9", "--seed", "13"),
    ),
}


def expected_re_prefills(prompt_tokens: int, max_tokens: int) -> int:
    """With overflow recompute, every step after the cache reaches block_size positions re-prefills the window:
    the prefill yields the first token, and the k-th token after it runs over prompt_tokens + k - 1 positions."""
    return max(0, prompt_tokens + max_tokens - 1 - BLOCK_SIZE)


# ---- streaming and JSON -----------------------------------------------------------------------------------------

STREAM_CASES = [("rope-gqa", SAMPLERS["greedy"][1]), ("learned-mha", ("--seed", "3"))]


@pytest.mark.parametrize("name, sampling", STREAM_CASES, ids=["rope-gqa-greedy", "learned-mha-sampled"])
def test_streamed_stdout_is_the_full_decode_of_the_json_tokens_byte_for_byte(checkpoints, name, sampling):
    checkpoint = checkpoints[name]
    record = generate(checkpoint, "-p", MULTIBYTE_PROMPT, "-n", "40", *sampling, "--json").ok().json()
    streamed = generate(checkpoint, "-p", MULTIBYTE_PROMPT, "-n", "40", *sampling).ok()
    full_decode = checkpoint.encoding.decode(record["tokens"])  # invalid bytes become U+FFFD
    assert record["text"] == full_decode
    assert streamed.stdout == (full_decode + "\n").encode("utf-8")


def test_the_byte_exact_check_sees_characters_split_across_tokens(learned):
    """The random-weight model emits tokens that are not UTF-8 on their own (lone continuation bytes, halves of
    characters), so the comparison above really exercises the incremental decoder."""
    record = generate(learned, "-p", MULTIBYTE_PROMPT, "-n", "40", "--seed", "3", "--json").ok().json()

    def is_utf8(token: int) -> bool:
        try:
            learned.encoding.decode_single_token_bytes(token).decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    assert not all(map(is_utf8, record["tokens"]))


@pytest.mark.parametrize("name", ["rope-gqa", "learned-mha"])
def test_json_line_has_the_contract_fields_with_consistent_values(checkpoints, name):
    checkpoint = checkpoints[name]
    run = generate(checkpoint, "-p", MULTIBYTE_PROMPT, "-n", "40", *dict(STREAM_CASES)[name], "--json").ok()
    record = run.json()
    prompt_tokens = len(checkpoint.prompt_ids(MULTIBYTE_PROMPT))
    assert CONTRACT_FIELDS <= record.keys()
    assert CACHE_FIELDS <= record["cache"].keys()
    assert record["finish_reason"] == "length"
    assert record["prompt_tokens"] == prompt_tokens
    assert record["generated_tokens"] == len(record["tokens"]) == 40
    assert all(isinstance(token, int) for token in record["tokens"])
    assert record["ttft_s"] > 0 and record["prefill_tokens_per_s"] > 0 and record["decode_tokens_per_s"] > 0
    assert record["re_prefills"] == expected_re_prefills(prompt_tokens, 40) > 0
    assert record["cache"]["positions"] == BLOCK_SIZE  # the prompt and 39 fed-back tokens overflowed the window
    assert record["cache"]["storage_bytes"] >= record["cache"]["logical_bytes"] > 0
    assert record["cache"]["dtype"] == "float32"
    assert run.stderr == b""  # stats are on only when stderr is a terminal
    # No --overflow flag: the default, recompute, stays equal to the uncached reference past the window (and the
    # sampled run, with no -t, samples at the default temperature 0.8).
    settings = dict(temperature=0.0) if name == "rope-gqa" else dict(temperature=0.8, seed=3)
    assert record["tokens"] == checkpoint.reference(MULTIBYTE_PROMPT, 40, **settings)[0]


# ---- where the prompt comes from ---------------------------------------------------------------------------------

PROMPT = MULTIBYTE_PROMPT + "\n"
PROMPT_SOURCES = {
    "-p": (("-p", PROMPT), b""),
    "--prompt-file": (("--prompt-file", "{prompt_file}"), b""),
    "stdin": ((), PROMPT.encode()),
    "--prompt -": (("--prompt", "-"), PROMPT.encode()),
}


@pytest.mark.parametrize("source", PROMPT_SOURCES)
def test_every_prompt_source_gives_the_reference_continuation(rope, tmp_path, source):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_bytes(PROMPT.encode("utf-8"))
    args, stdin = PROMPT_SOURCES[source]
    args = tuple(arg.format(prompt_file=prompt_file) for arg in args)
    record = generate(rope, *args, "-n", "12", "-t", "0", "--json", stdin=stdin).ok().json()
    assert record["prompt_tokens"] == len(rope.prompt_ids(PROMPT))
    assert record["tokens"] == rope.reference(PROMPT, 12)[0]


def test_an_empty_prompt_starts_from_end_of_text(rope):
    record = generate(rope, "-p", "", "-n", "12", "-t", "0", "--json").ok().json()
    assert record["prompt_tokens"] == 1
    assert record["tokens"] == rope.reference("", 12)[0]


def test_max_tokens_one_is_the_prefill_token_alone(rope):
    record = generate(rope, "-p", "ROMEO:", "--max-tokens", "1", "-t", "0", "--json").ok().json()
    assert record["generated_tokens"] == 1
    assert record["tokens"] == rope.reference("ROMEO:", 1)[0]


def test_a_prompt_longer_than_the_window_is_cropped_to_its_last_block_size_tokens(rope):
    assert len(rope.encoding.encode_ordinary(LONG_PROMPT)) > BLOCK_SIZE
    run = generate(rope, "-p", LONG_PROMPT, "-n", "8", "-t", "0", "--json").ok()
    record = run.json()
    assert record["prompt_tokens"] == BLOCK_SIZE
    assert record["tokens"] == rope.reference(LONG_PROMPT, 8)[0]
    (notice,) = run.err.splitlines()
    assert notice.startswith("notice: ") and str(BLOCK_SIZE) in notice


# ---- sampling and the overflow policies --------------------------------------------------------------------------

RECOMPUTE_CASES = [("rope-gqa", sampler) for sampler in SAMPLERS] + [("learned-mha", "top-k-top-p")]


def past_window(checkpoint, flags: tuple[str, ...], overflow: str = "recompute", fresh: bool = False) -> dict:
    """The JSON record of PAST_WINDOW tokens after 'ROMEO:'."""
    return (
        generate(
            checkpoint, "-p", "ROMEO:", "-n", str(PAST_WINDOW), *flags, "--overflow", overflow, "--json", fresh=fresh
        )
        .ok()
        .json()
    )


@pytest.mark.parametrize("name, sampler", RECOMPUTE_CASES)
def test_overflow_recompute_equals_the_uncached_reference_past_block_size(checkpoints, name, sampler):
    checkpoint = checkpoints[name]
    settings, flags = SAMPLERS[sampler]
    record = past_window(checkpoint, flags, "recompute")
    assert record["re_prefills"] == expected_re_prefills(record["prompt_tokens"], PAST_WINDOW) > 0
    assert record["tokens"] == checkpoint.reference("ROMEO:", PAST_WINDOW, **settings)[0]
    if sampler != "greedy":
        assert len(set(record["tokens"])) > 10  # really sampled: the equality is not a degenerate loop's


@pytest.mark.parametrize("name", ["rope-gqa", "learned-mha"])
def test_overflow_shift_follows_the_reference_until_the_window_fills_then_differs(checkpoints, name):
    checkpoint = checkpoints[name]
    settings, flags = SAMPLERS["top-k-top-p"]
    with_logprobs = (*flags, "--logprobs", "1")
    shift, recompute = (
        past_window(checkpoint, with_logprobs, "shift"),
        past_window(checkpoint, with_logprobs, "recompute"),
    )
    reference = checkpoint.reference("ROMEO:", PAST_WINDOW, **settings)[0]
    before_overflow = BLOCK_SIZE - shift["prompt_tokens"] + 1  # tokens generated before the cache is first full
    assert len(shift["tokens"]) == PAST_WINDOW
    assert shift["tokens"][:before_overflow] == reference[:before_overflow]
    # Past it the model sees half a window: other probabilities (a confident tiny model may still draw the same tokens)
    shift_logprobs, recompute_logprobs = (
        [entry["logprob"] for entry in record["logprobs"]] for record in (shift, recompute)
    )
    assert shift_logprobs[:before_overflow] == pytest.approx(recompute_logprobs[:before_overflow], abs=1e-4)
    assert shift["tokens"] != reference or shift_logprobs[before_overflow:] != pytest.approx(
        recompute_logprobs[before_overflow:], abs=1e-4
    )
    # Half a window is re-prefilled, buying block_size/2 cached steps: far fewer re-prefills than recompute.
    assert 0 < shift["re_prefills"] <= PAST_WINDOW // (BLOCK_SIZE // 2) < recompute["re_prefills"]


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others(rope):
    _, flags = SAMPLERS["top-k"]
    assert flags[-2:] == ("--seed", "11")
    first, again = past_window(rope, flags), past_window(rope, flags, fresh=True)
    other = past_window(rope, (*flags[:-1], "14"))
    assert again["tokens"] == first["tokens"]
    assert other["tokens"] != first["tokens"]


# ---- stop strings -------------------------------------------------------------------------------------------------

STOP_RUN = ("-p", "ROMEO:", "-n", "40", "-t", "0.8", "--top-k", "20")


@pytest.fixture(scope="module")
def stops(rope) -> dict:
    """Stop strings found in the continuation without stops (the same seed makes the same text up to a stop):
    'split' begins in one token and ends in the next, so it must be held back while it arrives; 'late' is the
    text's last three characters, whose first occurrence comes after the split one's. The first seed whose text
    has such a split is used: the tiny model's training, and so its text, differs slightly between CPUs."""
    for seed in range(4, 44):
        run = (*STOP_RUN, "--seed", str(seed))
        record = generate(rope, *run, "--json").ok().json()
        assert record["finish_reason"] == "length"
        text, pieces = record["text"], [rope.encoding.decode([token]) for token in record["tokens"]]
        for j in range(2, len(pieces) - 1):
            split = pieces[j][-1] + pieces[j + 1]
            if len(pieces[j]) >= 2 and len(pieces[j + 1]) >= 2 and 0 < text.find(split) < text.find(text[-3:]):
                return {"run": run, "text": text, "split": split, "late": text[-3:]}
    raise AssertionError("no seed in 4..43 gave a stop string split across two tokens")


STOP_CASES = {"one stop": ("split",), "the earliest to occur wins": ("zqzq", "late", "split")}


@pytest.mark.parametrize("case", STOP_CASES)
def test_generation_ends_before_the_first_stop_string_which_is_not_printed(rope, stops, case):
    text = stops["text"]
    strings = [stops.get(stop, stop) for stop in STOP_CASES[case]]
    expected = text[: min(text.find(stop) for stop in strings if stop in text)]
    record = generate(rope, *stops["run"], *[arg for stop in strings for arg in ("--stop", stop)], "--json").ok().json()
    assert (record["text"], record["finish_reason"]) == (expected, "stop")


def test_a_stop_string_split_across_tokens_never_reaches_stdout(rope, stops):
    text = stops["text"]
    run = generate(rope, *stops["run"], "--stop", stops["split"]).ok()
    assert run.stdout == (text[: text.find(stops["split"])] + "\n").encode()


# ---- batches and echo ---------------------------------------------------------------------------------------------

SAMPLES_ARGS = ("-p", MULTIBYTE_PROMPT, "-n", "12", "-t", "1.0", "--seed", "21", "--num-samples", "3")


def test_num_samples_gives_one_json_line_per_sample_equal_to_the_batched_reference(rope):
    records = generate(rope, *SAMPLES_ARGS, "--json").ok().json_lines()
    reference = rope.reference(MULTIBYTE_PROMPT, 12, temperature=1.0, seed=21, num_samples=3)
    assert [record["tokens"] for record in records] == reference
    assert len({tuple(tokens) for tokens in reference}) > 1  # the rows sampled differently


@pytest.mark.parametrize("echo", [False, True], ids=["continuation", "--echo"])
def test_num_samples_in_text_mode_are_separated_by_a_blank_line(rope, echo):
    records = generate(rope, *SAMPLES_ARGS, "--json").ok().json_lines()
    run = generate(rope, *SAMPLES_ARGS, *(["--echo"] if echo else [])).ok()
    prefix = MULTIBYTE_PROMPT if echo else ""
    assert run.out == "\n\n".join(prefix + record["text"] for record in records) + "\n"


def test_echo_prints_the_prompt_before_the_continuation(rope):
    record = generate(rope, "-p", MULTIBYTE_PROMPT, "-n", "40", "-t", "0", "--json").ok().json()
    run = generate(rope, "-p", MULTIBYTE_PROMPT, "-n", "40", "-t", "0", "--echo").ok()
    assert run.stdout == (MULTIBYTE_PROMPT + record["text"] + "\n").encode("utf-8")


# ---- stats and notices on stderr ----------------------------------------------------------------------------------

STATS_LINE = re.compile(
    r"prompt (\d+) tokens · generated (\d+) · ttft \d+ ms · prefill [\d,]+ tok/s · decode [\d,.]+ tok/s · "
    r"re-prefills (\d+) · cache (\d+) positions, [\d.,]+ (B|KiB)"
)


@pytest.mark.parametrize(
    "flags, stderr_lines",
    [
        ((), ["notice"]),  # stderr is a pipe here: no stats by default
        (("--stats",), ["notice", "stats"]),
        (("--no-stats",), ["notice"]),
        (("--quiet",), []),
    ],
    ids=["default", "--stats", "--no-stats", "--quiet"],
)
def test_stats_and_notices_go_to_stderr_as_asked_and_never_change_stdout(rope, flags, stderr_lines):
    record = generate(rope, "-p", LONG_PROMPT, "-n", "8", "-t", "0", "--json").ok().json()
    run = generate(rope, "-p", LONG_PROMPT, "-n", "8", "-t", "0", *flags).ok()
    assert run.out == record["text"] + "\n"
    lines = run.err.splitlines()
    assert [("stats" if STATS_LINE.fullmatch(line) else line.split(":")[0]) for line in lines] == stderr_lines
    if "stats" in stderr_lines:
        numbers = [int(n) for n in STATS_LINE.fullmatch(lines[-1]).groups()[:4]]
        assert numbers == [BLOCK_SIZE, 8, expected_re_prefills(BLOCK_SIZE, 8), BLOCK_SIZE]


# ---- choosing the checkpoint --------------------------------------------------------------------------------------


def test_manas_checkpoint_variable_selects_the_model(learned):
    with_flag = generate(learned, "-p", "ROMEO:", "-n", "12", "-t", "0", "--json").ok().json()
    from_env = (
        manas(
            "generate",
            *RUN_OPTIONS,
            "-p",
            "ROMEO:",
            "-n",
            "12",
            "-t",
            "0",
            "--json",
            MANAS_CHECKPOINT=str(learned.path),
        )
        .ok()
        .json()
    )
    assert from_env["tokens"] == with_flag["tokens"]


def test_checkpoint_flag_wins_over_the_variable(learned, tmp_path):
    run = generate(
        learned, "-p", "ROMEO:", "-n", "12", "-t", "0", "--json", MANAS_CHECKPOINT=str(tmp_path / "absent.safetensors")
    ).ok()
    assert run.json()["tokens"] == learned.reference("ROMEO:", 12)[0]


# ---- interruption and closed pipes ----------------------------------------------------------------------------------


def start_generate(checkpoint, *args: str) -> subprocess.Popen:
    """Unbuffered pipes: what the test reads is exactly what left the process, nothing read ahead and lost. SIGINT
    is reset to its default in the child: a suite started in the background (`pytest &`) ignores it, Python then
    installs no KeyboardInterrupt handler, and the Ctrl-C tests would test nothing."""
    return subprocess.Popen(
        [*MANAS, "generate", "-c", str(checkpoint.path), *RUN_OPTIONS, *args],
        bufsize=0,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=cli_env(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def read_exactly(pipe, count: int) -> bytes:
    data = b""
    while len(data) < count and (chunk := pipe.read(count - len(data))):
        data += chunk
    return data


def test_ctrl_c_keeps_the_text_so_far_prints_the_stats_and_exits_130(rope):
    process = start_generate(rope, "-p", "ROMEO:", "-n", "100000", "-t", "0", "--stats")
    first = read_exactly(process.stdout, 1)  # generation has begun: interrupt it
    process.send_signal(signal.SIGINT)
    rest, stderr = process.communicate(timeout=120)
    stdout, err = (first + rest).decode(), stderr.decode()
    assert process.returncode == 130, err
    assert "Traceback" not in err and "error" not in err
    match = STATS_LINE.fullmatch(err.splitlines()[-1])
    assert match, err
    generated = int(match.group(2))
    assert 0 < generated < 100000
    assert stdout.endswith("\n")
    printed = stdout[:-1]
    assert printed and rope.encoding.decode(rope.reference("ROMEO:", generated)[0]).startswith(printed)


@pytest.mark.parametrize(
    "what, args",
    [
        ("streamed tokens", ("-p", "ROMEO:", "-n", "2000", "-t", "0", "--overflow", "shift")),
        # 200 KB of echo cannot fit in a pipe's buffer: the write must meet the closed pipe.
        ("echoed prompt", ("--prompt-file", "{big_prompt}", "--echo", "-n", "1", "--quiet")),
    ],
)
def test_a_closed_pipe_ends_quietly(rope, tmp_path, what, args):
    big_prompt = tmp_path / "big.txt"
    big_prompt.write_text("Speak, speak. " * 15_000, encoding="utf-8")
    process = start_generate(rope, *(arg.format(big_prompt=big_prompt) for arg in args))
    head = read_exactly(process.stdout, 20)  # as `| head -c 20`
    process.stdout.close()
    stderr = process.stderr.read().decode()
    process.wait(timeout=120)
    assert len(head) == 20
    assert stderr == ""
    assert process.returncode != 1
