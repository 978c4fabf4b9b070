"""Speculative decoding by prompt lookup that changes nothing (issue 72): `manas generate --lookup N` gives the text,
tokens, log-probabilities and stop reason of the same command without it, greedy and seeded (with penalties), on
float32, int8 and int4 weights, within the window and past it (a check never crosses a re-prefill), with stop
strings; and a check's logits are the decode steps' bit for bit, in the core."""

from __future__ import annotations

import json

import pytest

from cli_fixtures import RUN_OPTIONS, manas
from conftest import needs_compiler
from manas_cli.engine.speculation import PROBE_EVERY, DraftLength, lookup_proposal
from manas_cli.settings import GenerationSettings, Speculation, as_overrides, with_overrides
from test_llama_family import llama_files  # noqa: F401 (a fixture)

# A prompt that repeats itself, so proposals come and some are kept even by a random model's loops
PROMPT = "the theatre in the city, the theatre in the city, the theatre in the"
SAMPLERS = {
    "greedy": ("-t", "0"),
    "seeded": ("-t", "0.9", "--top-k", "40", "--seed", "1"),
    "penalized": ("-t", "0.7", "--seed", "2", "--repetition-penalty", "1.1", "--presence-penalty", "0.2"),
}  # seeds whose texts run their 48 tokens (another may end at once, and check nothing)
WINDOW = 64  # past it: the prompt's 39 tokens and 25 more, then a re-prefill at every step


def test_a_proposal_is_what_followed_the_latest_earlier_occurrence_of_the_last_ngram():
    text = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert lookup_proposal(text, 3, 4) == [7, 8, 1, 2]  # the latest earlier "1 2 3" was followed by 7 8 1 2
    assert lookup_proposal(text, 3, 1) == [7]
    assert lookup_proposal([5, 6, 7, 6], 2, 4) == [7, 6]  # no earlier "7 6": the last token alone, "6", was
    assert lookup_proposal([1, 2, 3], 3, 4) == []  # nothing repeats
    assert lookup_proposal(text, 3, 0) == []


def test_a_check_asks_for_as_many_tokens_as_pay_and_none_where_checks_cost_more_than_they_keep():
    """Measured costs in, k out: a plain step first (what checks are measured against), then draft_max; cheap
    proposed tokens that are kept keep k high, dear ones that are missed make the steps plain, with a one-token
    probe after PROBE_EVERY of them, then after twice as many; --draft-min keeps k at least that."""
    cheap = DraftLength(6)
    assert cheap.next() == 0
    cheap.stepped(0.010)
    assert cheap.next() == 6
    for _ in range(5):
        cheap.checked(6, 6, 0.010 + 6 * 0.001)  # a check of 6 costs 1.6 steps and keeps them all
    assert cheap.next() == 6
    dear = DraftLength(6)
    dear.stepped(0.010)
    for _ in range(5):
        dear.checked(4, 0, 0.010 + 4 * 0.008)  # each proposed token costs 0.8 of a step, and none is kept
    assert dear.next() == 0
    for _ in range(PROBE_EVERY):
        dear.stepped(0.010)
    assert dear.next() == 1
    dear.checked(1, 0, 0.018)  # the probe does not pay either: the next one comes after twice as many steps
    for _ in range(PROBE_EVERY):
        dear.stepped(0.010)
    assert dear.next() == 0
    for _ in range(PROBE_EVERY):
        dear.stepped(0.010)
    assert dear.next() == 1
    slow = DraftLength(6)  # a draft slower than the model: not even a guess always kept pays, so no probe
    slow.stepped(0.010)
    for _ in range(4):
        slow.checked(4, 4, 0.010 + 4 * 0.012)
    for _ in range(4 * PROBE_EVERY):
        slow.stepped(0.010)
        assert slow.next() == 0
    pinned = DraftLength(6, draft_min=2)
    pinned.stepped(0.010)
    for _ in range(5):
        pinned.checked(2, 0, 0.030)
    assert pinned.next() == 2 and DraftLength(6, draft_min=2).next() == 6  # no plain step is needed first


def generated(path, *flags: str) -> dict:
    return manas("generate", "-c", path, *RUN_OPTIONS, "-p", PROMPT, "--json", *flags).ok().json()


