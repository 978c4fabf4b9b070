"""Models by name: `manas pull` from a Hub on loopback ($HF_ENDPOINT) into the store ($MANAS_HOME), `manas list`,
`manas rm`, and -m NAME wherever a checkpoint is taken; an interrupted download leaves nothing in the store and
resumes; offline mode reads the cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_fixtures import manas
from local_hub import local_hub
from test_llama_family import CHATML, hf_folder

pytest.importorskip("huggingface_hub")

REPO = "TinyOrg/Tiny-Chat-135M"


@pytest.fixture(scope="module")
def repository(tmp_path_factory, tiny_bpe_spec):
    """A SmolLM2-shaped instruct model's repository as transformers writes it, with its chat template."""
    folder = tmp_path_factory.mktemp("repo")
    hf_folder(folder, tiny_bpe_spec, "smollm2")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    (folder / "README.md").write_text("not downloaded: convert does not read it")
    return folder


def environment(tmp_path, hub) -> dict[str, str | None]:
    """The local Hub, a cache and a store of the test's own; online (other test modules set offline mode)."""
    store = str(tmp_path / "store")
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "MANAS_HOME": store, "HF_HUB_OFFLINE": None}


def test_pull_stores_the_model_by_name_and_every_command_takes_the_name(tmp_path, repository):
    with local_hub(REPO, repository) as hub:
        env = environment(tmp_path, hub)
        manas("pull", REPO, "--quantize", "int8", **env).ok()
        assert not any("README" in path for path, _ in hub.requests)  # only what convert reads
    listed = {entry["name"]: entry for entry in json.loads(manas("list", "--json", **env).ok().out)}
    assert set(listed) == {"shakespeare", "tiny-chat-135m", "tiny-chat-135m-int8"}
    entry = listed["tiny-chat-135m"]
    assert (entry["architecture"], entry["weights"], entry["window"], entry["chat_template"]) == (
        "llama-family",
        "float",
        512,
        True,
    )
    assert listed["tiny-chat-135m-int8"]["weights"] == "int8" and listed["tiny-chat-135m-int8"]["chat_template"]
    assert listed["shakespeare"]["shipped"] and not listed["shakespeare"]["chat_template"]
    by_name = manas("generate", "--model", "tiny-chat-135m", "-p", "the", "-n", "8", "-t", "0", "--json", **env).ok()
    by_path = manas("generate", "-c", entry["path"], "-p", "the", "-n", "8", "-t", "0", "--json", **env).ok()
    assert by_name.json()["tokens"] == by_path.json()["tokens"]
    text = manas("list", **env).ok().out
    assert text.splitlines()[0].split() == ["NAME", "ARCHITECTURE", "PARAMETERS", "WEIGHTS", "SIZE", "WINDOW", "CHAT"]
    manas("rm", "tiny-chat-135m-int8", **env).ok()
    assert "tiny-chat-135m-int8" not in manas("list", fresh=True, **env).ok().out


def test_an_interrupted_download_leaves_nothing_behind_and_the_next_pull_completes(tmp_path, repository):
    with local_hub(REPO, repository) as hub:
        env = environment(tmp_path, hub)
        hub.cut["model.safetensors"] = 4_000  # the connection drops every 4 kB, more often than the client retries
        failed = manas("pull", REPO, "--name", "tiny", **env)
        assert failed.returncode == 1 and failed.err.startswith("error: ") and "Traceback" not in failed.err
        assert len(failed.err.strip().splitlines()) == 1
        assert not (tmp_path / "store" / "models").exists() or not list((tmp_path / "store" / "models").iterdir())
        assert not [path for path in (tmp_path / "hf").rglob("*") if "incomplete" in path.name]
        del hub.cut["model.safetensors"]
        hub.requests.clear()
        manas("pull", REPO, "--name", "tiny", fresh=True, **env).ok()
        fetched = [path.rsplit("/", 1)[-1] for path, _ in hub.requests if "/resolve/" in path]
        assert fetched == ["model.safetensors"]  # what was complete is not fetched again
    assert (tmp_path / "store" / "models" / "tiny.safetensors").is_file()
    offline = {**env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}  # the cache alone
    manas("pull", REPO, "--name", "again", **offline).ok()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pull", "not a repo"], "is not a Hugging Face repository"),
        (["pull", "TinyOrg/absent"], "no repository TinyOrg/absent"),
        (["pull", REPO, "--name", "Bad/Name"], "is not a store name"),
        (["pull", REPO, "--name", "shakespeare"], "the name of the model shipped with manas"),
        (["rm", "shakespeare"], "the model shipped with manas"),
        (["rm", "absent"], "no model named 'absent' in the store"),
        (["generate", "-m", "absent", "-p", "x"], "`manas list` shows the names"),
    ],
)
def test_store_mistakes_are_one_error_line(tmp_path, repository, args, message):
    with local_hub(REPO, repository) as hub:
        run = manas(*args, **environment(tmp_path, hub))
    assert run.returncode == 1 and run.err.startswith("error: ") and message in run.err, run.err
    assert len(run.err.strip().splitlines()) == 1


