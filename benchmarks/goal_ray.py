"""Issue 38's goals: `manas batch generate` on Ray beside one `manas generate --jsonl` process, the shipped model,
1,000 prompts of 64 new tokens each (seeded, so that every record can be compared).

  local: `manas batch generate --actors 2` (1 thread each) on a local Ray instance the job starts (Ray's start-up
         and shutdown included), and on a local cluster already running, against `manas generate --jsonl
         --threads 2`, whole processes taking turns. Goal: within 1.25× its wall time.
  nodes: the same job on one loopback node and on two (ray.cluster_utils.Cluster, one CPU and one actor per node,
         the cluster started before the clock): the records identical, each node's records/s.

    python benchmarks/goal_ray.py --runs 2
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from harness import MANAS, ROOT, realtime, run_goals

SHIPPED = ROOT / "checkpoints" / "shakespeare.safetensors"
PROMPTS = 1000
NEW_TOKENS = 64
OPENINGS = ["ROMEO:", "JULIET:\n", "KING RICHARD III:\nNow is the", "First Citizen:\n", "O, ", "MENENIUS:\n"]
TIMINGS = ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s")


def prompts_file(folder: Path) -> Path:
    path = folder / "prompts.jsonl"
    lines = [json.dumps({"prompt": OPENINGS[i % len(OPENINGS)], "seed": i}) for i in range(PROMPTS)]
    path.write_text("\n".join(lines) + "\n")
    return path


def results(text: str) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in text.splitlines()]


def timed_run(command: list[str], env: dict | None = None) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    done = subprocess.run(realtime(command), capture_output=True, text=True, env=env, check=True)
    return time.perf_counter() - started, done


def jsonl(source: Path) -> tuple[float, list[dict]]:
    command = [*MANAS, "generate", "--jsonl", "--prompt-file", str(source), "-c", str(SHIPPED)]
    seconds, done = timed_run(command + ["-n", str(NEW_TOKENS), "--threads", "2"])
    return seconds, results(done.stdout)


def batch(source: Path, out: Path, actors: int, address: str | None = None) -> tuple[float, list[dict]]:
    out.unlink(missing_ok=True)
    command = [*MANAS, "batch", "generate", str(source), "-o", str(out), "-c", str(SHIPPED), "-n", str(NEW_TOKENS)]
    command += ["--actors", str(actors), "--threads", "1"] + (["--ray", address] if address else [])
    seconds, _ = timed_run(command)
    return seconds, results(out.read_text())


def loopback_cluster(nodes: int, cpus: int = 1):
    """A running Ray cluster of `nodes` loopback nodes (ray.cluster_utils.Cluster), `cpus` CPUs each."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only; read as Ray loads
    from ray.cluster_utils import Cluster

    head = {"num_cpus": cpus, "node_ip_address": "127.0.0.1", "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=cpus, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    return cluster


def goal_local(args) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        source = prompts_file(Path(folder))
        cluster = loopback_cluster(1, cpus=2)
        times = {"jsonl": [], "ray_started_by_the_job": [], "ray_running": []}
        try:
            for _ in range(args.runs):
                seconds, expected = jsonl(source)
                times["jsonl"].append(seconds)
                seconds, records = batch(source, Path(folder) / "out.jsonl", 2)
                times["ray_started_by_the_job"].append(seconds)
                assert records == expected, "a Ray record differs from --jsonl's"
                seconds, records = batch(source, Path(folder) / "out.jsonl", 2, cluster.address)
                times["ray_running"].append(seconds)
                assert records == expected, "a Ray record differs from --jsonl's"
        finally:
            cluster.shutdown()
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "prompts": PROMPTS,
        "new_tokens": NEW_TOKENS,
        **{f"{name}_s": [round(value, 2) for value in values] for name, values in times.items()},
        "ratio_started_by_the_job": round(medians["ray_started_by_the_job"] / medians["jsonl"], 3),
        "ratio_running": round(medians["ray_running"] / medians["jsonl"], 3),
        "goal": "ratio <= 1.25",
        "records_equal": True,
    }


def goal_nodes(args) -> dict:
    report = {}
    with tempfile.TemporaryDirectory() as folder:
        source = prompts_file(Path(folder))
        outputs = {}
        for nodes in (1, 2):
            cluster = loopback_cluster(nodes)
            try:
                seconds, outputs[nodes] = batch(source, Path(folder) / "out.jsonl", nodes, cluster.address)
            finally:
                cluster.shutdown()
            report[f"{nodes}_nodes"] = {
                "wall_s": round(seconds, 2),
                "records_per_s": round(PROMPTS / seconds, 1),
                "records_per_s_per_node": round(PROMPTS / seconds / nodes, 1),
            }
    report["records_identical"] = outputs[1] == outputs[2]
    return report


GOALS = {"local": goal_local, "nodes": goal_nodes}

if __name__ == "__main__":
    run_goals(GOALS, __doc__)