@needs_compiler
@pytest.mark.parametrize("window", ["within", "past"])
@pytest.mark.parametrize("sampler", list(SAMPLERS))
@pytest.mark.parametrize("weights", ["float32", "int8", "int4"])
def test_lookup_gives_the_text_of_plain_decoding_token_for_token(llama_files, weights, sampler, window):  # noqa: F811
    flags = [*SAMPLERS[sampler], "-n", "48", "--logprobs", "2", *(["--ctx", str(WINDOW)] if window == "past" else [])]
    plain = generated(llama_files[weights], *flags)
    fast = generated(llama_files[weights], *flags, "--lookup", "2", "--draft-max", "4")
    for field in ("text", "tokens", "logprobs", "finish_reason", "re_prefills"):
        assert fast[field] == plain[field], field
    assert fast["proposed_tokens"] > 0 and 0 <= fast["accepted_tokens"] <= fast["proposed_tokens"]
    assert plain["engine"] == fast["engine"] == "native"
    if window == "past":
        assert fast["re_prefills"] > 0


@needs_compiler
def test_some_proposals_are_kept_and_a_stop_string_ends_the_same_text(llama_files):  # noqa: F811
    """A greedy random model loops: lookup proposes its loop, and the model keeps what it draws itself."""
    flags = ("-t", "0", "-n", "64")
    fast = generated(llama_files["float32"], *flags, "--lookup", "3", "--draft-max", "8", "--draft-min", "8")
    assert fast["accepted_tokens"] > 0
    stop = fast["text"][len(fast["text"]) // 2 :][:3]
    assert (
        generated(llama_files["float32"], *flags, "--stop", stop, "--lookup", "3")["text"]
        == generated(llama_files["float32"], *flags, "--stop", stop)["text"]
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--lookup", "2", "--num-samples", "2"), "one sample"),
        (("--lookup", "100000"), "--lookup takes an n-gram of 1 to"),
    ],
)
def test_lookup_refusals_are_one_error_line(llama_files, flags, message):  # noqa: F811
    run = manas("generate", "-c", llama_files["float32"], *RUN_OPTIONS, "-p", PROMPT, "-n", "4", *flags)
    assert run.returncode != 0 and run.err.startswith("error: ") and message in run.err, run.err
    assert len(run.err.strip().splitlines()) == 1


def test_lookup_on_the_torch_engine_is_refused_by_name(llama_files):  # noqa: F811
    run = manas("generate", "-c", llama_files["float32"], *RUN_OPTIONS, "-p", PROMPT, "-n", "4", "--lookup", "2",
                MANAS_ENGINE="torch")  # fmt: skip
    assert run.returncode != 0 and "native engine" in run.err and len(run.err.strip().splitlines()) == 1


@needs_compiler
@pytest.mark.parametrize("window", ["within", "past"])
@pytest.mark.parametrize("sampler", list(SAMPLERS))
@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_a_draft_model_gives_the_text_of_plain_decoding_token_for_token(llama_files, weights, sampler, window):  # noqa: F811
    """The model's own int4 copy drafts: its guesses are kept where the model draws them itself, and the text,
    log-probabilities and stop reason are plain decoding's, past the window too (the draft keeps its own)."""
    flags = [*SAMPLERS[sampler], "-n", "48", "--logprobs", "2", *(["--ctx", str(WINDOW)] if window == "past" else [])]
    plain = generated(llama_files[weights], *flags)
    draft = ("--draft-model", str(llama_files["int4"]), "--draft-max", "5")
    for fast in (generated(llama_files[weights], *flags, *draft), generated(llama_files[weights], *flags, *draft,
                                                                               "--draft-min", "5")):  # fmt: skip
        for field in ("text", "tokens", "logprobs", "finish_reason", "re_prefills"):
            assert fast[field] == plain[field], field
    assert 0 < fast["accepted_tokens"] <= fast["proposed_tokens"]  # a copy of the model agrees with it often
    if window == "past":
        assert fast["re_prefills"] > 0


@needs_compiler
def test_the_draft_flag_has_llama_cpps_names_and_a_draft_of_one_token_changes_nothing(llama_files):  # noqa: F811
    flags = ("-t", "0", "-n", "32")
    plain = generated(llama_files["float32"], *flags)
    for name in ("-md", "--model-draft"):
        fast = generated(llama_files["float32"], *flags, name, str(llama_files["int8"]), "--spec-draft-n-max", "1",
                         "--spec-draft-n-min", "1")  # fmt: skip
        assert fast["tokens"] == plain["tokens"] and fast["accepted_tokens"] > 0


