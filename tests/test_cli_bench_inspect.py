"""`manas bench` and `manas inspect-cache` through the real CLI: their JSON fields against what the checkpoint
implies, and the tables they print."""

from __future__ import annotations

import re
import shutil

import pytest

from cli_fixtures import BLOCK_SIZE, RUN_OPTIONS, checkpoints, learned, manas, rope  # noqa: F401 (fixtures)
from conftest import DEFAULT_ENGINE
from manas_cli.cli.commands.inspect_cache import DEFAULT_PROMPT as DEFAULT_INSPECT_PROMPT

FLOAT32_BYTES = 4
N_LAYER, N_HEAD, HEAD_SIZE = 2, 4, 8
N_KV_HEAD = {"rope-gqa": 2, "learned-mha": 4}
TINY_BENCH = ("--tokens", "20", "--prompt-tokens", "16", "--repeat", "1")  # 16 + 20 tokens pass the 32 window


def cache_bytes(name: str, positions: int, batch: int = 1) -> int:
    """K and V of every layer: (batch, n_kv_head, positions, head_size) float32 each."""
    return 2 * N_LAYER * batch * N_KV_HEAD[name] * positions * HEAD_SIZE * FLOAT32_BYTES


def bench(checkpoint, *args: str):
    return manas("bench", "-c", checkpoint.path, *RUN_OPTIONS, *args).ok()


# ---- bench ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, batch", [("rope-gqa", 1), ("learned-mha", 2)])
def test_bench_json_reports_the_model_and_each_test(checkpoints, name, batch):
    checkpoint = checkpoints[name]
    report = bench(checkpoint, *TINY_BENCH, "--batch", str(batch), "--json").json()
    parameters = checkpoint.loaded.model.num_parameters()
    assert report["model"] == {
        "path": str(checkpoint.path),
        "parameters": parameters,
        "size_bytes": parameters * FLOAT32_BYTES,
        "block_size": BLOCK_SIZE,
        "device": "cpu",
        "dtype": "float32",
        "threads": 1,
        "threads_rule": "--threads",
        "weights": "float32",
        "weights_bytes": parameters * FLOAT32_BYTES,
        "engine": DEFAULT_ENGINE,
    }
    tests = {test["name"]: test for test in report["tests"]}
    assert list(tests) == ["pp16", "tg20", "tg20 no-cache"]
    for test in tests.values():
        assert test["tokens_per_s_mean"] > 0
        assert test["tokens_per_s_std"] == 0.0  # one run
    assert report["speedup"] == pytest.approx(
        tests["tg20"]["tokens_per_s_mean"] / tests["tg20 no-cache"]["tokens_per_s_mean"]
    )
    assert report["ttft_s"] > 0
    assert report["re_prefills"] == 16 + 20 - 1 - BLOCK_SIZE  # every step once the window is full
    assert report["cache_bytes"] == cache_bytes(name, BLOCK_SIZE, batch)
    assert report["peak_memory_bytes"] > report["cache_bytes"]


def test_bench_shift_overflow_re_prefills_half_windows_instead_of_every_step(rope):
    report = bench(
        rope,
        "--tokens",
        "40",
        "--prompt-tokens",
        "16",
        "--repeat",
        "1",
        "--no-baseline",
        "--overflow",
        "shift",
        "--json",
    ).json()
    assert report["overflow"] == "shift"
    # 16 + 40 tokens: the window fills at 32, then every BLOCK_SIZE // 2 steps a re-prefill of half the window
    assert report["re_prefills"] == 2


def test_bench_repeats_give_a_mean_and_a_spread(rope):
    report = bench(rope, "--tokens", "8", "--prompt-tokens", "4", "--repeat", "3", "--no-baseline", "--json").json()
    for test in report["tests"]:
        assert len(test["runs"]) == 3
        assert test["tokens_per_s_mean"] == pytest.approx(sum(test["runs"]) / 3)
        assert test["tokens_per_s_std"] > 0
    assert report["re_prefills"] == 0  # 4 + 8 tokens stay inside the window


def test_bench_without_baseline_has_no_uncached_test_and_no_speedup(rope):
    report = bench(rope, *TINY_BENCH, "--no-baseline", "--json").json()
    assert [test["name"] for test in report["tests"]] == ["pp16", "tg20"]
    assert report["speedup"] is None


