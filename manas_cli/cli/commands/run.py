"""`manas run NAME [PROMPT]`, as ollama's: a chat model is chatted with (at the terminal, or one answer to PROMPT),
a base model continues PROMPT."""

import re
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

    given = pulled(model)
    path = checkpoint_given(given, model_options.checkpoint)
    # the model as the user named it: what chat's history, the stats and the steps shown call it
    options = replace(model_options, checkpoint=given or model_options.checkpoint or path)
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


REPOSITORY = re.compile(r"[\w.-]+/[\w.-]+(:[\w.-]+)?(@[\w.-]+)?")  # OWNER/NAME[:TAG][@REVISION], as pull takes


def pulled(model: Path | None) -> Path | None:
    """A repository on the Hub (OWNER/NAME[-GGUF][:TAG]) as the store name it is pulled under, first pulling it
    where the store lacks it (as `ollama run` does); any other model as given."""
    from . import pull

    if model is None or model.exists() or not REPOSITORY.fullmatch(str(model)):
        return model
    return Path(pull.run(repo=str(model), name=None, quantize=None, force=False, reuse=True))


def has_chat_template(path: Path) -> bool:
    """Whether the checkpoint stores a chat template, from its header (a GGUF file's metadata) alone."""
    from ...formats.header import read_header

    if path.suffix == ".gguf":
        from ...formats.gguf_metadata import read_metadata

        template = read_metadata(path).get("tokenizer.chat_template")
        return isinstance(template, str) and bool(template.strip())
    with path.open("rb") as f:
        return bool(read_header(f, path).metadata.get("chat_template"))


# ---- the command: its flags and help, and the call ------------------------------------------------------------


@takes_model_flags(cache=False)
@takes_setting_flags()
def command(
    model: Annotated[
        Optional[Path],
        typer.Argument(
            help="A store name (manas list), a checkpoint file, or a Hub repository (OWNER/NAME[-GGUF][:TAG]), "
            "pulled first where the store lacks it.",
            show_default=False,
        ),
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

      manas run bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M "Hello"

      manas run shakespeare "ROMEO:" -n 60
    """

    run(model=model, prompt=prompt, settings=settings, model_options=model_options)
