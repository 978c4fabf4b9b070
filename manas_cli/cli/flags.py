"""The flags several commands share, declared once: the model flags (which model, where, how), the generation
settings' flags, their checks, and the decorators that add a table of flags to a command and hand them to it as
one value (models.ModelOptions, settings.GenerationSettings). Each command's own flags are in its file
(cli/commands/NAME.py); app.py assembles the commands."""

import functools
import inspect
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..engine.threads import MAX_THREADS, THREADS_ENV
from ..settings import GenerationSettings


def choices(name: str, *values: str) -> type[Enum]:
    """A str Enum whose members are the flag's allowed values: typer shows them and refuses others."""
    return Enum(name, {value: value for value in values}, type=str)


Device = choices("Device", "auto", "cpu", "cuda")
DType = choices("DType", "auto", "float32", "bfloat16", "float16")
TrainTokenizer = choices("TrainTokenizer", "bpe", "gpt2")
PositionEncoding = choices("PositionEncoding", "learned", "rope")
Allocation = choices("Allocation", "dynamic", "static")
Overflow = choices("Overflow", "recompute", "shift")
ExportFormat = choices("ExportFormat", "hf", "gguf")
OutType = choices("OutType", "f32", "f16", "q8_0")
Quantization = choices("Quantization", "int8", "int4")
Engine = choices("Engine", "auto", "native", "torch")


def _threads_in_range(value: Optional[int]) -> Optional[int]:
    if value is not None and not 1 <= value <= MAX_THREADS:
        raise typer.BadParameter(f"{value} is not in the range 1 <= threads <= {MAX_THREADS}")
    return value


