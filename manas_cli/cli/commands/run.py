"""`manas run NAME [PROMPT]`, as ollama's: a chat model is chatted with (at the terminal, or one answer to PROMPT),
a base model continues PROMPT."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ...errors import InputError
from ...models import ModelOptions, checkpoint_file, resolve_checkpoint
from ...settings import GenerationSettings
from . import chat, generate


def run(*, model: Path | None, prompt: str | None, settings: GenerationSettings, model_options: ModelOptions) -> None:
    if model is not None and model_options.checkpoint is not None:
        import typer

        raise typer.BadParameter("give the model once: as the argument or as -m, not both", param_hint="'-m'")
    path = checkpoint_file(resolve_checkpoint(model if model is not None else model_options.checkpoint))
    options = replace(model_options, checkpoint=path)
    if has_chat_template(path):
        chat.run(
            system=None,
            chat_template=None,
            settings=settings,
            stats=None,
            json_output=False,
            model_options=options,
            given=None if prompt is None else [prompt],
        )
    elif prompt is None:
        raise InputError(
            f"{path.stem} is a base model (it has no chat template): give it a text to continue, "
            f"manas run {model or path} 'ROMEO:'"
        )
    else:
        generate.run(
            prompt=prompt,
            prompt_file=None,
            settings=settings,
            num_samples=1,
            echo=False,
            overflow="recompute",
            stats=None,
            quiet=False,
            json_output=False,
            model_options=options,
        )


def has_chat_template(path: Path) -> bool:
    """Whether the checkpoint stores a chat template, from its header alone (a missing file: generate says so)."""
    from ...formats.header import read_header

    if not path.is_file():
        return False
    with path.open("rb") as f:
        return bool(read_header(f, path).metadata.get("chat_template"))