def test_bench_depth_fills_the_cache_first_and_names_its_tests_as_llama_bench_does(rope):
    report = bench(rope, "--depth", "12", "--prompt-tokens", "8", "--tokens", "6", "--repeat", "1", "--json").json()
    assert [test["name"] for test in report["tests"]] == ["pp8 @ d12", "tg6 @ d12"]  # no baseline by default
    assert report["depth"] == 12 and report["re_prefills"] == 0
    # The decode test is a run of its own, as llama-bench's: the depth, the prompt's first token, the decoded
    assert report["cache_bytes"] >= cache_bytes("rope-gqa", 12 + 1 + 5)
    with_baseline = bench(rope, "-d", "12", "--prompt-tokens", "8", "-n", "6", "-r", "1", "--baseline", "--json")
    assert [test["name"] for test in with_baseline.json()["tests"]][-1] == "tg6 @ d12 no-cache"
    # llama-bench's tg after -d decodes after the depth, not after the prefill test's prompt too: here the depth,
    # the prompt and the tokens overflow the window, the depth and the tokens do not
    fits = bench(rope, "-d", "12", "--prompt-tokens", "16", "-n", str(BLOCK_SIZE - 13), "-r", "1", "--json").json()
    assert [test["name"] for test in fits["tests"]] == ["pp16 @ d12", f"tg{BLOCK_SIZE - 13} @ d12"]
    assert fits["re_prefills"] == 0
    full = manas("bench", "-c", rope.path, *RUN_OPTIONS, "--depth", str(BLOCK_SIZE))
    assert full.returncode == 2 and f"--depth {BLOCK_SIZE} leaves no room" in full.err


def test_bench_prints_a_table_with_the_model_above_and_the_totals_below(rope, tmp_path):
    # A path longer than the 80 columns Rich assumes on a pipe: every line must still come out whole.
    long_path = tmp_path / ("a-folder-name-long-enough-to-pass-eighty-columns-" * 2) / "rope.safetensors"
    long_path.parent.mkdir()
    shutil.copy(rope.path, long_path)
    run = manas("bench", "-c", long_path, *RUN_OPTIONS, *TINY_BENCH).ok()
    header, model, *table, totals = run.out.splitlines()
    assert header == str(long_path)
    assert model.startswith(f"{rope.loaded.model.num_parameters():,} parameters · ")
    assert all(
        item in model for item in ("block_size 32", "cpu", "float32", "1 thread (--threads)", "batch 1", "1 run ")
    )
    rows = {line.split("  ")[0]: line for line in table if line.startswith(("pp16 ", "tg20 "))}
    assert set(rows) == {"pp16", "tg20", "tg20 no-cache"}
    assert all(re.search(r" [\d,.]+$", row) and "±" not in row for row in rows.values())  # one run: no spread
    for total in ("time to first token", "cache speed-up", "re-prefills 3", "peak memory", "cache 8.0 KiB"):
        assert total in totals
    # no progress bar on a pipe; only the notice that this run passes the window
    assert run.err.splitlines() == [
        "notice: 16 prompt tokens and 20 new ones pass the 32-token window: the decode "
        "figure includes its re-prefills (see --overflow)"
    ]


def test_bench_sweep_charts_decode_speed_through_an_overflow(rope):
    report = bench(rope, *TINY_BENCH, "--no-baseline", "--sweep", "--json").json()
    rows = report["sweep"]
    assert rows[-1]["end"] > BLOCK_SIZE  # through and past one overflow
    assert sum(row["re_prefills"] for row in rows) > 0
    assert all(row["tokens_per_s"] > 0 for row in rows)
    text = bench(rope, *TINY_BENCH, "--no-baseline", "--sweep").out
    assert "decode speed by context position" in text
    assert text.count("█") >= len(rows)  # a bar per row


# ---- inspect-cache ------------------------------------------------------------------------------------------------


def inspect(checkpoint, *args: str, stdin: bytes = b""):
    return manas("inspect-cache", "-c", checkpoint.path, *RUN_OPTIONS, *args, stdin=stdin).ok()


@pytest.mark.parametrize("name, tokens", [("rope-gqa", 0), ("learned-mha", 5), ("rope-gqa", 40)])
def test_inspect_cache_json_describes_the_cache_after_prompt_and_decoding(checkpoints, name, tokens):
    checkpoint = checkpoints[name]
    report = inspect(checkpoint, "-p", "ROMEO:", "--tokens", str(tokens), "--json").json()
    prompt_tokens = len(checkpoint.prompt_ids("ROMEO:"))
    positions = min(prompt_tokens + tokens, BLOCK_SIZE)
    n_kv_head = N_KV_HEAD[name]
    assert report["positions"] == positions
    assert report["block_size"] == BLOCK_SIZE
    assert report["dtype"] == "float32"
    assert isinstance(report["allocation"], str) and report["allocation"]
    assert report["layers"] == [
        {
            "layer": layer,
            "k_shape": [1, n_kv_head, positions, HEAD_SIZE],
            "v_shape": [1, n_kv_head, positions, HEAD_SIZE],
            "bytes": cache_bytes(name, positions) // N_LAYER,
            "window": None,  # no sliding window: every layer attends over all it holds
            "window_bytes": cache_bytes(name, positions) // N_LAYER,
        }
        for layer in range(N_LAYER)
    ]
    assert report["logical_bytes"] == cache_bytes(name, positions) == report["window_bytes"]
    assert report["storage_bytes"] >= report["logical_bytes"]
    assert report["bytes_per_position"] == cache_bytes(name, 1)
    assert report["full_window_bytes"] == cache_bytes(name, BLOCK_SIZE)
    assert report["mha_equivalent_bytes"] == report["logical_bytes"] * N_HEAD // n_kv_head
    re_prefills = report["re_prefill_positions"]
    if prompt_tokens + tokens <= BLOCK_SIZE:
        assert re_prefills == []
    else:  # one re-prefill per token decoded past the window, at positions after it
        assert len(re_prefills) == prompt_tokens + tokens - BLOCK_SIZE
        assert re_prefills == sorted(re_prefills) and re_prefills[0] > BLOCK_SIZE