def checked_setting(name: str):
    """A flag callback that applies the setting's rule (settings.RULES), the same one --jsonl's lines obey."""

    def callback(value):
        from ..settings import check

        try:
            return check(name, value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None

    return callback


def _stops_not_empty(values: Optional[list[str]]) -> Optional[list[str]]:
    if values and "" in values:
        raise typer.BadParameter("an empty stop text would end every generation before it starts: give some text")
    return values


def checkpoint_option(what: str) -> type:
    """-c/-m (--checkpoint, --model), naming `what` it takes."""
    return Annotated[
        Optional[Path],
        typer.Option(
            "--checkpoint",
            "--model",
            "-c",
            "-m",
            help=f"{what} Default: $MANAS_CHECKPOINT, else the model shipped with manas.",
        ),
    ]


CheckpointOption = checkpoint_option(
    "Model file (.safetensors or .gguf), or a store name (manas list, manas pull); --model and -m as in llama.cpp, "
    "llm and ollama."
)
DeviceOption = Annotated[Device, typer.Option(help="auto: CUDA when available, else the CPU.")]
DTypeOption = Annotated[DType, typer.Option(help="auto: float32 on the CPU, bfloat16 on CUDA.")]
ThreadsOption = Annotated[
    Optional[int],
    typer.Option(
        callback=_threads_in_range,
        help=(
            f"CPU threads for torch, exactly, 1 to {MAX_THREADS}. Default: ${THREADS_ENV}, else the cores no other "
            f"process is using (re-checked during a generation)."
        ),
    ),
]
PromptOption = Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt text; '-' reads standard input.")]
PromptFileOption = Annotated[
    Optional[Path], typer.Option("--prompt-file", "-f", help="Read the prompt from a UTF-8 file.")
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of text.")]
QuantizeOption = Annotated[
    Optional[Quantization],
    typer.Option(
        "--quantize",
        help="Quantize the weight matrices when loading, products in bfloat16. int8: one "
        "scale per output row, a quarter of float32's bytes; int4: a scale and a zero per 32 values, faster "
        "still on the CPU (n_embd a multiple of 32). Files written by `manas quantize` need no flag.",
    ),
]
EngineOption = Annotated[
    Engine,
    typer.Option(
        "--engine",
        envvar="MANAS_ENGINE",
        show_envvar=True,
        help="What runs the model. native: manas's C core, float32/int8/int4 on the CPU, compiled by the "
        "system's C compiler on first use ($CC, else cc) and cached; cached decoding equals "
        "crop-and-recompute bit for bit. torch: PyTorch (CUDA, bfloat16, float16). auto: native where it "
        "can run and builds, else torch.",
    ),
]
FloatActivationsOption = Annotated[
    bool,
    typer.Option(
        "--float-activations",
        help="The native engine's int8 and int4 products in float32 over the weights' exact values, as the torch "
        "engine's reference computes them, instead of in integers over activations quantized per block of 32 "
        "(llama.cpp's q8_0 way; faster; docs/quantization.md has its measured cost).",
    ),
]
ContextOption = Annotated[
    Optional[int],
    typer.Option(
        "--ctx",
        "--ctx-size",
        envvar="MANAS_CTX",
        show_envvar=True,
        min=1,
        help="The window in tokens manas keeps, at most the model's own (Llama-family models declare 8,192 to "
        "32,768): past it, the cropped window is prefilled again, as for every model. Default: the model's.",
    ),
]
CacheOption = Annotated[
    Allocation,
    typer.Option(
        "--cache",
        help="KV cache allocation: 'dynamic' grows as positions are cached (doubled when full, "
        "at most half unused); 'static' preallocates the run's positions at once. Both write in place.",
    ),
]


# The model flags, declared once: name -> (its annotation, its default). takes_model_flags adds them to a command.
MODEL_FLAGS = {
    "cache": (CacheOption, Allocation.dynamic),
    "quantize": (QuantizeOption, None),
    "checkpoint": (CheckpointOption, None),
    "device": (DeviceOption, Device.auto),
    "dtype": (DTypeOption, DType.auto),
    "threads": (ThreadsOption, None),
    "engine": (EngineOption, Engine.auto),
    "float_activations": (FloatActivationsOption, False),
    "ctx": (ContextOption, None),
}


DEFAULT_BATCH_SIZE = 16  # see BatchSizeOption
BatchSizeOption = Annotated[
    Optional[int],
    typer.Option(
        min=1,
        max=256,
        show_default=False,
        help=(
            "With --jsonl, and in each of batch generate's actors: requests decoded together, each at its own "
            "position; a finished one's row goes to the next request. Default: 16, by measurement (on 2 cores, "
            "total decode tokens/s still grows from 8 to 16: GPT-2-124M shape 153 to 240, the shipped model 2,084 "
            "to 2,626), or as many rows of the model's window as the free memory holds, where fewer."
        ),
    ),
]
OverflowOption = Annotated[
    Overflow,
    typer.Option(
        help=(
            "When the context window is full: 'recompute' re-prefills the last block_size tokens at every step, "
            "exactly equal to crop-and-recompute sampling; 'shift' re-prefills the last half window, then decodes "
            "from the cache again: much faster past the window, but the text is no longer identical to the "
            "reference."
        )
    ),
]


# Speculative decoding's flags (generate, bench): engine/speculation.py
LookupOption = Annotated[
    Optional[int],
    typer.Option(
        "--lookup",
        min=1,
        metavar="N",
        show_default=False,
        help="Speculative decoding by prompt lookup: propose the tokens that followed the text's last N tokens "
        "where they occurred before, and keep those the model draws itself. The same text, token for token, "
        "faster where the text repeats the prompt (an edit, an extraction).",
    ),
]
DraftModelOption = Annotated[
    Optional[Path],
    typer.Option(
        "--draft-model",
        "-md",
        "--model-draft",
        metavar="NAME|PATH",
        show_default=False,
        help="Speculative decoding with a draft model: a small model with the same vocabulary (the model's own "
        "int4 copy, or a smaller model of its family) guesses ahead, and the model keeps the tokens it draws "
        "itself. The same text, token for token; faster where the draft guesses well.",
    ),
]
DraftMaxOption = Annotated[
    int,
    typer.Option(
        "--draft-max",
        "--spec-draft-n-max",
        min=1,
        max=64,
        help="The most tokens proposed to one check (--lookup, --draft-model). How many a check takes adapts to "
        "what checks have kept and cost, down to --draft-min.",
    ),  # speculation.DEFAULT_DRAFT_MAX
]
DraftMinOption = Annotated[
    int,
    typer.Option(
        "--draft-min",
        "--spec-draft-n-min",
        min=0,
        max=64,
        help="The fewest tokens proposed to one check: 0 lets decoding go plain where checks do not pay (they cost "
        "more on some machines and weight types than on others); as many as --draft-max proposes that many at "
        "every step.",
    ),
]


# The generation settings' flags, declared once (generate, batch generate): name -> (annotation, default).
MaxTokensOption = Annotated[
    int,
    typer.Option(
        "--max-tokens",
        "-n",
        callback=checked_setting("max_tokens"),
        help="New tokens to generate (per sample); -1: until the end of text or the window, as llama.cpp's -n -1.",
    ),
]
TemperatureOption = Annotated[
    float,
    typer.Option(
        "--temperature",
        "-t",
        "--temp",
        callback=checked_setting("temperature"),
        help="Sampling temperature; 0 (or one too small to divide by) is greedy (argmax).",
    ),
]
TopKOption = Annotated[Optional[int], typer.Option(min=1, help="Sample only from the k most likely tokens.")]
TopPOption = Annotated[
    Optional[float],
    typer.Option(
        callback=checked_setting("top_p"),
        help=(
            "Sample from the smallest set of tokens whose probability reaches p (0 < p <= 1); the most likely "
            "token is always kept."
        ),
    ),
]
SeedOption = Annotated[
    Optional[int],
    typer.Option(
        "--seed",
        "-s",
        callback=checked_setting("seed"),
        help="Seed the sampler (0 <= seed < 2^64): the same seed gives the same text, cached or not.",
    ),
]
StopOption = Annotated[
    Optional[list[str]],
    typer.Option(
        metavar="TEXT",
        callback=_stops_not_empty,
        help="End before the first occurrence of TEXT, which is not printed. Repeatable.",
    ),
]
MinPOption = Annotated[
    Optional[float],
    typer.Option(
        callback=checked_setting("min_p"),
        help=(
            "Drop tokens less likely than MIN_P times the most likely one (0 ≤ p ≤ 1), after temperature, top-k "
            "and top-p."
        ),
    ),
]
RepetitionPenaltyOption = Annotated[
    float,
    typer.Option(
        callback=checked_setting("repetition_penalty"),
        help=(
            "Divide the logits of tokens among the last --repeat-last-n (multiply negative ones), as llama.cpp "
            "and Hugging Face do; 1 is none, 1.1 a usual choice."
        ),
    ),
]
RepeatLastNOption = Annotated[
    int,
    typer.Option(
        callback=checked_setting("repeat_last_n"),
        help=(
            "Tokens of the context (prompt included) the repetition penalty looks back over; -1: the whole "
            "window, 0: none."
        ),
    ),
]
FrequencyPenaltyOption = Annotated[
    float,
    typer.Option(
        callback=checked_setting("frequency_penalty"),
        help=("Subtract this times each token's count in the generated text from its logit, as OpenAI does (-2 to 2)."),
    ),
]
PresencePenaltyOption = Annotated[
    float,
    typer.Option(
        callback=checked_setting("presence_penalty"),
        help="Subtract this from the logit of every token already generated, as OpenAI does (-2 to 2).",
    ),
]
LogprobsOption = Annotated[
    int,
    typer.Option(
        callback=checked_setting("logprobs"),
        help=(
            "With --json: each token's log-probability and the N most likely alternatives with theirs (0 to 20), "
            "from the distribution after the penalties, before temperature and filters."
        ),
    ),
]
ParseSpecialOption = Annotated[
    bool,
    typer.Option(
        "--special/--no-special",
        help=(
            "Special tokens written in the prompt (<|im_start|>, <|endoftext|>) are those tokens, as transformers "
            "and llama.cpp encode them; --no-special keeps them plain text, for text that must not control the model."
        ),
    ),
]
JsonSchemaOption = Annotated[
    Optional[str],
    typer.Option(
        "--json-schema",
        metavar="SCHEMA",
        help=(
            "Constrain the text to JSON valid under this JSON Schema (inline JSON; '{}' is any JSON value), token by "
            'token: it always parses. Needs llguidance (pip install "manas-cli[structured]"); docs/structured.md.'
        ),
    ),
]
JsonSchemaFileOption = Annotated[
    Optional[Path], typer.Option("--json-schema-file", metavar="FILE", help="--json-schema, read from a file.")
]
GrammarOption = Annotated[
    Optional[str],
    typer.Option(
        "--grammar",
        metavar="TEXT",
        help="Constrain the text to a grammar: llama.cpp's GBNF (root ::= ...) or Lark as llguidance reads it.",
    ),
]
GrammarFileOption = Annotated[
    Optional[Path],
    typer.Option(
        "--grammar-file", metavar="FILE", help="--grammar, read from a file (.gbnf: GBNF, .lark: Lark, else auto)."
    ),
]
GrammarSyntax = choices("GrammarSyntax", "auto", "gbnf", "lark")
GrammarSyntaxOption = Annotated[
    GrammarSyntax,
    typer.Option("--grammar-syntax", help="The grammar's syntax; auto: Lark where it reads as Lark, else GBNF."),
]
RegexOption = Annotated[
    Optional[str],
    typer.Option("--regex", metavar="PATTERN", help="Constrain the text to match a regular expression, whole."),
]
STRUCTURED_FLAGS = {
    "json_schema": (JsonSchemaOption, None),
    "json_schema_file": (JsonSchemaFileOption, None),
    "grammar": (GrammarOption, None),
    "grammar_file": (GrammarFileOption, None),
    "grammar_syntax": (GrammarSyntaxOption, GrammarSyntax.auto),
    "regex": (RegexOption, None),
}
SETTING_FLAGS = {
    "max_tokens": (MaxTokensOption, 200),
    "temperature": (TemperatureOption, GenerationSettings.temperature),
    "top_k": (TopKOption, None),
    "top_p": (TopPOption, None),
    "seed": (SeedOption, None),
    "stop": (StopOption, None),
    "min_p": (MinPOption, None),
    "repetition_penalty": (RepetitionPenaltyOption, 1.0),
    "repeat_last_n": (RepeatLastNOption, 64),
    "frequency_penalty": (FrequencyPenaltyOption, 0.0),
    "presence_penalty": (PresencePenaltyOption, 0.0),
    "logprobs": (LogprobsOption, 0),
    "parse_special": (ParseSpecialOption, True),
    **STRUCTURED_FLAGS,
}


def takes_flags(table: dict, build, name: str):
    """A command decorator: the flags in `table` (name -> (annotation, default)) added after the command's own, and
    given to it as one `name` argument, build(**their values)."""

    def decorate(command):
        own = [p for p in inspect.signature(command).parameters.values() if p.name != name]
        flags = [
            inspect.Parameter(flag, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)
            for flag, (annotation, default) in table.items()
        ]

        @functools.wraps(command)
        def with_flags(**values):
            built = build(**{flag: values.pop(flag) for flag in table})
            return command(**values, **{name: built})

        with_flags.__signature__ = inspect.Signature([*own, *flags])
        with_flags.__annotations__ = {p.name: p.annotation for p in (*own, *flags)}  # what typer reads
        return with_flags

    return decorate


def takes_model_flags(cache: bool = True):
    """The model flags (MODEL_FLAGS; without --cache where the command's caches are its own), given to the command
    as one `model_options: ModelOptions`."""
    table = {flag: value for flag, value in MODEL_FLAGS.items() if cache or flag != "cache"}
    return takes_flags(table, model_options_of, "model_options")


def takes_setting_flags():
    """The generation settings' flags (SETTING_FLAGS), given to the command as one `settings: GenerationSettings`."""
    return takes_flags(SETTING_FLAGS, settings_of, "settings")


def settings_of(*, stop: Optional[list[str]], **values) -> GenerationSettings:
    structured = {flag: values.pop(flag) for flag in STRUCTURED_FLAGS}
    return GenerationSettings(stop=tuple(stop or ()), format=format_of(**structured), **values)


def format_of(
    json_schema: Optional[str],
    json_schema_file: Optional[Path],
    grammar: Optional[str],
    grammar_file: Optional[Path],
    grammar_syntax: Enum,
    regex: Optional[str],
):
    """The structured output the flags ask for (structured.Format), or None; BadParameter for two, or for one
    that cannot be read."""
    from ..errors import InputError
    from ..structured import MAX_FORMAT_BYTES, Format, grammar_format, json_schema_format, syntax_of_file
    from .commands.common import read_text_file

    given = {
        "--json-schema": json_schema,
        "--json-schema-file": json_schema_file,
        "--grammar": grammar,
        "--grammar-file": grammar_file,
        "--regex": regex,
    }
    named = [flag for flag, value in given.items() if value is not None]
    if len(named) > 1:
        raise typer.BadParameter(f"give one constraint, not {' and '.join(named)}", param_hint=f"'{named[1]}'")
    if grammar_syntax.value != "auto" and grammar is None and grammar_file is None:
        raise typer.BadParameter("--grammar-syntax needs --grammar or --grammar-file", param_hint="'--grammar-syntax'")
    if not named:
        return None
    flag = named[0]
    try:
        if flag == "--regex":
            return Format("regex", regex)
        if flag == "--json-schema":
            return json_schema_format(json_schema, "the schema")
        if flag == "--grammar":
            return grammar_format(grammar, grammar_syntax.value, "the grammar")
        path = json_schema_file if flag == "--json-schema-file" else grammar_file
        what = "JSON Schema file" if flag == "--json-schema-file" else "grammar file"
        text = read_text_file(path, what, "a schema or grammar is at most 1 MiB", MAX_FORMAT_BYTES)
        if flag == "--json-schema-file":
            return json_schema_format(text, str(path))
        return grammar_format(text, syntax_of_file(path, grammar_syntax.value), str(path))
    except InputError as exc:
        raise typer.BadParameter(str(exc), param_hint=f"'{flag}'") from None


def model_options_of(
    checkpoint: Optional[Path],
    device: Enum,
    dtype: Enum,
    threads: Optional[int],
    quantize: Optional[Enum],
    engine: Enum,
    float_activations: bool,
    ctx: Optional[int] = None,
    cache: Enum = Allocation.dynamic,
):
    """The model flags as the library takes them (models.ModelOptions); --debug is the run's (process.main)."""
    from typer._click.globals import get_current_context

    from ..models import ModelOptions

    return ModelOptions(
        checkpoint=checkpoint,
        device=device.value,
        dtype=dtype.value,
        threads=threads,
        quantize=quantize.value if quantize else None,
        cache=cache.value,
        engine=engine.value,
        float_activations=float_activations,
        ctx=ctx,
        debug=bool(get_current_context().obj),
    )
