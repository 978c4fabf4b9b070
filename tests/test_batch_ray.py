"""`manas batch` and the Ray Data classes on a real Ray cluster: a head and a second node on 127.0.0.1, started by
Ray's own multi-node-on-one-machine utility (ray.cluster_utils.Cluster; `ray start` cannot keep a second node on
loopback: see docs/scale.md), every socket it listens on checked to be a loopback one. Each record must equal what
`manas generate --jsonl` or `manas score --json` writes for the line alone, in input order, through a worker killed
mid-run and a driver killed and resumed."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cli_fixtures import MANAS, cli, cli_env, manas

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' (CI installs it)")

pytestmark = pytest.mark.xdist_group("ray")  # one cluster for the module, on one test worker

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "shakespeare.safetensors"
TIMINGS = ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s")  # a run's speed, not its result
LONG = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak.\n" * 14  # past 256 tokens


def mixed_lines() -> list[bytes]:
    """200 requests: greedy, seeded, stop strings, past the shipped model's 256-token window, constrained by a JSON
    Schema or a regular expression, and bad lines."""
    prompts = ["ROMEO:", "JULIET:\n", "KING RICHARD III:\nNow is the", "", "O, ", "First Citizen:\n"]
    lines = []
    for index in range(200):
        request = {"prompt": prompts[index % len(prompts)], "max_tokens": 4 + index % 13}
        if index % 3 == 0:
            request["temperature"] = 0
        else:
            request.update(seed=index, top_k=1 + index % 40, top_p=0.9)
        if index % 7 == 0:
            request["stop"] = ["\n", "e"]
        if index % 5 == 1:
            request["id"] = f"request-{index}"
        if index % 50 == 10:
            request.update(prompt=LONG, max_tokens=20)
        if index % 23 == 4:  # structured outputs: a line's own constraint (issue 59)
            request["json_schema"] = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}}
        if index % 29 == 5:
            request["regex"] = "(yes|no)!"
        lines.append(json.dumps(request).encode())
    lines[17], lines[33], lines[99] = b"not json", b'{"prompt": 5}', b'{"prompt": "x", "temperature": -1}'
    lines[140], lines[141] = b"\xff\xfe not UTF-8", b"[]"
    return lines


def comparable(record: dict, line: bytes) -> dict:
    """A record without its timings; an unseeded line's seed is drawn at random (its greedy text is not)."""
    drawn = b'"seed"' not in line
    return {key: value for key, value in record.items() if key not in TIMINGS and not (drawn and key == "seed")}


def listening_sockets() -> set[tuple[str, str]]:
    """(local address in /proc's hex, port) of every TCP socket listening on this machine."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A":  # LISTEN
                    found.add(tuple(fields[1].split(":")))
    return found


def is_loopback(hex_address: str) -> bool:
    if len(hex_address) == 8:  # IPv4, little-endian: 127.x.x.x ends in 7F
        return hex_address.endswith("7F")
    return hex_address == "0" * 31 + "1" or (
        hex_address[:24] == "0000000000000000FFFF0000" and hex_address[-2:] == "7F"
    )


@pytest.fixture(scope="module")
def cluster():
    """A head and a second node, one CPU each, both on 127.0.0.1: (its address, the sockets it listens on)."""
    from ray.cluster_utils import Cluster

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read by Ray's modules as they load: loopback only
    before = listening_sockets()
    head = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False}
    nodes = Cluster(initialize_head=True, head_node_args=head)
    nodes.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    nodes.wait_for_nodes()
    try:
        assert len(nodes.list_all_nodes()) == 2
        yield nodes.address, listening_sockets() - before
    finally:
        nodes.shutdown()


def batch(*args, **env) -> subprocess.CompletedProcess:
    return cli("batch", *args, env=cli_env(**env))


@pytest.fixture(scope="module")
def requests(tmp_path_factory) -> tuple[Path, list[bytes], list[dict]]:
    """The input file, its non-blank lines, and `manas generate --jsonl`'s records for them (the reference)."""
    lines = mixed_lines()
    source = tmp_path_factory.mktemp("batch") / "in.jsonl"
    source.write_bytes(b"\n".join(lines[:50] + [b"", b"   "] + lines[50:]) + b"\n")  # blank lines are skipped
    reference = manas("generate", "--jsonl", "--prompt-file", source, "-c", SHIPPED, "--threads", "1")
    assert reference.returncode == 1  # the bad lines
    return source, lines, reference.json_lines()


