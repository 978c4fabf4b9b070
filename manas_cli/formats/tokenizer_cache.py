"""A GGUF file's tokenizer, validated once and kept: checking that a vocabulary's merges are a BPE's (every merge
replayed by rank) takes a second for SmolLM2's 49,152 tokens and more for Qwen's 151,936, at every start. The
validated spec is kept in the user's cache ($XDG_CACHE_HOME/manas/tokenizers, a folder the user alone can write,
checked as the native core's is), named by the SHA-256 of the file's metadata bytes it came from: a file whose
metadata differs in one byte has another name, and every file with that metadata shares it. An entry is read only
where it is a regular file of the user's own that no one else can write; one that is not, or does not parse, is
made again over it. Nothing else is kept: about 1% of a model's file or less, never its weights."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from ..errors import ManasError

FOLDER = "tokenizers"
VERSION = 1  # of the entries' form: another version's are never read


def cached_spec(metadata: bytes | memoryview, make: Callable[[], dict]) -> dict:
    """The tokenizer spec of a file whose metadata bytes are `metadata`: from the cache where a trusted entry is
    there, else make() (which validates it) and kept. A cache that cannot be written only costs the time."""
    from ..native.build import cache_folder, folder_problem, open_trusted, read_all

    folder = cache_folder() / FOLDER
    entry = folder / f"{hashlib.sha256(metadata).hexdigest()[:40]}.json"
    if (fd := open_trusted(entry)) is not None:
        try:
            stored = json.loads(read_all(fd))
            if isinstance(stored, dict) and stored.get("version") == VERSION and isinstance(stored.get("spec"), dict):
                return stored["spec"]
        except (OSError, ValueError):
            pass  # made again below
        finally:
            os.close(fd)
    spec = make()
    if folder_problem(folder) is None:
        _keep(entry, {"version": VERSION, "spec": spec})
    return spec


def _keep(entry: Path, stored: dict) -> None:
    """Written whole, then renamed over any earlier one: a run racing this one reads either."""
    from ..files import atomic_write

    try:
        atomic_write(entry, lambda tmp: Path(tmp).write_text(json.dumps(stored), encoding="utf-8"), overwrite=True)
    except (OSError, ManasError):
        pass  # a full disk or a read-only cache: the next run validates again
