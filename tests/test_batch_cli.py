"""`manas batch`'s refusals, made before Ray starts (so they need no cluster, and no Ray at all): Ray missing, OUT
there without --force, a partial run's file without --resume, an input that is not there. One `error:` line each,
exit 1, nothing written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cli_fixtures import manas

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "shakespeare.safetensors"


@pytest.fixture
def source(tmp_path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "ROMEO:"}\n')
    return path


def refused(run, message: str) -> None:
    assert run.returncode == 1 and run.err.startswith("error: ") and message in run.err, run.err
    assert len(run.err.strip().splitlines()) == 1


def without_ray(folder: Path) -> str:
    """A PYTHONPATH under which `import ray` fails as it does where Ray is not installed."""
    (folder / "no-ray" / "ray").mkdir(parents=True)
    (folder / "no-ray" / "ray" / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    return str(folder / "no-ray")


def test_without_ray_installed_the_error_says_how_to_install_it(tmp_path, source):
    run = manas(
        "batch", "generate", source, "-o", tmp_path / "out.jsonl", "-c", SHIPPED, PYTHONPATH=without_ray(tmp_path)
    )
    refused(run, 'pip install "manas-cli[ray]"')
    assert not (tmp_path / "out.jsonl").exists()


def test_an_existing_out_is_replaced_only_with_force(tmp_path, source):
    (tmp_path / "out.jsonl").write_text("mine\n")
    refused(manas("batch", "score", source, "-o", tmp_path / "out.jsonl"), "pass --force to overwrite it")
    assert (tmp_path / "out.jsonl").read_text() == "mine\n"


def test_a_partial_run_is_kept_unless_resume_is_given(tmp_path, source):
    (tmp_path / "out.jsonl.partial").write_text('{"id": 1, "text": "x"}\n')
    refused(manas("batch", "generate", source, "-o", tmp_path / "out.jsonl"), "add --resume to go on from them")
    assert (tmp_path / "out.jsonl.partial").read_text() == '{"id": 1, "text": "x"}\n'


def name_the_job(out: Path, source: Path, **model_options) -> None:
    """OUT.partial.job as `manas batch score SOURCE -o OUT -c SHIPPED` writes it when it starts."""
    from manas_cli.cli.commands.batch import Job, job_identity, read_lines
    from manas_cli.models import ModelOptions

    identity = job_identity(
        read_lines(source), Job("score", {"stride": None}, 16), str(SHIPPED.resolve()), ModelOptions(**model_options)
    )
    out.with_name(out.name + ".partial.job").write_text(json.dumps(identity))


def score(source: Path, out: Path, *flags: str, **env: str):
    return manas("batch", "score", source, "-o", out, "-c", SHIPPED, "--resume", *flags, **env)


@pytest.mark.parametrize(
    ("partial", "message"),
    [
        (b'{"id": 1}\n{"id": 2}\n{"id": 3}\n', "holds 3 records and"),  # more records than the input has lines
        (b"not a record\n", "is not a file of records"),
        (b"[1, 2]\n", "is not a file of records"),
    ],
)
def test_resume_refuses_a_partial_file_that_is_not_records(tmp_path, source, partial, message):
    name_the_job(tmp_path / "out.jsonl", source)
    (tmp_path / "out.jsonl.partial").write_bytes(partial + b'{"id": 4, "te')  # and a last line cut short
    refused(score(source, tmp_path / "out.jsonl"), message)
    assert not (tmp_path / "out.jsonl").exists()
    assert (tmp_path / "out.jsonl.partial").read_bytes() == partial + b'{"id": 4, "te'  # refused, so left as it was


@pytest.mark.parametrize("change", ["input", "settings", "model", "no-job-file"])
def test_resume_refuses_another_jobs_records(tmp_path, source, change):
    """Records made of JSON objects are not enough: the partial file must be this job's (its input, settings and
    model), or it is refused and left as it was."""
    out = tmp_path / "out.jsonl"
    if change != "no-job-file":
        name_the_job(out, source, **({"quantize": "int8"} if change == "settings" else {}))
    (tmp_path / "out.jsonl.partial").write_text('{"id": 1, "text": "x"}\n')
    if change == "input":
        source.write_text('{"prompt": "JULIET:"}\n')
    args = ("-c", tmp_path / "other.safetensors") if change == "model" else ()
    if change == "model":
        (tmp_path / "other.safetensors").write_bytes(SHIPPED.read_bytes())
    run = manas("batch", "score", source, "-o", out, "--resume", *(args or ("-c", SHIPPED)))
    refused(run, "does not say which job wrote it" if change == "no-job-file" else "holds another job's records")
    assert (tmp_path / "out.jsonl.partial").read_text() == '{"id": 1, "text": "x"}\n' and not out.exists()


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_resume_never_follows_a_link_or_reads_a_special_file(tmp_path, source, kind):
    out, mine = tmp_path / "out.jsonl", tmp_path / "mine.txt"
    name_the_job(out, source)
    mine.write_text("the user's own file\n")
    if kind == "link":
        (tmp_path / "out.jsonl.partial").symlink_to(mine)
    else:
        os.mkfifo(tmp_path / "out.jsonl.partial")
    refused(score(source, out), "is a link" if kind == "link" else "is not a regular file")
    assert mine.read_text() == "the user's own file\n" and not out.exists()


def test_a_new_job_never_writes_through_a_dangling_link(tmp_path, source):
    target = tmp_path / "elsewhere.jsonl"
    (tmp_path / "out.jsonl.partial").symlink_to(target)
    run = manas("batch", "score", source, "-o", tmp_path / "out.jsonl", "-c", SHIPPED)
    refused(run, "add --resume")
    assert not target.exists()


def test_a_missing_input_and_a_missing_model_are_one_error_line(tmp_path, source):
    refused(manas("batch", "generate", tmp_path / "absent.jsonl", "-o", tmp_path / "o.jsonl"), "does not exist")
    missing_model = manas("batch", "score", source, "-o", tmp_path / "o.jsonl", "-m", "absent-model")
    refused(missing_model, "no model 'absent-model'")


def test_resume_of_a_run_cut_before_its_rename_only_publishes(tmp_path, source):
    """Every record written, the rename not yet done: --resume moves the file into place, without starting Ray."""
    record = '{"id": 1, "text": "x"}\n'
    name_the_job(tmp_path / "out.jsonl", source)
    (tmp_path / "out.jsonl.partial").write_text(record)
    score(source, tmp_path / "out.jsonl", PYTHONPATH=without_ray(tmp_path)).ok()
    assert (tmp_path / "out.jsonl").read_text() == record
    assert list(tmp_path.glob("out.jsonl.*")) == []


def test_a_job_that_fails_before_its_first_record_leaves_nothing_to_resume(tmp_path, source):
    refused(score(source, tmp_path / "out.jsonl", PYTHONPATH=without_ray(tmp_path)), "manas-cli[ray]")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.jsonl", "no-ray"]
