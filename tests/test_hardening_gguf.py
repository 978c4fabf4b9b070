"""A GGUF file is untrusted input (issue 70's hostile pass, on today's reader): crafted files, each changed in one
place from a real export, get one `error:` line naming the file and what is wrong, before anything is sized or
read by the claim; and no run writes a copy of the weights anywhere."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from cli_fixtures import RUN_OPTIONS, checkpoints, manas  # noqa: F401 (checkpoints: a fixture)
from manas_cli.formats.gguf_metadata import read_layout

pytest.importorskip("gguf")

# the torch engine: a fresh cache folder would otherwise compile the native core first, for nothing here
FLAGS = (*RUN_OPTIONS, "--engine", "torch", "-p", "the", "-n", "4", "-t", "0")


@pytest.fixture(scope="module")
def exports(checkpoints, tmp_path_factory) -> dict[str, bytes]:
    """The rope model (llama.cpp's starcoder2 architecture) in float32 and in Q8_0, as bytes to change."""
    folder = tmp_path_factory.mktemp("gguf-exports")
    files = {}
    for outtype in ("f32", "q8_0"):
        out = folder / f"model-{outtype}.gguf"
        manas("export", checkpoints["rope-gqa"].path, "--format", "gguf", "--outtype", outtype, "--out", out).ok()
        files[outtype] = out.read_bytes()
    return files


def entry_offset_field(data: bytes, name: str) -> int:
    """Where the file stores tensor `name`'s offset (its entry: name, dimension count, dimensions, type, offset)."""
    dims = next(t.dims for t in layout_of(data).tensors if t.name == name)
    start = data.index(struct.pack("<Q", len(name)) + name.encode())
    return start + 8 + len(name) + 4 + 8 * len(dims) + 4


def layout_of(data: bytes):
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"layout-{os.getpid()}.gguf"
    path.write_bytes(data)
    try:
        return read_layout(path)
    finally:
        path.unlink()


def with_offset(data: bytes, name: str, offset: int) -> bytes:
    at = entry_offset_field(data, name)
    return data[:at] + struct.pack("<Q", offset) + data[at + 8 :]


def one_error(run, *fragments: str) -> str:
    lines = run.err.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), run.err
    assert "Traceback" not in run.err and "Warning" not in run.err, run.err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def generate(path: Path, tmp_path: Path, **env: str):
    return manas("generate", "-m", path, *FLAGS, XDG_CACHE_HOME=str(tmp_path / "cache"), fresh=True, **env)


def written(tmp_path: Path, data: bytes, name: str = "crafted.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_a_block_count_its_tensors_do_not_hold_is_refused_before_it_sizes_anything(exports, tmp_path):
    data = exports["f32"]
    key = f"{layout_of(data).fields['general.architecture']}.block_count".encode()
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4  # past the key and its value's type
    crafted = data[:at] + struct.pack("<I", 2**31) + data[at + 4 :]
    one_error(generate(written(tmp_path, crafted), tmp_path), "crafted.gguf", "block_count 2147483648")


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda data, t: 2**64 - 32, "past the end of the file"),  # wraps where an offset is added in 64 bits
        (lambda data, t: t[0].offset + 1, "not aligned"),
        (lambda data, t: t[0].offset, "overlap"),
    ],
    ids=["wrapping", "unaligned", "overlapping"],
)
def test_a_tensor_offset_out_of_the_data_misaligned_or_over_another_is_refused(exports, tmp_path, change, why):
    data = exports["f32"]
    tensors = sorted(layout_of(data).tensors, key=lambda t: t.offset)
    crafted = with_offset(data, tensors[1].name, change(data, tensors))
    one_error(generate(written(tmp_path, crafted), tmp_path), "crafted.gguf", why)


def test_metadata_that_is_not_utf8_is_one_error_line(exports, tmp_path):
    data = exports["f32"]
    key = f"{layout_of(data).fields['general.architecture']}.context_length".encode()
    at = data.index(key) + len(key) - 6  # the "l" of "length"
    crafted = data[:at] + b"\xff" + data[at + 1 :]
    one_error(generate(written(tmp_path, crafted), tmp_path), "is not UTF-8")


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_a_value_that_is_not_finite_names_the_gguf_and_the_tensor_and_no_warning_leaks(exports, tmp_path, outtype):
    data = exports[outtype]
    layout = layout_of(data)
    tensor = next(t for t in layout.tensors if t.name == "blk.0.ffn_down.weight")
    at = layout.data_start + tensor.offset  # f32: the first value; q8_0: the first block's scale (float16)
    nan = struct.pack("<f", float("nan")) if outtype == "f32" else struct.pack("<H", 0x7E00)
    crafted = data[:at] + nan + data[at + len(nan) :]
    line = one_error(generate(written(tmp_path, crafted), tmp_path), "crafted.gguf", "blk.0.ffn_down.weight")
    assert "not finite" in line and "cache" not in line  # the GGUF named, never the conversion's destination


def test_a_run_writes_no_copy_of_the_weights_whatever_the_cache_folder_holds(exports, tmp_path):
    long_name = written(tmp_path, exports["f32"], "m" * 240 + ".gguf")
    generate(long_name, tmp_path).ok()
    assert not (tmp_path / "cache" / "manas" / "gguf").exists()  # read in memory, never converted to a file
    blocked = tmp_path / "blocked"
    (blocked / "manas").mkdir(parents=True)
    (blocked / "manas" / "gguf").write_text("a file where an old version's cache of conversions went")
    manas("generate", "-m", long_name, *FLAGS, XDG_CACHE_HOME=str(blocked), fresh=True).ok()


@pytest.mark.parametrize(
    "template, why",
    [("{% for %}", "cannot be used"), ("{{ messages }}" + " " * (2 << 20), "characters")],
    ids=["unparsable", "two-megabytes"],
)
def test_a_chat_template_a_folder_would_refuse_is_refused_from_a_gguf_too(checkpoints, tmp_path, template, why):
    pytest.importorskip("jinja2")
    from manas_cli.formats.checkpoint import load_checkpoint, save_checkpoint

    loaded = load_checkpoint(checkpoints["rope-gqa"].path)
    templated = tmp_path / "templated.safetensors"
    save_checkpoint(templated, loaded.model, loaded.tokenizer_spec, {"chat_template": template})
    gguf_file = tmp_path / "templated.gguf"
    manas("export", templated, "--format", "gguf", "--out", gguf_file).ok()
    run = manas("convert", gguf_file, "--out", tmp_path / "out.safetensors")
    one_error(run, "templated.gguf", "chat template", why)
    assert not (tmp_path / "out.safetensors").exists()


def test_a_truncated_file_says_what_it_is_once(exports, tmp_path):
    line = one_error(generate(written(tmp_path, exports["f32"][:200]), tmp_path), "crafted.gguf")
    assert line.count("is not a GGUF file manas can read") == 1 and "ends inside its metadata" in line
