"""The model store: checkpoints by name under $MANAS_HOME (default: the user's data folder, ~/.local/share/manas),
filled by `manas pull` from the Hugging Face Hub, listed by `manas list`, removed by `manas rm`. A name is what
-c/-m take in place of a path; the shipped model is in the store as `shakespeare`. Reading the list reads headers
only (no torch)."""

from __future__ import annotations

import math
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError, MissingDependencyError, first_line

HOME_ENV = "MANAS_HOME"
SUFFIX = ".safetensors"
GGUF_SUFFIX = ".gguf"  # a pulled GGUF file is stored as it is published: its blocks run in place
SHIPPED = "shakespeare.safetensors"  # the model that comes with manas; its name (`shakespeare`) is reserved
NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}")  # a store name: one path component, lower case
# What convert reads from a Hub repository: nothing else is downloaded (no pickles, no other formats).
PULLED_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer.model",  # SentencePiece's (Llama 2, Mistral), read where tokenizer.json is its byte-fallback rendering
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
]


def home() -> Path:
    """$MANAS_HOME, else $XDG_DATA_HOME/manas, else ~/.local/share/manas."""
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV])
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "manas"


def models_folder() -> Path:
    return home() / "models"


def is_name(text: str) -> bool:
    return bool(NAME.fullmatch(text)) and not text.endswith((SUFFIX, GGUF_SUFFIX))


def shipped_candidates() -> list[Path]:
    """Where the shipped model is: beside the package in a source checkout (editable install), or in the wheel's
    data."""
    return [
        Path(__file__).resolve().parents[1] / "checkpoints" / SHIPPED,
        Path(sys.prefix) / "share" / "manas" / "checkpoints" / SHIPPED,
    ]


def shipped() -> dict[str, Path]:
    """The models that come with manas, by name."""
    found = [path for path in shipped_candidates() if path.is_file()]
    return {found[0].stem: found[0]} if found else {}


def reserved(name: str) -> bool:
    """Whether name is the shipped model's: a pull may not take it, and -m NAME always means the shipped file."""
    return name == Path(SHIPPED).stem


def find(name: str) -> Path | None:
    """The checkpoint a store name stands for, or None. The shipped model's name is its, whatever the store holds."""
    if not is_name(name):
        return None
    if reserved(name):
        return shipped().get(name)
    found = [path for path in (stored_path(name), stored_path(name, GGUF_SUFFIX)) if path.is_file()]
    return found[0] if found else None


def stored() -> dict[str, Path]:
    """The models `manas pull` stored (not the shipped ones), by name."""
    found = {}
    if models_folder().is_dir():
        for path in sorted([*models_folder().glob(f"*{SUFFIX}"), *models_folder().glob(f"*{GGUF_SUFFIX}")]):
            if is_name(path.stem) and path.is_file():
                found.setdefault(path.stem, path)
    return found


@dataclass
class Entry:
    """A model as `manas list` shows it."""

    name: str
    path: Path
    architecture: str
    parameters: int
    weights: str
    size_bytes: int
    window: int
    chat_template: bool
    shipped: bool


def describe(name: str, path: Path, is_shipped: bool) -> Entry:
    """A stored checkpoint's entry, from its header alone."""
    from .engine.config import parameter_shapes
    from .formats.header import read_header

    if path.suffix == GGUF_SUFFIX:
        return _describe_gguf(name, path)
    with path.open("rb") as f:
        header = read_header(f, path)
    config = header.config
    architecture = (
        "llama-family"
        if not config.is_gpt2_family
        else "gpt2"
        if config.position_encoding == "learned"
        else "gpt (rope)"
    )
    return Entry(
        name,
        path,
        architecture,
        sum(math.prod(shape) for _, shape in parameter_shapes(config)),
        header.quantization or "float",
        path.stat().st_size,
        config.block_size,
        bool(header.metadata.get("chat_template")),
        is_shipped,
    )


def _describe_gguf(name: str, path: Path) -> Entry:
    """A stored GGUF file's entry, from its metadata and tensor entries alone."""
    from .formats.gguf_metadata import read_layout
    from .formats.gguf_weights import type_name

    layout = read_layout(path)
    architecture = str(layout.fields.get("general.architecture", "?"))
    kinds = sorted({type_name(tensor.kind) for tensor in layout.tensors if len(tensor.dims) == 2})
    template = layout.fields.get("tokenizer.chat_template")
    return Entry(
        name,
        path,
        f"gguf {architecture}",
        sum(math.prod(tensor.dims) for tensor in layout.tensors),
        "GGUF " + ", ".join(kinds),
        path.stat().st_size,
        int(layout.fields.get(f"{architecture}.context_length", 0) or 0),
        isinstance(template, str) and bool(template.strip()),
        False,
    )


def entries() -> list[Entry]:
    """Every model in the store, the shipped ones first (known by their path, not their name); one whose file
    cannot be read is skipped (`manas rm` removes it by name)."""
    from .errors import ManasError

    listed = []
    for models, is_shipped in ((shipped(), True), (stored(), False)):
        for name, path in models.items():
            try:
                listed.append(describe(name, path, is_shipped))
            except (ManasError, OSError):
                continue
    return listed


