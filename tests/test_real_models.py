"""Real models as people hold them (issue 57): a Llama-family model with SmolLM2's 8,192-token window served with
default flags on a machine whose free memory cannot hold 16 rows of that window."""

from __future__ import annotations

import re
import resource
import subprocess

import pytest

from cli_fixtures import MANAS, cli_env
from test_serve import READY

ADDRESS_SPACE_BYTES = 3 * 2**30  # ulimit -v: what the server may map; 16 rows of 8,192 positions need ~16 GiB


@pytest.fixture(scope="module")
def long_window(tmp_path_factory, tiny_bpe_spec):
    """A SmolLM2-shaped model declaring SmolLM2's 8,192-token window, converted."""
    from test_llama_family import converted, hf_folder

    folder = tmp_path_factory.mktemp("long-window")
    hf_folder(folder / "hf", tiny_bpe_spec, "smollm2", max_position_embeddings=8192)
    return converted(folder, folder / "hf")


def limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))


def test_serve_with_default_flags_keeps_the_window_that_fits_and_says_so(long_window):
    process = subprocess.Popen(
        [*MANAS, "serve", "-c", long_window, "--port", "0", "--threads", "1"],
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
        preexec_fn=limited,
    )
    try:
        ready = process.stderr.readline()
        found = READY.search(ready)
        kept = re.search(r"· window ([\d,]+) of 8,192 tokens, to fit the free memory \(--ctx sets it\)", ready)
        assert found and kept and int(kept.group(1).replace(",", "")) < 8192, ready
        import openai

        client = openai.OpenAI(base_url=f"http://{found.group(1)}:{found.group(2)}/v1", api_key="x", max_retries=0)
        done = client.completions.create(model="m", prompt="the", max_tokens=4, temperature=0)
        assert done.usage.completion_tokens == 4 or done.choices[0].finish_reason == "stop"
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0


def test_a_window_the_user_chose_is_kept_or_refused_never_changed(long_window):
    chosen = subprocess.run(
        [*MANAS, "serve", "-c", long_window, "--port", "0", "--threads", "1", "--ctx", "8192"],
        capture_output=True,
        text=True,
        env=cli_env(),
        preexec_fn=limited,
        timeout=120,
    )
    assert chosen.returncode == 1 and chosen.stderr.startswith("error: this run needs about")
    assert "lower --batch-size" in chosen.stderr
