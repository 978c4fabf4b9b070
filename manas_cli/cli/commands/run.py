"""`manas run NAME [PROMPT]`, as ollama's: a chat model is chatted with (at the terminal, or one answer to PROMPT),
a base model continues PROMPT."""

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ...errors import InputError
from ...settings import GenerationSettings
from ..flags import takes_model_flags, takes_setting_flags
from . import chat, generate

if TYPE_CHECKING:
    from ...models import ModelOptions


def run(*, model: Path | None, prompt: str | None, settings: GenerationSettings, model_options: "ModelOptions") -> None:
    from .common import checkpoint_given

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


# ---- the command: its flags and help, and the call ------------------------------------------------------------


@takes_model_flags(cache=False)
@takes_setting_flags()
def command(
    model: Annotated[
        Optional[Path],
        typer.Argument(help="A store name (manas list) or a checkpoint file.", show_default=False),
    ] = None,
    prompt: Annotated[
        Optional[str], typer.Argument(help="One message (a chat model) or a text to continue.", show_default=False)
    ] = None,
    *,
    settings: GenerationSettings,
    model_options: "ModelOptions",
) -> None:
    """Run a model as ollama's `run` does: chat with a chat model, or continue a prompt with a base model.

    With no prompt a chat model starts a conversation (manas chat); with one it answers it and exits. A base model
    continues the prompt (manas generate). The flags are generate's.

    Examples:

      manas run smollm2-135m-instruct

      manas run smollm2-135m-instruct "Why is the sky blue?"

      manas run shakespeare "ROMEO:" -n 60
    """

    run(model=model, prompt=prompt, settings=settings, model_options=model_options)