def remove(name: str) -> Path:
    """Delete a stored model by name; the shipped model and unknown names are refused."""
    kept = [stored_path(name, suffix) for suffix in (SUFFIX, GGUF_SUFFIX)] if is_name(name) else []
    path = next((path for path in kept if path.is_file()), None)
    if path is None or not path.is_file():
        if name in shipped():
            raise InputError(f"{name} is the model shipped with manas: it cannot be removed")
        raise InputError(f"no model named {name!r} in the store ({models_folder()}): `manas list` shows the names")
    path.unlink()
    return path


def default_name(repo: str, tag: str | None = None) -> str:
    """A repository's store name: its last part, lower case (HuggingFaceTB/SmolLM2-135M-Instruct →
    smollm2-135m-instruct); a GGUF repository's without -gguf, with its file's tag (smollm2-135m-instruct-q4_k_m)."""
    name = repo.rsplit("/", 1)[-1].lower()
    if tag is not None:
        name = f"{name.removesuffix('-gguf')}-{tag.lower()}"
    return re.sub(r"[^a-z0-9._-]", "-", name).strip("-.") or "model"


@dataclass(frozen=True)
class Repository:
    """What `manas pull` takes: OWNER/NAME, a GGUF file's quantization tag (:Q4_K_M, as llama.cpp's -hf and
    ollama's hf.co/ take it), a revision (@main)."""

    name: str
    tag: str | None = None
    revision: str | None = None

    @property
    def is_gguf(self) -> bool:
        """A tag names a GGUF file; a repository named *-GGUF holds them (bartowski's, the Hub's own quantizations)."""
        return self.tag is not None or self.name.lower().endswith("-gguf")


def parse_repo(text: str) -> Repository:
    """OWNER/NAME[:TAG][@REVISION]."""
    rest, _, revision = text.partition("@")
    name, _, tag = rest.partition(":")
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) or ".." in name or (tag and not re.fullmatch(r"[\w.-]+", tag)):
        raise InputError(
            f"{text!r} is not a Hugging Face repository: give OWNER/NAME, optionally :QUANT (a GGUF file) and @REVISION"
        )
    return Repository(name, tag or None, revision or None)


# Without a tag, the GGUF file pulled: the quantization most people run, else the near-lossless one, else the first.
GGUF_PREFERENCE = ("Q4_K_M", "Q8_0")


def gguf_file(repository: Repository, progress: bool) -> tuple[Path, str]:
    """The repository's GGUF file that the tag names (or the preferred one), found in the Hub's listing first and
    downloaded alone, and its tag; several files for one tag are refused by name before anything is fetched."""
    names = sorted(name for name in listed(repository) if name.lower().endswith(".gguf"))
    for tag in (repository.tag,) if repository.tag else (*GGUF_PREFERENCE, None):
        matched = [name for name in names if name.lower().endswith(f"{tag.lower()}.gguf")] if tag else names[:1]
        if len(matched) > 1:
            shown = ", ".join(matched)
            raise InputError(f"{repository.name} has several GGUF files for {tag}: {shown} (split files are not read)")
        if matched:
            folder = download(repository.name, repository.revision, progress, matched)
            return folder / matched[0], tag or Path(matched[0]).stem.rsplit("-", 1)[-1]
    wanted = f" tagged {repository.tag}" if repository.tag else ""
    raise InputError(f"{repository.name} holds no GGUF file{wanted}: `manas pull {repository.name}:TAG` names one")


def listed(repository: Repository) -> list[str]:
    """The repository's file names, as the Hub lists them."""
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(repository.name, revision=repository.revision)
    except Exception as exc:
        raise InputError(f"cannot list the files of {repository.name}: {first_line(exc)}") from None
    return [sibling.rfilename for sibling in info.siblings or []]


def download(repo: str, revision: str | None, progress: bool, patterns: list[str] = PULLED_FILES) -> Path:
    """The repository's files that convert reads, into the Hugging Face cache ($HF_HOME; $HF_ENDPOINT, $HF_TOKEN
    and offline mode honoured). A connection that drops is resumed by huggingface_hub within the pull; a pull that
    fails leaves no partial file (the library downloads to a temporary file it removes), and files already
    complete are not downloaded again."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
        from huggingface_hub.utils import disable_progress_bars, enable_progress_bars, logging
    except ImportError:
        raise MissingDependencyError(
            'manas pull needs huggingface_hub: pip install "manas-cli[pull]" (from a clone: pip install -e ".[pull]")'
        ) from None
    (enable_progress_bars if progress else disable_progress_bars)()
    logging.set_verbosity_error()  # its retry warnings are not the user's to read: a failure is one error line
    try:
        with warnings.catch_warnings():  # its two-line disk-space warning: the failure, if any, is one error line
            warnings.simplefilter("ignore")
            return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except RepositoryNotFoundError:
        raise InputError(f"no repository {repo} on the Hub (or it is private: set $HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        raise InputError(f"{repo} is not in the Hugging Face cache, and the Hub cannot be reached (offline?)") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise InputError(f"cannot download {repo}: {first_line(exc)}") from None
    except Exception as exc:  # httpx's protocol and network errors, after the library's own retries
        raise InputError(f"cannot download {repo} ({type(exc).__name__}: {first_line(exc)}): pull again") from None


def stored_path(name: str, suffix: str = SUFFIX) -> Path:
    """Where the store keeps NAME: a manas checkpoint, or (suffix .gguf) a GGUF file as published."""
    if not is_name(name):
        raise InputError(
            f"{name!r} is not a store name: lower-case letters, digits, '.', '_' and '-', up to 100 characters"
        )
    return models_folder() / f"{name}{suffix}"