def assert_same_records(out: Path, lines: list[bytes], reference: list[dict]) -> None:
    records = [json.loads(text) for text in out.read_text(encoding="utf-8").splitlines()]
    assert len(records) == len(reference) == len(lines)
    for record, expected, line in zip(records, reference, lines):
        assert comparable(record, line) == comparable(expected, line)
    assert sum("error" in record for record in records) == 5


def test_the_cluster_is_two_nodes_listening_on_loopback_only(cluster):
    address, sockets = cluster
    assert sockets, "the cluster listens somewhere"
    assert all(is_loopback(host) for host, _ in sockets), sockets
    assert address.startswith("127.0.0.1:")


def test_batch_generate_on_two_nodes_equals_jsonl_line_by_line(cluster, requests, tmp_path):
    source, lines, reference = requests
    out = tmp_path / "out.jsonl"
    run = batch("generate", source, "--out", out, "--ray", cluster[0], "--actors", 2, "--task-lines", 25, "-c", SHIPPED)
    assert run.returncode == 1, run.stderr.decode()  # as --jsonl: some lines failed
    assert b"error: 5 of 200 lines failed" in run.stderr
    assert run.stderr.decode().splitlines() == [
        "200 records in " + str(out),
        "error: 5 of 200 lines failed (their records have an 'error' field)",
    ]  # Ray's own log lines (core_worker.cc … E) are kept out of stderr
    assert_same_records(out, lines, reference)
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_batch_score_equals_score_json_text_by_text(cluster, tmp_path):
    texts = [LONG[index * 17 : index * 17 + 20 + index * 29] for index in range(48)] + ["a", "ROMEO: O"]
    source = tmp_path / "texts.jsonl"
    source.write_text("".join(json.dumps({"text": text, "id": index}) + "\n" for index, text in enumerate(texts)))
    out = tmp_path / "scores.jsonl"
    run = batch("score", source, "-o", out, "--ray", cluster[0], "--actors", 2, "--task-lines", 8, "-c", SHIPPED)
    records = [json.loads(line) for line in out.read_text().splitlines()]

    def alone(text: str) -> dict | str:
        """score --json's record, or the error line it prints instead."""
        done = manas("score", "--json", "-c", SHIPPED.resolve(), "--threads", "1", stdin=text.encode())
        return done.json() if done.returncode == 0 else done.err.strip().removeprefix("error: ")

    expected = [alone(text) for text in texts]  # each run forked from the zygote: a tenth of a second
    assert run.returncode == 1 and len(records) == 50
    assert isinstance(expected[48], str)  # one token: `manas score` refuses it; batch score writes its error record
    for index, (record, score) in enumerate(zip(records, expected)):
        assert record == (
            {"id": index, "line": index + 1, "error": score} if isinstance(score, str) else {"id": index, **score}
        )


