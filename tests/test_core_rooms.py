"""The native core in rooms: core.c holds the model and its forward pass and includes each file of core/ once, in
one translation unit (the same code as one file: tests/test_one_seed.py's bits are unchanged); each file is short
enough to read on its own; and the library's cache key covers every file, so an edit to any room builds afresh."""

from __future__ import annotations

import re
import shutil

from conftest import needs_compiler
from manas_cli.native import build

MAX_LINES = 600


def test_core_c_includes_every_room_once_and_nothing_else():
    included = re.findall(r'^#include "([^"]+)"', build.SOURCE.read_text(encoding="utf-8"), re.M)
    rooms = sorted(path.relative_to(build.SOURCE.parent).as_posix() for path in build.SOURCES[1:])
    assert sorted(included) == rooms and len(set(included)) == len(included)
    assert len(rooms) >= 6


def test_every_file_of_the_core_reads_on_its_own_in_under_600_lines():
    long = {
        path.name: n for path in build.SOURCES if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}


def test_a_room_is_never_compiled_alone_nor_exports_a_name_of_its_own():
    """Every function of a room is static or an exported manas_ entry point (C symbols stay static or prefixed)."""
    for path in build.SOURCES[1:]:
        text = path.read_text(encoding="utf-8")
        definitions = re.findall(r"^(?!static|EXPORT|typedef|#|\s|/|\*|}|enum|$)(.+\()", text, re.M)
        assert definitions == [], (path.name, definitions)
        exported = re.findall(r"^EXPORT [^(]*?(\w+)\(", text, re.M)
        assert all(name.startswith("manas_") for name in exported), (path.name, exported)


@needs_compiler  # the key names the compiler's file
def test_the_cache_key_changes_with_any_room(tmp_path, monkeypatch):
    cc = build.compiler()
    copy = tmp_path / "native"
    shutil.copytree(build.SOURCE.parent, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    sources = (copy / "core.c", *sorted((copy / "core").glob("*.c")))
    monkeypatch.setattr(build, "SOURCES", sources)
    before = build.library_name(cc)
    for source in sources:
        original = source.read_bytes()
        source.write_bytes(original + b"\n/* an edit */\n")
        assert build.library_name(cc) != before, source.name
        source.write_bytes(original)
    assert build.library_name(cc) == before
