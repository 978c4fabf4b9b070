"""`manas run NAME [PROMPT]`, as ollama's: a chat model is chatted with (at the terminal, or one answer to PROMPT),
a base model continues PROMPT."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ...errors import InputError
from ...models import ModelOptions
from ...settings import GenerationSettings
from . import chat, generate
from .common import checkpoint_given


def run(*, model: Path | None, prompt: str | None, settings: GenerationSettings, model_options: ModelOptions) -> None:
    path = checkpoint_given(model, model_options.checkpoint)
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
    """Whether the checkpoint stores a chat template, from its header alone."""
    from ...formats.header import read_header

    with path.open("rb") as f:
        return bool(read_header(f, path).metadata.get("chat_template"))