@needs_compiler
def test_a_draft_whose_vocabulary_differs_is_one_error_line(llama_files, smollm2):  # noqa: F811
    """SmolLM2's real tokenizer against the hand-written one: the ids would name other tokens."""
    run = manas("generate", "-c", llama_files["float32"], *RUN_OPTIONS, "-p", PROMPT, "-n", "4",
                "--draft-model", str(smollm2[1]))  # fmt: skip
    assert run.returncode != 0 and run.err.startswith("error: the draft model ") and "another vocabulary" in run.err
    assert "token ids against" in run.err and len(run.err.strip().splitlines()) == 1, run.err


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--draft-model", "no-such-draft.safetensors"), "the draft model no-such-draft.safetensors"),
        (("--draft-model", "DRAFT", "--lookup", "2"), "choose one"),
        (("--draft-model", "DRAFT", "--num-samples", "2"), "--draft-model decodes one sample"),
        (("--draft-model", "DRAFT", "--draft-max", "65"), "--draft-max"),
    ],
)
def test_draft_refusals_are_one_error_line(llama_files, flags, message):  # noqa: F811
    flags = [str(llama_files["int4"]) if flag == "DRAFT" else flag for flag in flags]
    run = manas("generate", "-c", llama_files["float32"], *RUN_OPTIONS, "-p", PROMPT, "-n", "4", *flags)
    assert run.returncode != 0 and message in run.err, run.err
    assert len([line for line in run.err.strip().splitlines() if line.strip()]) <= 1 or "Usage" in run.err


@needs_compiler
@pytest.mark.parametrize(
    "flags, name", [(("--lookup", "2"), "tg24 lookup2"), (("--draft-model", "INT4"), "tg24 draft")]
)
def test_bench_times_speculation_and_reports_what_its_proposals_came_to(llama_files, flags, name):  # noqa: F811
    flags = [str(llama_files["int4"]) if flag == "INT4" else flag for flag in flags]
    run = manas("bench", "-c", llama_files["float32"], *RUN_OPTIONS, "-p", PROMPT, "-n", "24", "-r", "1",
                "--no-baseline", "--json", "--draft-min", "4", *flags).ok()  # fmt: skip
    report = run.json()
    assert [test["name"] for test in report["tests"]][1:] == ["tg24", name]
    spec = report["speculation"]
    assert 0 < spec["accepted_tokens"] <= spec["proposed_tokens"] and spec["checks"] > 0
    assert spec["acceptance_rate"] == spec["accepted_tokens"] / spec["proposed_tokens"]
    assert spec["tokens_per_check"] == (spec["accepted_tokens"] + spec["checks"]) / spec["checks"] > 1
    assert spec["speedup"] > 0
    table = manas("bench", "-c", llama_files["float32"], *RUN_OPTIONS, "-p", PROMPT, "-n", "8", "-r", "1",
                  "--no-baseline", *flags).ok()  # fmt: skip
    assert "speculation: accepted " in table.out and "tokens per check" in table.out


def test_bench_speculation_refuses_a_depth_and_a_batch(llama_files):  # noqa: F811
    for flags, message in ((("--depth", "8"), "drop --depth"), (("--batch", "2"), "one sample")):
        run = manas("bench", "-c", llama_files["float32"], *RUN_OPTIONS, "-n", "4", "--lookup", "2", *flags)
        assert run.returncode != 0 and message in run.err, run.err


# ---- --jsonl lines and the server: speculation inside continuous batching ----

FIELDS = ("text", "tokens", "logprobs", "finish_reason")
LINES = [  # (the line's own settings, whether it speculates when the command does not)
    ({"temperature": 0, "max_tokens": 40}, False),
    ({"temperature": 0, "max_tokens": 40, "speculative": {"lookup": 2}}, True),
    ({"temperature": 0.9, "seed": 3, "max_tokens": 40, "speculative": {"lookup": 3, "draft_max": 6}}, True),
    ({"temperature": 0, "max_tokens": 40, "stop": ["the"], "speculative": {"lookup": 1}}, True),
    ({"temperature": 0.7, "seed": 4, "max_tokens": 33, "logprobs": 2}, False),
]


def jsonl_records(path, lines: list[dict], *flags: str) -> list[dict]:
    text = "".join(json.dumps({"prompt": PROMPT, **line}) + "\n" for line in lines)
    run = manas("generate", "-c", path, *RUN_OPTIONS, "--jsonl", "--batch-size", "3", *flags, stdin=text.encode()).ok()
    return [json.loads(line) for line in run.out.splitlines()]


def plain(line: dict) -> dict:
    return {key: value for key, value in line.items() if key != "speculative"}