def ray_workers() -> list[int]:
    """The processes of this machine's Ray actors that run the Generator."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"MapBatches(Generator)" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def wait_for_records(partial: Path, count: int, process: subprocess.Popen) -> None:
    while process.poll() is None:
        if partial.exists() and partial.read_bytes().count(b"\n") >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"the job ended before writing {count} records: {process.stderr.read().decode()}")


def start_batch(cluster, source: Path, out: Path, *args) -> subprocess.Popen:
    command = [*MANAS, "batch", "generate", source, "-o", out, "--ray", cluster[0], "-c", SHIPPED, *args]
    return subprocess.Popen(list(map(str, command)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env())


def test_a_worker_killed_mid_run_is_restarted_and_its_task_retried(cluster, requests, tmp_path):
    """A worker SIGKILLed mid-run: Ray restarts it and retries its task; every record is written once, in order.
    (Records are written in input order, so those behind the retried task can all land at once: the job may end
    any moment after the kill, which is why the driver's kill is a test of its own.)"""
    source, lines, reference = requests
    out = tmp_path / "out.jsonl"
    job = start_batch(cluster, source, out, "--actors", 2, "--task-lines", 10)
    wait_for_records(out.with_name("out.jsonl.partial"), 10, job)
    workers = ray_workers()
    assert workers
    os.kill(workers[0], signal.SIGKILL)
    _, stderr = job.communicate(timeout=600)
    assert job.returncode == 1 and b"error: 5 of 200 lines failed" in stderr, stderr.decode()
    assert_same_records(out, lines, reference)


def test_a_driver_killed_mid_run_is_refused_without_resume_and_resumes_with_each_record_written_once(
    cluster, requests, tmp_path
):
    """The driver SIGKILLed mid-run, its last record cut short: the same command is refused without --resume, then
    resumed."""
    source, lines, reference = requests
    out, partial = tmp_path / "out.jsonl", tmp_path / "out.jsonl.partial"
    job = start_batch(cluster, source, out, "--actors", 2, "--task-lines", 10)
    wait_for_records(partial, 10, job)
    job.send_signal(signal.SIGKILL)
    job.wait()
    assert not out.exists() and partial.exists()
    written = partial.read_bytes().count(b"\n")
    with partial.open("ab") as f:
        f.write(b'{"id": 61, "text": "cut sh')  # as a kill in the middle of a write would leave it
    again = batch("generate", source, "-o", out, "--ray", cluster[0], "-c", SHIPPED)
    assert again.returncode == 1 and b"--resume" in again.stderr  # a partial run is never overwritten unasked
    assert partial.exists()
    resumed = batch("generate", source, "-o", out, "--ray", cluster[0], "-c", SHIPPED, "--resume")
    assert resumed.returncode == 1, resumed.stderr.decode()
    assert f"{written} of them from the interrupted run".encode() in resumed.stderr, resumed.stderr.decode()
    assert_same_records(out, lines, reference)
    assert not partial.exists()


def test_the_readme_example_runs_as_written_against_the_cluster(cluster, tmp_path):
    """README's "Past one machine" lines, with $RAY_ADDRESS naming the cluster (so no instance of its own)."""
    if shutil.which("jq") is None:
        pytest.skip("the README's example uses jq, which is not installed")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Past one machine", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    (tmp_path / "examples").symlink_to(Path(__file__).resolve().parents[1] / "examples")
    env = cli_env(PATH=f"{Path(MANAS[0]).parent}{os.pathsep}{os.environ['PATH']}", RAY_ADDRESS=cluster[0])
    done = subprocess.run(["bash", "-e", "-c", block], cwd=tmp_path, capture_output=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    plays = [json.loads(line) for line in (tmp_path / "examples" / "plays.jsonl").read_text().splitlines()]
    assert [record["id"] for record in records] == [play["name"] for play in plays]
    assert not any("error" in record for record in records)


def test_the_ray_data_example_in_docs_runs_as_written_and_gives_jsonl_records(cluster, tmp_path):
    """docs/scale.md's pipeline, run as a user's script against the cluster ($RAY_ADDRESS): its records are
    --jsonl's for the same two requests."""
    docs = (Path(__file__).resolve().parents[1] / "docs" / "scale.md").read_text()
    section = docs.split("## In a Ray pipeline", 1)[1]
    (script,) = re.findall(r"```python\n(.*?)```", section, re.S)[:1]
    (tmp_path / "example.py").write_text(script)
    run = subprocess.run(
        [MANAS[0], "example.py"],
        cwd=tmp_path,
        capture_output=True,
        env=cli_env(RAY_ADDRESS=cluster[0], RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr.decode()
    lines = b'{"prompt": "ROMEO:", "seed": 1}\n{"prompt": "JULIET:", "temperature": 0}\n'
    expected = manas("generate", "--jsonl", "-n", "32", "--threads", "1", stdin=lines).ok().json_lines()
    records = [json.loads(line) for line in run.stdout.decode().splitlines()]
    assert [comparable(record, line) for record, line in zip(records, lines.splitlines())] == [
        comparable({**record, "id": None}, line) for record, line in zip(expected, lines.splitlines())
    ]


def test_a_local_ray_that_cannot_start_is_one_error_line_saying_what_to_try(tmp_path):
    """A real start-up failure: Ray's socket paths under a $RAY_TMPDIR too long for AF_UNIX."""
    deep = tmp_path / ("x" * 100) / ("y" * 100)
    deep.mkdir(parents=True)
    (tmp_path / "in.jsonl").write_text('{"prompt": "ROMEO:"}\n')
    run = batch("generate", tmp_path / "in.jsonl", "-o", tmp_path / "out.jsonl", "-c", SHIPPED, RAY_TMPDIR=str(deep))
    err = run.stderr.decode()
    assert run.returncode == 1 and err.startswith("error: cannot start a local Ray instance: ") and "--debug" in err
    assert len(err.strip().splitlines()) == 1 and "unexpected" not in err