def test_the_shipped_model_is_known_by_its_path_not_its_name(tmp_path, repository):
    """A file in the store under the shipped model's name (stored before pull refused the name) is the user's: listed
    as theirs, removable, and never what -m shakespeare runs."""
    with local_hub(REPO, repository) as hub:
        env = environment(tmp_path, hub)
        pulled = manas("pull", REPO, "--name", "mine", **env).ok()
    assert "manas chat -m mine" in pulled.err  # a chat model's hint is chat
    models = tmp_path / "store" / "models"
    (models / "mine.safetensors").rename(models / "shakespeare.safetensors")
    listed = json.loads(manas("list", "--json", **env).ok().out)
    assert [(entry["name"], entry["shipped"]) for entry in listed] == [("shakespeare", True), ("shakespeare", False)]
    shipped = manas("generate", "-m", "shakespeare", "-p", "ROMEO:", "-n", "4", "-t", "0", "--json", **env).ok()
    by_path = manas("generate", "-m", listed[0]["path"], "-p", "ROMEO:", "-n", "4", "-t", "0", "--json", **env).ok()
    assert shipped.json()["tokens"] == by_path.json()["tokens"]
    manas("rm", "shakespeare", **env).ok()
    assert not (models / "shakespeare.safetensors").exists()
    refused = manas("rm", "shakespeare", fresh=True, **env)
    assert refused.returncode == 1 and "the model shipped with manas" in refused.err


def test_a_file_larger_than_the_free_disk_is_one_error_line_without_the_hubs_warning(tmp_path, repository):
    with local_hub(REPO, repository) as hub:
        hub.claimed["model.safetensors"] = 2**60  # more than any disk holds: huggingface_hub warns, in two lines
        run = manas("pull", REPO, "--name", "big", **environment(tmp_path, hub))
    assert run.returncode == 1 and run.err.startswith("error: ") and len(run.err.strip().splitlines()) == 1, run.err


def test_pulling_a_name_twice_needs_force(tmp_path, repository):
    with local_hub(REPO, repository) as hub:
        env = environment(tmp_path, hub)
        manas("pull", REPO, "--name", "t", **env).ok()
        again = manas("pull", REPO, "--name", "t", fresh=True, **env)
        assert again.returncode == 1 and "--force" in again.err
        manas("pull", REPO, "--name", "t", "--force", **env).ok()


def test_the_readme_first_commands_run_as_written(tmp_path, tiny_bpe_spec):
    """pull → chat → serve, as the README shows them, against a Hub on loopback serving that repository's name: a
    SmolLM2-shaped model with SmolLM2's real tokenizer and chat template."""
    import re
    import subprocess
    from pathlib import Path

    from cli_fixtures import MANAS, cli_env
    from test_real_tokenizers import smollm2_folder
    from test_serve import READY

    repository = tmp_path / "repository"
    smollm2_folder(repository, tiny_bpe_spec)

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## First commands", 1)[1].split("```text", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    pull, chat, serve = [line.split("#")[0].split() for line in block.splitlines() if line.strip()]
    with local_hub(pull[2], repository) as hub:
        env = cli_env(**{k: v for k, v in environment(tmp_path, hub).items() if v is not None})
        env.pop("HF_HUB_OFFLINE", None)
        run = lambda words, **options: subprocess.run([*MANAS, *words[1:]], env=env, timeout=300, **options)  # noqa: E731
        assert run(pull, capture_output=True).returncode == 0
        answer = run(chat, input=b"Hello!\n", capture_output=True)
        assert answer.returncode == 0 and answer.stdout.strip(), answer.stderr
        server = subprocess.Popen([*MANAS, *serve[1:], "--port", "0"], env=env, stderr=subprocess.PIPE, text=True)
        try:
            ready = server.stderr.readline()
            if ready.startswith("notice: --ctx"):  # the tiny model's window is 512: it says so, then serves
                ready = server.stderr.readline()
            assert READY.search(ready) and ready.rstrip().endswith("· chat"), ready  # its chat endpoint is on
        finally:
            server.terminate()
            assert server.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def gguf_repository(tmp_path_factory, repository):
    """A -GGUF repository as the Hub's quantizers publish one: the model in two quantizations, by file name."""
    pytest.importorskip("gguf")
    folder = tmp_path_factory.mktemp("gguf-repo")
    checkpoint = folder.parent / "tiny-chat.safetensors"
    manas("convert", repository, "--out", checkpoint).ok()
    for outtype, tag in (("q8_0", "Q8_0"), ("f16", "Q4_K_M")):  # the tag is the file's name, as published
        manas(
            "export", checkpoint, "--format", "gguf", "--outtype", outtype, "--out", folder / f"Tiny-Chat-{tag}.gguf"
        ).ok()
    (folder / "README.md").write_text("not downloaded")
    return folder


PULLED_GGUF = {"": ("tiny-chat-q4_k_m", "Tiny-Chat-Q4_K_M.gguf"), ":Q8_0": ("tiny-chat-q8_0", "Tiny-Chat-Q8_0.gguf")}


