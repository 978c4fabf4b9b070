"""`manas batch`'s refusals, made before Ray starts (so they need no cluster, and no Ray at all): Ray missing, OUT
there without --force, a partial run's file without --resume, an input that is not there. One `error:` line each,
exit 1, nothing written."""

from __future__ import annotations

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


@pytest.mark.parametrize(
    ("partial", "message"),
    [
        (b'{"id": 1}\n{"id": 2}\n{"id": 3}\n', "holds 3 records and"),  # more records than the input has lines
        (b"not a record\n", "is not a file of records"),
        (b"[1, 2]\n", "is not a file of records"),
    ],
)
def test_resume_refuses_a_partial_file_that_is_not_this_jobs(tmp_path, source, partial, message):
    (tmp_path / "out.jsonl.partial").write_bytes(partial + b'{"id": 4, "te')  # and a last line cut short
    refused(manas("batch", "generate", source, "-o", tmp_path / "out.jsonl", "--resume"), message)
    assert not (tmp_path / "out.jsonl").exists()
    assert (tmp_path / "out.jsonl.partial").read_bytes() == partial + b'{"id": 4, "te'  # refused, so left as it was


def test_a_missing_input_and_a_missing_model_are_one_error_line(tmp_path, source):
    refused(manas("batch", "generate", tmp_path / "absent.jsonl", "-o", tmp_path / "o.jsonl"), "does not exist")
    missing_model = manas("batch", "score", source, "-o", tmp_path / "o.jsonl", "-m", "absent-model")
    refused(missing_model, "no model 'absent-model'")


def test_resume_of_a_run_cut_before_its_rename_only_publishes(tmp_path, source):
    """Every record written, the rename not yet done: --resume moves the file into place, without starting Ray."""
    record = '{"id": 1, "text": "x"}\n'
    (tmp_path / "out.jsonl.partial").write_text(record)
    manas("batch", "generate", source, "-o", tmp_path / "out.jsonl", "--resume", PYTHONPATH=without_ray(tmp_path)).ok()
    assert (tmp_path / "out.jsonl").read_text() == record
    assert not (tmp_path / "out.jsonl.partial").exists()
