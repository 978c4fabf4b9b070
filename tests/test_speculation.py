"""Speculative decoding by prompt lookup that changes nothing (issue 72): `manas generate --lookup N` gives the text,
tokens, log-probabilities and stop reason of the same command without it, greedy and seeded (with penalties), on
float32, int8 and int4 weights, within the window and past it (a check never crosses a re-prefill), with stop
strings; and a check's logits are the decode steps' bit for bit, in the core."""

from __future__ import annotations

import pytest

from cli_fixtures import RUN_OPTIONS, manas
from conftest import needs_compiler
from manas_cli.engine.speculation import lookup_proposal
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
    fast = generated(llama_files["float32"], *flags, "--lookup", "3", "--draft-max", "8")
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
    fast = generated(llama_files[weights], *flags, "--draft-model", str(llama_files["int4"]), "--draft-max", "5")
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
        fast = generated(llama_files["float32"], *flags, name, str(llama_files["int8"]), "--draft-max", "1")
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