@pytest.mark.parametrize("suffix", PULLED_GGUF)
def test_pull_of_a_gguf_repository_fetches_the_tagged_file_alone_and_chats(tmp_path, gguf_repository, suffix):
    stored, fetched = PULLED_GGUF[suffix]
    repo = "TinyOrg/Tiny-Chat-GGUF"
    with local_hub(repo, gguf_repository) as hub:
        env = environment(tmp_path, hub)
        pulled = manas("pull", repo + suffix, **env).ok()
        files = [path.rsplit("/", 1)[-1] for path, _ in hub.requests if "/resolve/" in path]
    assert files == [fetched] and f"stored as {stored}" in pulled.err and f"manas chat -m {stored}" in pulled.err
    listed = {entry["name"]: entry for entry in json.loads(manas("list", "--json", **env).ok().out)}
    kept = Path(listed[stored]["path"])  # the file as published, not a conversion
    assert kept.suffix == ".gguf" and kept.read_bytes() == (gguf_repository / fetched).read_bytes()
    answer = manas("chat", "-m", stored, "-n", "4", "-t", "0", "--json", stdin=b"hello\n", **env).ok().json()
    assert answer["prompt_tokens"] > 5


def test_a_tag_no_file_has_is_one_error_line(tmp_path, gguf_repository):
    with local_hub("TinyOrg/Tiny-Chat-GGUF", gguf_repository) as hub:
        run = manas("pull", "TinyOrg/Tiny-Chat-GGUF:IQ2_XS", **environment(tmp_path, hub))
    assert run.returncode == 1 and "holds no GGUF file tagged IQ2_XS" in run.err
    assert len(run.err.strip().splitlines()) == 1


def test_several_files_for_a_tag_are_refused_by_name_before_any_download(tmp_path, gguf_repository):
    crowded = tmp_path / "crowded"
    crowded.mkdir()
    for name in ("Tiny-Chat-Q8_0.gguf", "Tiny-Chat-v2-Q8_0.gguf", "Tiny-Chat-Q4_K_M.gguf"):
        (crowded / name).symlink_to(gguf_repository / name.replace("-v2", ""))
    with local_hub("TinyOrg/Tiny-Chat-GGUF", crowded) as hub:
        run = manas("pull", "TinyOrg/Tiny-Chat-GGUF:Q8_0", **environment(tmp_path, hub))
        fetched = [path for path, _ in hub.requests if "/resolve/" in path]
    assert run.returncode == 1 and fetched == [], (run.err, fetched)
    assert "several GGUF files for Q8_0: Tiny-Chat-Q8_0.gguf, Tiny-Chat-v2-Q8_0.gguf" in run.err


def test_the_server_names_a_gguf_model_as_the_user_did(tmp_path, gguf_repository):
    from test_serve import running_server

    with running_server(gguf_repository / "Tiny-Chat-Q8_0.gguf") as live:
        listed = [model.id for model in live.client().models.list()]
    assert listed == ["Tiny-Chat-Q8_0"] and live.model == "Tiny-Chat-Q8_0"


def test_run_of_a_hub_repository_pulls_it_once_then_runs_it(tmp_path, gguf_repository):
    repo = "TinyOrg/Tiny-Chat-GGUF:Q8_0"
    with local_hub("TinyOrg/Tiny-Chat-GGUF", gguf_repository) as hub:
        env = environment(tmp_path, hub)
        first = manas("run", repo, "hello", "-n", "4", "-t", "0", **env).ok()
        fetched = [path for path, _ in hub.requests if "/resolve/" in path]
        hub.requests.clear()
        second = manas("run", repo, "hello", "-n", "4", "-t", "0", fresh=True, **env).ok()
        again = [path for path, _ in hub.requests if "/resolve/" in path]
    assert len(fetched) == 1 and again == [] and first.out == second.out and first.out.strip()
    assert f"pulling {repo}" in first.err and "stored as tiny-chat-q8_0" in first.err and "pulling" not in second.err
    unknown = manas("run", "no-such-model", "hello", **env)
    assert unknown.returncode == 1 and "manas pull" in unknown.err


def test_quantize_of_a_store_name_stores_its_copy_and_a_file_needs_out(tmp_path, repository):
    with local_hub(REPO, repository) as hub:
        env = environment(tmp_path, hub)
        manas("pull", REPO, **env).ok()
    quantized = manas("quantize", "tiny-chat-135m", "--bits", "4", **env).ok()
    listed = {entry["name"]: entry for entry in json.loads(manas("list", "--json", **env).ok().out)}
    assert listed["tiny-chat-135m-int4"]["weights"] == "int4" and listed["tiny-chat-135m-int4"]["path"] in quantized.err
    again = manas("quantize", "-m", "tiny-chat-135m", "--bits", "4", **env)
    assert again.returncode == 1 and "--force" in again.err  # never replaced without asking
    a_file = manas("quantize", listed["tiny-chat-135m"]["path"], **env)
    assert a_file.returncode == 2 and "--out" in a_file.err