@needs_compiler
def test_jsonl_lines_that_speculate_share_steps_with_lines_that_do_not_and_keep_their_records(llama_files):  # noqa: F811
    lines = [settings for settings, _ in LINES]
    fast = jsonl_records(llama_files["float32"], lines)
    slow = jsonl_records(llama_files["float32"], [plain(line) for line in lines])
    for record, reference, (_, speculates) in zip(fast, slow, LINES):
        assert {f: record.get(f) for f in FIELDS} == {f: reference.get(f) for f in FIELDS}
        assert ("proposed_tokens" in record) == speculates
    assert sum(record.get("accepted_tokens", 0) for record in fast) > 0


@needs_compiler
@pytest.mark.parametrize("flags", [("--lookup", "2"), ("--draft-model", "INT4", "--draft-max", "3")])
def test_jsonl_speculates_on_every_line_with_the_commands_flag_unless_a_line_turns_it_off(llama_files, flags):  # noqa: F811
    flags = [str(llama_files["int4"]) if flag == "INT4" else flag for flag in flags]
    lines = [plain(settings) for settings, _ in LINES] + [{"max_tokens": 20, "seed": 5, "speculative": False}]
    fast = jsonl_records(llama_files["float32"], lines, *flags)
    slow = jsonl_records(llama_files["float32"], [plain(line) for line in lines])
    for record, reference in zip(fast, slow):
        assert {f: record.get(f) for f in FIELDS} == {f: reference.get(f) for f in FIELDS}
    assert all("proposed_tokens" in record for record in fast[:-1]) and "proposed_tokens" not in fast[-1]
    assert sum(record["accepted_tokens"] for record in fast[:-1]) > 0


def test_a_jsonl_line_whose_speculation_cannot_run_gets_an_error_record(llama_files):  # noqa: F811
    """A draft no command loaded, a lookup of 0 (false turns speculation off), one past the window."""
    lines = [{"max_tokens": 4, "speculative": {"draft": True}}, {"max_tokens": 4, "speculative": {"lookup": 0}},
             {"max_tokens": 4, "speculative": {"lookup": 100000}}, {"max_tokens": 4}]  # fmt: skip
    text = "".join(json.dumps({"prompt": PROMPT, **line}) + "\n" for line in lines)
    run = manas("generate", "-c", llama_files["float32"], *RUN_OPTIONS, "--jsonl", stdin=text.encode())
    records = [json.loads(line) for line in run.out.splitlines()]
    assert run.returncode == 1 and [("error" in r) for r in records] == [True, True, True, False]
    assert "--draft-model" in records[0]["error"] and "speculative.lookup" in records[1]["error"]
    assert "the window" in records[2]["error"]


@pytest.fixture(scope="module")
def speculating_server(llama_files):  # noqa: F811
    from test_serve import running_server

    with running_server(llama_files["float32"], "--batch-size", "4", "--engine", "native") as live:
        yield live


def completion(server, body: dict) -> dict:
    status, _, answer = server.raw(
        "POST", "/v1/completions", json.dumps({"prompt": PROMPT, **body}).encode(), {"Content-Type": "application/json"}
    )
    assert status == 200, answer
    return answer