@pytest.mark.parametrize("source", ["default prompt", "--prompt-file"])
def test_inspect_cache_takes_the_prompt_as_generate_does(rope, tmp_path, source):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?", encoding="utf-8")
    args, stdin, text = {
        "default prompt": ((), b"", DEFAULT_INSPECT_PROMPT),
        "--prompt-file": (("--prompt-file", str(prompt_file)), b"", prompt_file.read_text()),
    }[source]
    report = inspect(rope, *args, "--json", stdin=stdin).json()
    assert report["positions"] == len(rope.prompt_ids(text)) > 0


def test_inspect_cache_view_shows_fill_layers_totals_gqa_saving_and_re_prefills(rope):
    text = inspect(rope, "-p", "ROMEO:", "--tokens", "40").out
    assert text.splitlines()[0] == str(rope.path)
    assert f"positions {BLOCK_SIZE}/{BLOCK_SIZE}" in text and "100%" in text
    assert text.count(f"(1, 2, {BLOCK_SIZE}, {HEAD_SIZE})") == 2 * N_LAYER  # K and V of each layer
    assert "logical 8.0 KiB" in text and "allocated 8.0 KiB" in text
    assert "256 B per position" in text and f"8.0 KiB at a full window of {BLOCK_SIZE}" in text
    assert "multi-head cache would hold 16.0 KiB" in text and "saves 50%" in text
    assert "re-prefills at sequence positions" in text


def test_inspect_cache_view_of_a_multi_head_model_claims_no_saving(learned):
    text = inspect(learned, "-p", "ROMEO:", "--tokens", "5").out
    assert "(1, 4, " in text
    assert "multi-head cache would hold" not in text
    assert "re-prefills" not in text


def test_bench_prints_each_row_as_it_finishes_and_ctrl_c_keeps_them():
    """On a pipe: the model's lines and each test's row come as they are measured; a Ctrl-C in the (long) uncached
    baseline keeps the rows printed and exits 130."""
    import signal
    import subprocess

    from cli_fixtures import MANAS, cli_env
    from test_serve import SHIPPED

    process = subprocess.Popen(
        [*MANAS, "bench", "-c", str(SHIPPED), *RUN_OPTIONS, "--baseline", "-n", "200", "--prompt-tokens", "56"]
        + ["--repeat", "10"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
    )  # fmt: skip
    lines = []
    while (line := process.stdout.readline()) and not line.startswith("tg200 "):
        lines.append(line)
    process.send_signal(signal.SIGINT)  # the baseline's 11 runs (seconds each) have just begun
    rest, err = process.communicate(timeout=60)
    printed = "".join(lines) + line + rest
    assert process.returncode == 130 and err.strip().endswith("error: interrupted"), err
    assert str(SHIPPED) in lines[0] and "pp56 " in printed and "tg200 " in printed and "no-cache" not in printed


def test_an_uncached_baseline_over_its_budget_is_left_out_unless_asked_for(monkeypatch, rope):
    from manas_cli.engine import bench as engine_bench
    from manas_cli.models import ModelOptions, open_model

    engine = open_model(ModelOptions(checkpoint=rope.path, threads=1)).engine
    shown = []
    options = dict(repeat=1, batch=1, on_measurement=lambda m: shown.append(m.name))
    kept = engine_bench.run_bench(engine, 8, 6, baseline=None, **options)
    assert [m.name for m in kept.measurements] == shown == ["pp8", "tg6", "tg6 no-cache"]
    assert kept.baseline_estimate_s is None
    monkeypatch.setattr(engine_bench, "BASELINE_BUDGET_S", 0.0)  # every baseline over budget
    left_out = engine_bench.run_bench(engine, 8, 6, baseline=None, repeat=1)
    assert [m.name for m in left_out.measurements] == ["pp8", "tg6"] and left_out.baseline_estimate_s > 0
    # (1 + 1) runs of 6 steps, each prefilling 8, 9, ... 13 positions, at the measured prefill speed
    assert left_out.baseline_estimate_s == pytest.approx(2 * sum(range(8, 14)) / left_out.measurements[0].mean)
    asked = engine_bench.run_bench(engine, 8, 6, baseline=True, repeat=1)
    assert [m.name for m in asked.measurements][-1] == "tg6 no-cache"