@needs_compiler
def test_the_server_speculates_inside_its_batch_and_answers_as_without(speculating_server):
    """Requests that speculate (lookup, a prediction) and requests that do not, sent at once: each answer is the
    one it gets without speculation, and usage says what its proposals came to, as OpenAI reports a prediction's."""
    from concurrent.futures import ThreadPoolExecutor

    bodies = [settings for settings, _ in LINES] + [
        {"temperature": 0, "max_tokens": 40, "prediction": {"type": "content", "content": PROMPT + " in the city"}}
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        fast = list(pool.map(lambda body: completion(speculating_server, body), bodies))
    for answer, body in zip(fast, bodies):
        reference = completion(
            speculating_server, {k: v for k, v in body.items() if k not in ("speculative", "prediction")}
        )
        assert answer["choices"][0]["text"] == reference["choices"][0]["text"]
        assert answer["choices"][0]["finish_reason"] == reference["choices"][0]["finish_reason"]
        speculates = "speculative" in body or "prediction" in body
        assert ("completion_tokens_details" in answer["usage"]) == speculates
    details = [
        answer["usage"]["completion_tokens_details"]
        for answer in fast
        if "completion_tokens_details" in answer["usage"]
    ]
    assert sum(d["accepted_prediction_tokens"] for d in details) > 0
    assert all(d["rejected_prediction_tokens"] >= 0 for d in details)


@needs_compiler
@pytest.mark.parametrize(
    "body, message",
    [
        ({"speculative": {"lookup": 1.5}}, "speculative.lookup must be"),
        ({"speculative": {"ngram": 2}}, "speculative has 'ngram'"),
        ({"speculative": {"draft": True}}, "--draft-model"),
        ({"speculative": {"lookup": 100000}}, "the window"),
        ({"prediction": {"type": "text", "content": "x"}}, "prediction must be"),
        ({"prediction": {"type": "content", "content": "the theatre " * 400}}, "more tokens than the model's window"),
    ],
)
def test_speculation_the_server_cannot_run_is_a_400_naming_the_field(speculating_server, body, message):
    status, _, answer = speculating_server.raw(
        "POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 4, **body}).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    assert status == 400 and message in answer["error"]["message"], answer
    assert answer["error"]["param"] in ("speculative", "prediction")


@needs_compiler
def test_a_server_with_a_draft_model_speculates_on_every_request_and_answers_as_without(llama_files):  # noqa: F811
    from test_serve import running_server

    body = {"temperature": 0.8, "seed": 9, "max_tokens": 30}
    with running_server(llama_files["float32"], "--draft-model", str(llama_files["int4"])) as live:
        fast = completion(live, body)
        off = completion(live, {**body, "speculative": {"draft": False}})
    assert fast["choices"][0]["text"] == off["choices"][0]["text"]
    assert fast["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    assert "completion_tokens_details" not in off["usage"]


@needs_compiler
@pytest.mark.parametrize("sampling", [("-t", "0"), ("-t", "0.8", "--seed", "6")], ids=["greedy", "seeded"])
def test_chat_speculates_each_answer_over_the_conversations_cache_and_answers_as_without(smollm2, sampling):
    """SmolLM2's real template, three turns: each answer with a lookup, or with the model itself as its draft
    (which proposes what the model draws: every guess kept), is the answer without; later turns still reuse the
    cache."""
    lines = ["Hello there, friend!", "Say it again: hello there, friend!", "And once more."]

    def answers(*flags: str) -> list[dict]:
        return manas("chat", "-c", smollm2[1], *RUN_OPTIONS, "--json", "-n", "24", *sampling, *flags,
                     stdin=("\n".join(lines) + "\n").encode()).ok().json_lines()  # fmt: skip

    plain = answers()
    for flags in (("--lookup", "2"), ("--draft-model", str(smollm2[1]))):
        fast = answers(*flags)
        assert [a["text"] for a in fast] == [a["text"] for a in plain]
        assert [a["tokens"] for a in fast] == [a["tokens"] for a in plain]
        assert all(a["reused_tokens"] > 0 for a in fast[1:])
        if flags[0] == "--draft-model":
            assert all(a["accepted_tokens"] == a["proposed_tokens"] > 0 for a in fast)


@needs_compiler
@pytest.mark.parametrize("proposer", [("--lookup", "1"), ("--draft-model", "INT4")], ids=["lookup", "draft"])
@pytest.mark.parametrize("sampling", [("-t", "0"), ("-t", "0.9", "--seed", "8")], ids=["greedy", "seeded"])
def test_a_structured_output_constrains_the_models_draws_and_cuts_a_proposal_that_breaks_it(
    llama_files,  # noqa: F811
    proposer,
    sampling,
):
    """The grammar masks the model's own draw at each checked position, so a proposed token it forbids is never
    kept: the text matches the pattern and equals the constrained text without speculation."""
    pytest.importorskip("llguidance")
    proposer = [str(llama_files["int4"]) if flag == "INT4" else flag for flag in proposer]
    flags = ("--regex", "(the |theatre |city, ){4,12}", "-n", "40", *sampling)
    plain = generated(llama_files["float32"], *flags)
    fast = generated(llama_files["float32"], *flags, *proposer)
    for field in ("text", "tokens", "finish_reason"):
        assert fast[field] == plain[field], field
    assert fast["proposed_tokens"] > 0


@pytest.mark.parametrize(
    "speculation",
    [Speculation(lookup=3, draft_max=6), Speculation(draft=True), Speculation()],
    ids=["lookup", "draft", "none"],
)
def test_a_requests_speculation_goes_to_a_record_and_back_unchanged(speculation):
    """batch hands its settings to Ray's workers as a record's keys (settings.as_overrides)."""
    settings = GenerationSettings(speculative=speculation)
    assert with_overrides(GenerationSettings(), as_overrides(settings)).speculative == speculation
