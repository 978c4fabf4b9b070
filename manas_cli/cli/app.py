"""The manas command line. Flags and help live here; each command imports the engine only when it runs,
so `manas --help` answers without loading torch."""

import functools
import inspect
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ..engine.threads import MAX_THREADS, THREADS_ENV
from ..settings import GenerationSettings

if TYPE_CHECKING:
    from ..models import ModelOptions  # the commands' model_options; imported when a command runs

app = typer.Typer(
    name="manas",
    help="Fast text generation from small GPT checkpoints, with a KV cache you can inspect.\n\n"
    "Examples:\n\n"
    "  manas generate --prompt 'ROMEO:'\n\n"
    "  echo 'To be' | manas generate -n 50 --json\n\n"
    "  manas bench\n\n"
    "  manas inspect-cache --tokens 32",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


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


def _bits(value: int) -> int:
    if value not in (8, 4):
        raise typer.BadParameter(f"{value} is not a supported width: use 8 (int8) or 4 (int4)")
    return value


def _checked(name: str):
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


BatchSizeOption = Annotated[
    int,
    typer.Option(
        min=1,
        max=256,
        help=(
            "With --jsonl, and in each of batch generate's actors: requests decoded together, each at its own "
            "position; a finished one's row goes to the next request. 16 by measurement: on 2 cores, total decode "
            "tokens/s still grows from 8 to 16 (GPT-2-124M shape 153 to 240, the shipped model 2,084 to 2,626)."
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


# The generation settings' flags, declared once (generate, batch generate): name -> (annotation, default).
MaxTokensOption = Annotated[
    int,
    typer.Option(
        "--max-tokens",
        "-n",
        callback=_checked("max_tokens"),
        help="New tokens to generate (per sample); -1: until the end of text or the window, as llama.cpp's -n -1.",
    ),
]
TemperatureOption = Annotated[
    float,
    typer.Option(
        "--temperature",
        "-t",
        "--temp",
        callback=_checked("temperature"),
        help="Sampling temperature; 0 (or one too small to divide by) is greedy (argmax).",
    ),
]
TopKOption = Annotated[Optional[int], typer.Option(min=1, help="Sample only from the k most likely tokens.")]
TopPOption = Annotated[
    Optional[float],
    typer.Option(
        callback=_checked("top_p"),
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
        callback=_checked("seed"),
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
        callback=_checked("min_p"),
        help=(
            "Drop tokens less likely than MIN_P times the most likely one (0 ≤ p ≤ 1), after temperature, top-k "
            "and top-p."
        ),
    ),
]
RepetitionPenaltyOption = Annotated[
    float,
    typer.Option(
        callback=_checked("repetition_penalty"),
        help=(
            "Divide the logits of tokens among the last --repeat-last-n (multiply negative ones), as llama.cpp "
            "and Hugging Face do; 1 is none, 1.1 a usual choice."
        ),
    ),
]
RepeatLastNOption = Annotated[
    int,
    typer.Option(
        callback=_checked("repeat_last_n"),
        help=(
            "Tokens of the context (prompt included) the repetition penalty looks back over; -1: the whole "
            "window, 0: none."
        ),
    ),
]
FrequencyPenaltyOption = Annotated[
    float,
    typer.Option(
        callback=_checked("frequency_penalty"),
        help=("Subtract this times each token's count in the generated text from its logit, as OpenAI does (-2 to 2)."),
    ),
]
PresencePenaltyOption = Annotated[
    float,
    typer.Option(
        callback=_checked("presence_penalty"),
        help="Subtract this from the logit of every token already generated, as OpenAI does (-2 to 2).",
    ),
]
LogprobsOption = Annotated[
    int,
    typer.Option(
        callback=_checked("logprobs"),
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
    return GenerationSettings(stop=tuple(stop or ()), **values)


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


def _show_version(value: bool) -> None:
    """--version: the installed package's metadata, read without importing the engine (or torch)."""
    if value:
        from importlib.metadata import version

        print(f"manas {version('manas-cli')}")
        raise typer.Exit()


@app.callback()
def root(
    debug: Annotated[bool, typer.Option("--debug", help="Show the Python traceback of a failure.")] = False,
    version: Annotated[
        bool, typer.Option("--version", "-V", callback=_show_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Fast text generation from small GPT checkpoints, with a KV cache you can inspect."""
    # --debug is read once, by process.main, wherever it stands; it is declared here to be shown and accepted.


@app.command()
@takes_model_flags()
@takes_setting_flags()
def generate(
    prompt_argument: Annotated[
        Optional[str],
        typer.Argument(
            metavar="[PROMPT]", help="The prompt, as -p gives it (quote it: one argument).", show_default=False
        ),
    ] = None,
    prompt: PromptOption = None,
    prompt_file: PromptFileOption = None,
    jsonl: Annotated[
        bool,
        typer.Option(
            "--jsonl",
            help=(
                "Read one JSON object per line from stdin (or --prompt-file): 'prompt', optionally 'id' and any "
                "setting by its name (max_tokens, temperature, top_k, top_p, min_p, repetition_penalty, "
                "repeat_last_n, frequency_penalty, presence_penalty, seed, stop, logprobs); write one --json record "
                "per line, in input order."
            ),
        ),
    ] = False,
    batch_size: BatchSizeOption = 16,
    num_samples: Annotated[
        int, typer.Option(min=1, help="Samples of the same prompt, decoded together as one batch.")
    ] = 1,
    echo: Annotated[bool, typer.Option(help="Print the prompt before the continuation.")] = False,
    overflow: OverflowOption = Overflow.recompute,
    stats: Annotated[
        Optional[bool],
        typer.Option(
            "--stats/--no-stats",
            help="Speed and cache stats on stderr (default: when stderr is a terminal).",
            show_default=False,
        ),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but the text.")] = False,
    json_output: JsonOption = False,
    *,
    settings: GenerationSettings,
    model_options: "ModelOptions",
) -> None:
    """Generate text from a prompt, streaming it to stdout as it is produced.

    The prompt comes from --prompt, --prompt-file, or standard input. Stats and notices go to stderr, so stdout
    holds only the text (or JSON lines with --json).

    Examples:

      manas generate --prompt 'ROMEO:' -n 100

      echo 'JULIET:' | manas generate -t 0 --stop 'ROMEO:'

      manas generate -p 'KING:' --num-samples 3 --seed 7 --json | jq .text
    """
    from .commands import generate as command

    if quiet and stats:
        raise typer.BadParameter(
            "--quiet prints nothing but the text, and --stats asks for stats: choose one", param_hint="'--stats'"
        )
    if prompt_argument is not None:
        if prompt is not None:
            raise typer.BadParameter("give the prompt once: as an argument or with -p, not both", param_hint="'PROMPT'")
        prompt = prompt_argument
    if jsonl:
        from .commands import jsonl as pipeline

        if prompt is not None or echo or num_samples != 1:
            raise typer.BadParameter(
                "--jsonl reads its prompts as JSON lines (stdin or --prompt-file): it takes no "
                "--prompt, --echo or --num-samples",
                param_hint="'--jsonl'",
            )
        pipeline.run(
            prompt_file=prompt_file,
            defaults=settings,
            batch_size=batch_size,
            overflow=overflow.value,
            stats=stats,
            quiet=quiet,
            model_options=model_options,
        )
        return
    if settings.logprobs and not json_output:
        raise typer.BadParameter(
            "log-probabilities are written in the --json record: add --json", param_hint="'--logprobs'"
        )
    command.run(
        prompt=prompt,
        prompt_file=prompt_file,
        settings=settings,
        num_samples=num_samples,
        echo=echo,
        overflow=overflow.value,
        stats=stats,
        quiet=quiet,
        json_output=json_output,
        model_options=model_options,
    )


@app.command()
@takes_model_flags()
def bench(
    tokens: Annotated[
        Optional[int],
        typer.Option(
            "--tokens",
            "-n",
            min=1,
            help=(
                "New tokens to decode per run (tgN). Default: what fits in the window after the prompt, at most 256, "
                "so the figure is the cached path's (a longer run re-prefills past the window: see --overflow, "
                "--sweep)."
            ),
            show_default=False,
        ),
    ] = None,
    prompt_tokens: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            help=(
                "Prompt length for the prefill test (ppP), at most block_size. Default: 128, or half the window if "
                "that is less."
            ),
            show_default=False,
        ),
    ] = None,
    repeat: Annotated[
        int, typer.Option("--repeat", "-r", min=1, help="Timed runs of each test, after one warm-up.")
    ] = 3,
    batch: Annotated[int, typer.Option(min=1, help="Rows decoded together.")] = 1,
    baseline: Annotated[
        bool, typer.Option("--baseline/--no-baseline", help="Also time uncached crop-and-recompute decoding.")
    ] = True,
    overflow: Annotated[
        Overflow,
        typer.Option(
            help=(
                "Past the window (prompt + tokens > block_size): 'recompute' re-prefills at every step, exactly as "
                "crop-and-recompute; 'shift' re-prefills half the window, then decodes from the cache."
            )
        ),
    ] = Overflow.recompute,
    sweep: Annotated[
        bool, typer.Option("--sweep", help="Also chart decode speed against context position, through one overflow.")
    ] = False,
    json_output: JsonOption = False,
    *,
    model_options: "ModelOptions",
) -> None:
    """Measure prefill and decode speed, and the KV cache's speed-up over crop-and-recompute.

    Prints a table in the manner of llama-bench (tokens/s as mean ± std over --repeat runs).

    Examples:

      manas bench

      manas bench --tokens 512 --overflow shift --no-baseline --sweep

      manas bench --json | jq '.tests[] | {name, tokens_per_s_mean}'
    """
    from .commands import bench as command

    command.run(
        tokens=tokens,
        prompt_tokens=prompt_tokens,
        repeat=repeat,
        batch=batch,
        baseline=baseline,
        overflow=overflow.value,
        sweep=sweep,
        json_output=json_output,
        model_options=model_options,
    )


@app.command("inspect-cache")
@takes_model_flags()
def inspect_cache(
    prompt: PromptOption = None,
    prompt_file: PromptFileOption = None,
    tokens: Annotated[int, typer.Option("--tokens", "-n", min=0, help="Greedy tokens to decode after the prompt.")] = 0,
    json_output: JsonOption = False,
    *,
    model_options: "ModelOptions",
) -> None:
    """Prefill a prompt (and decode --tokens more), then show what the KV cache holds.

    Positions, per-layer K/V shapes, logical and allocated bytes, the size at a full window, and what grouped-query
    attention saves against a plain multi-head cache. Without a prompt, a short default one is used.

    Examples:

      manas inspect-cache

      manas inspect-cache -p 'ROMEO:' --tokens 300

      manas inspect-cache --json | jq .layers
    """
    from .commands import inspect_cache as command

    command.run(
        prompt=prompt, prompt_file=prompt_file, tokens=tokens, json_output=json_output, model_options=model_options
    )


@app.command()
@takes_model_flags(cache=False)
def score(
    text_file: Annotated[
        Optional[Path], typer.Argument(help="UTF-8 text to score; '-' or none reads standard input.")
    ] = None,
    stride: Annotated[
        Optional[int],
        typer.Option(
            help=(
                "Tokens each window advances by (default: half the window); every token is scored once, after up to "
                "block_size - stride tokens of context."
            )
        ),
    ] = None,
    json_output: JsonOption = False,
    *,
    model_options: "ModelOptions",
) -> None:
    """Score a text with a model: its loss in nats per token and per character, and its perplexity.

    A window of block_size tokens slides over the text by --stride, as Hugging Face's perplexity guide does: every
    token is scored once (llama.cpp's llama-perplexity scores other tokens, so its figures differ). Compare a
    converted, quantized or retrained checkpoint on the same text.

    Examples:

      manas score held-out.txt

      manas score held-out.txt --quantize int8 --json | jq .nats_per_char

      cat notes.txt | manas score -c gpt2.safetensors --stride 512
    """
    from .commands import score as command

    command.run(text_file=text_file, stride=stride, json_output=json_output, model_options=model_options)


@app.command()
@takes_model_flags(cache=False)
def serve(
    host: Annotated[
        str,
        typer.Option(
            help=(
                "Address to listen on. Another than loopback without --api-key prints a warning: anyone who reaches "
                "the port can use the model."
            )
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="Port to listen on; 0 takes a free one (the ready line says which).")
    ] = 8080,
    batch_size: Annotated[
        int,
        typer.Option(
            min=1, max=256, help="Requests (choices) decoded together, each at its own position, as --jsonl's."
        ),
    ] = 16,
    max_queue: Annotated[
        int, typer.Option(min=1, help="Choices that may wait for a row; beyond, a request gets 429 with Retry-After.")
    ] = 64,
    api_key: Annotated[
        Optional[str],
        typer.Option(
            envvar="MANAS_API_KEY",
            show_envvar=True,
            help="Require 'Authorization: Bearer KEY' on every request but /health.",
        ),
    ] = None,
    timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            help=(
                "Seconds a client may send or read nothing before it is dropped (a slow or stalled client holds no "
                "row); a request's headers and body must arrive whole within it too."
            ),
        ),
    ] = 10.0,
    max_connections: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            max=65536,
            help=(
                "Connections held at once, each with a thread; beyond, a new one gets 503 at once. Default: 32 per "
                "core, 64 to 512."
            ),
        ),
    ] = None,
    max_tokens: Annotated[
        Optional[int],
        typer.Option(
            min=1,
            help=(
                "The most tokens a choice may ask for (max_tokens); above it, 400 naming this limit. Default: 4 "
                "windows of the model, at least 1,024."
            ),
        ),
    ] = None,
    chat_template: Annotated[
        Optional[Path],
        typer.Option(
            help="A Jinja chat template for a model without one (a converted instruct model carries its own): "
            "POST /v1/chat/completions renders the messages through it."
        ),
    ] = None,
    prefix_cache_mb: Annotated[
        float,
        typer.Option(
            min=0,
            help="Memory for the exact prefix cache (native engine): a prompt that starts as a recent one did (a "
            "shared system prompt, a chat's earlier turns) copies that start's K/V and prefills only the rest, its "
            "answer unchanged bit for bit; least recently used out first. 0 turns it off.",
        ),
    ] = 256,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="One access line per request on stderr.")] = False,
    *,
    model_options: "ModelOptions",
) -> None:
    """Serve OpenAI's completions and chat API on a local port: any client that speaks it can use the model.

    POST /v1/completions (stream, n, stop, seed, logprobs, echo, the penalties, and manas's top_k, min_p,
    repetition_penalty, repeat_last_n); POST /v1/chat/completions for a model with a chat template (messages,
    stream, n, stop, seed, logprobs and top_logprobs); GET /v1/models and /v1/models/{id}; GET /health. Every
    request joins one continuous batch, and its answer equals `manas generate --json` for that request alone. A base
    model has no chat template: /v1/chat/completions answers 404 unless --chat-template gives one. Ctrl-C or
    SIGTERM: stop accepting, let what runs finish (10 s), exit 0.

    Examples:

      manas serve --port 8080

      curl -s localhost:8080/v1/completions -H 'Content-Type: application/json' -d '{"prompt": "ROMEO:", "max_tokens": 40}'
    """  # noqa: E501 (an example a user copies whole)
    from .commands import serve as command

    command.run(
        host=host,
        port=port,
        batch_size=batch_size,
        max_queued=max_queue,
        api_key=api_key,
        timeout_s=timeout,
        verbose=verbose,
        max_connections=max_connections,
        max_tokens=max_tokens,
        chat_template=chat_template,
        prefix_cache_mb=prefix_cache_mb,
        model_options=model_options,
    )


@app.command("run")
@takes_model_flags(cache=False)
@takes_setting_flags()
def run_command(
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
    from .commands import run as command

    command.run(model=model, prompt=prompt, settings=settings, model_options=model_options)


@app.command(no_args_is_help=True)
def train(
    text_file: Annotated[Path, typer.Argument(help="UTF-8 training text; its last --val-fraction is held out.")],
    out: Annotated[
        Path,
        typer.Option("--out", "-o", help="Checkpoint to write (.safetensors), or ranks file with --tokenizer-only."),
    ],
    n_layer: Annotated[int, typer.Option(min=1, help="Transformer blocks.")] = 6,
    n_head: Annotated[int, typer.Option(min=1, help="Query heads per block.")] = 8,
    n_kv_head: Annotated[
        Optional[int], typer.Option(min=1, help="Key/value heads (fewer than --n-head: grouped-query attention).")
    ] = 2,
    n_embd: Annotated[int, typer.Option(min=1, help="Width of the residual stream.")] = 256,
    block_size: Annotated[int, typer.Option(min=2, help="Context window in tokens.")] = 256,
    position_encoding: Annotated[
        PositionEncoding, typer.Option(help="rope (rotary) or learned (GPT-2's table).")
    ] = PositionEncoding.rope,
    vocab_size: Annotated[int, typer.Option(min=257, help="Size of the byte-level BPE trained on the text.")] = 2048,
    tokenizer: Annotated[
        TrainTokenizer, typer.Option(help="'bpe': train one on the text; 'gpt2': use --tokenizer-file's ranks.")
    ] = TrainTokenizer.bpe,
    tokenizer_file: Annotated[
        Optional[Path], typer.Option(help="A .tiktoken ranks file (with --tokenizer gpt2).")
    ] = None,
    tokenizer_only: Annotated[
        bool, typer.Option(help="Train the BPE and write its .tiktoken ranks to --out; no model.")
    ] = False,
    steps: Annotated[int, typer.Option(min=1, help="Optimizer steps in all (a resumed run continues to this).")] = 1500,
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences of block_size tokens per step.")] = 16,
    lr: Annotated[
        float, typer.Option(min=0.0, help="Peak learning rate (AdamW, linear warm-up, cosine decay to lr/10).")
    ] = 1.5e-3,
    warmup_steps: Annotated[int, typer.Option(min=0, help="Steps of linear learning-rate warm-up.")] = 100,
    dropout: Annotated[float, typer.Option(min=0.0, max=0.99, help="Dropout probability while training.")] = 0.2,
    eval_every: Annotated[int, typer.Option(min=1, help="Steps between validation (and best-checkpoint saves).")] = 100,
    seed: Annotated[
        int,
        typer.Option(callback=_checked("seed"), help="Seed for initialization and batch sampling (0 <= seed < 2^64)."),
    ] = 1337,
    val_fraction: Annotated[
        float, typer.Option(min=0.001, max=0.5, help="Held-out tail of the text for validation.")
    ] = 0.1,
    resume: Annotated[
        bool,
        typer.Option(help="Continue from the checkpoint at --out (its weights and step; fresh optimizer moments)."),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Overwrite --out if it exists (without --resume: start afresh).")
    ] = False,
    device: DeviceOption = Device.auto,
    threads: ThreadsOption = None,
) -> None:
    """Train a GPT (and its byte-level BPE) on a text file, saving the best-validation checkpoint.

    Examples:

      manas train input.txt --out model.safetensors

      manas train input.txt -o tiny.safetensors --n-layer 2 --n-embd 64

      manas train input.txt -o bpe.tiktoken --tokenizer-only --vocab-size 4096
    """
    from .commands import train as command

    shape = command.ModelShape(
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=n_kv_head,
        n_embd=n_embd,
        block_size=block_size,
        position_encoding=position_encoding.value,
        dropout=dropout,
    )
    command.run(
        text_file=text_file,
        out=out,
        shape=shape,
        vocab_size=vocab_size,
        tokenizer=tokenizer.value,
        tokenizer_file=tokenizer_file,
        tokenizer_only=tokenizer_only,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        warmup_steps=warmup_steps,
        eval_every=eval_every,
        seed=seed,
        val_fraction=val_fraction,
        resume=resume,
        force=force,
        device=device.value,
        threads=threads,
    )


@app.command(no_args_is_help=True)
def convert(
    src: Annotated[
        Path,
        typer.Argument(
            help=(
                "nanoGPT ckpt.pt, a Hugging Face GPT-2, Starcoder2, Llama, Qwen2 or Mistral folder, a GGUF file "
                "(llama, qwen2, gpt2, starcoder2; any type llama.cpp quantizes to), or a bare model.safetensors "
                "(with --config)."
            )
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="manas checkpoint to write (.safetensors).")],
    config: Annotated[
        Optional[Path], typer.Option(help="Hugging Face GPT-2 or Starcoder2 config.json for a bare weights file.")
    ] = None,
    tokenizer: Annotated[
        str,
        typer.Option(
            help=(
                "'gpt2': GPT-2's BPE, from a folder's own vocab.json + merges.txt (or tokenizer.json), "
                "--tokenizer-file, or tiktoken's cache."
            )
        ),
    ] = "gpt2",
    tokenizer_file: Annotated[
        Optional[Path],
        typer.Option(
            help=(
                "GPT-2's ranks as a .tiktoken file, embedded in the checkpoint (`manas tokenizer` writes one from "
                "vocab.json + merges.txt)."
            )
        ),
    ] = None,
    tokenizer_meta: Annotated[
        Optional[Path], typer.Option(help="nanoGPT's character-level meta.pkl (read without running code).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")] = False,
    quantize: Annotated[
        Optional[Quantization],
        typer.Option(
            "--quantize",
            help="Write the matrices as manas' int8 (one scale per row) or int4 (a scale and a zero per 32 "
            "values), as `manas quantize` does; without it, float32 (a GGUF's blocks dequantized exactly).",
        ),
    ] = None,
) -> None:
    """Import nanoGPT, Hugging Face GPT-2, Starcoder2 or Llama-family (Llama, Qwen2, Mistral: SmolLM2, Qwen2.5)
    weights, or a llama.cpp GGUF file, as a manas checkpoint.

    Pickles are read with weights only: a file that would run code is refused. A GGUF brings its tokenizer, chat
    template and ends from its metadata.

    Examples:

      manas convert ckpt.pt --out char.safetensors --tokenizer-meta meta.pkl

      manas convert out/ckpt.pt --out mine.safetensors --tokenizer-file gpt2.tiktoken

      manas convert gpt2/ --out gpt2.safetensors

      manas convert SmolLM2-135M/ --out smollm2.safetensors

      manas convert model.safetensors --config config.json --out gpt2.safetensors

      manas convert SmolLM2-135M-Instruct-Q4_K_M.gguf --quantize int8 --out smollm2-int8.safetensors
    """
    from .commands import convert as command

    command.run(
        src=src,
        out=out,
        config=config,
        tokenizer=tokenizer,
        tokenizer_file=tokenizer_file,
        tokenizer_meta=tokenizer_meta,
        force=force,
        quantize=quantize.value if quantize else None,
    )


@app.command(no_args_is_help=True)
def export(
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="hf: the folder to write (created, or with --force overwritten file by file); gguf: the .gguf file.",
        ),
    ],
    checkpoint: Annotated[
        Optional[Path],
        typer.Argument(help="manas checkpoint (.safetensors), or a store name (manas list).", show_default=False),
    ] = None,
    output_format: Annotated[
        ExportFormat,
        typer.Option(
            "--format",
            help=(
                "hf: Hugging Face GPT-2 or Starcoder2 (transformers, vLLM, TGI); gguf: one file for llama.cpp and "
                "ollama."
            ),
        ),
    ] = ExportFormat.hf,
    outtype: Annotated[
        Optional[OutType],
        typer.Option("--outtype", help="gguf: the matrices' precision (default f16; vectors stay f32)."),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Write into a folder that is not empty, or over an existing file.")
    ] = False,
    model: CheckpointOption = None,
) -> None:
    """Export a checkpoint for the serving ecosystem: a Hugging Face folder with its tokenizer, or a GGUF file.

    --format hf writes config.json, generation_config.json, model.safetensors, vocab.json, merges.txt and
    tokenizer_config.json: GPT-2 for learned-position models, Starcoder2 for rotary (rope) ones. --format gguf writes
    one file with the tokenizer inside (llama.cpp's gpt2 or starcoder2; needs pip install "manas-cli[gguf]", or
    pip install -e ".[gguf]" in a clone).

    Examples:

      manas export model.safetensors --format hf --out model-hf

      vllm serve ./model-hf

      manas export model.safetensors --format gguf --out model.gguf

      llama-cli -m model.gguf -p "ROMEO:" -n 100
    """
    from .commands import export as command
    from .commands.common import checkpoint_given

    command.run(
        checkpoint=checkpoint_given(checkpoint, model),
        out=out,
        output_format=output_format.value,
        outtype=outtype.value if outtype else None,
        force=force,
    )


@app.command("quantize", no_args_is_help=True)
def quantize_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="Quantized checkpoint to write (.safetensors).")],
    checkpoint: Annotated[
        Optional[Path],
        typer.Argument(
            help="float manas checkpoint (.safetensors) to quantize, or a store name (manas list).", show_default=False
        ),
    ] = None,
    bits: Annotated[
        int,
        typer.Option(
            "--bits",
            callback=_bits,
            help="8: int8, one scale per row, about 4× "
            "smaller; 4: int4, a scale and a zero per 32 values, about 6× smaller.",
        ),
    ] = 8,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")] = False,
    model: CheckpointOption = None,
) -> None:
    """Write a quantized copy of a checkpoint: its matrices as int8 (--bits 8) or int4 (--bits 4).

    generate, bench, inspect-cache, score and export load it without any flag; it computes what --quantize int8
    or int4 does, except that the token embedding too is read back from its quantized rows.

    Examples:

      manas quantize gpt2.safetensors --out gpt2-int8.safetensors

      manas quantize gpt2.safetensors --bits 4 --out gpt2-int4.safetensors

      manas generate -c gpt2-int4.safetensors -p 'Hello'
    """
    from .commands import quantize as command
    from .commands.common import checkpoint_given

    command.run(checkpoint=checkpoint_given(checkpoint, model), out=out, kind=f"int{bits}", force=force)


@app.command()
@takes_model_flags(cache=False)
def chat(
    system: Annotated[
        Optional[str], typer.Option(help="The system prompt (the template's default without it).")
    ] = None,
    chat_template: Annotated[
        Optional[Path], typer.Option(help="A Jinja chat template for a model without one.")
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", min=1, help="The most tokens of one answer.")] = 512,
    temperature: Annotated[
        float, typer.Option("--temperature", "-t", "--temp", callback=_checked("temperature"), help="0 is greedy.")
    ] = GenerationSettings.temperature,
    top_p: Annotated[Optional[float], typer.Option(callback=_checked("top_p"), help="Nucleus sampling.")] = None,
    top_k: Annotated[Optional[int], typer.Option(min=1, help="Sample among the k most likely.")] = None,
    seed: Annotated[
        Optional[int], typer.Option("--seed", "-s", callback=_checked("seed"), help="Seed each answer's sampler.")
    ] = None,
    stats: Annotated[
        Optional[bool],
        typer.Option(
            "--stats/--no-stats", help="A line of speed and cache figures under each answer. Default: on a terminal."
        ),
    ] = None,
    json_output: Annotated[
        bool,
        typer.Option(
            "--json",
            help="One JSON object a line per answer: text, tokens, finish_reason, token counts, seed, engine.",
        ),
    ] = False,
    *,
    model_options: "ModelOptions",
) -> None:
    r"""Chat with an instruct model in the terminal, or send it one message per line from a pipe.

    The messages go through the model's chat template (or --chat-template FILE); the conversation's KV cache is
    kept between turns, so each turn prefills only what it adds (the native engine), and every answer is what
    manas generate gives the whole rendered prompt. At the prompt: a line ending in a backslash continues, three
    quotes open and close a block; /reset, /system TEXT; Ctrl-C stops an answer, Ctrl-D (or /bye) ends.

    Examples:

      manas chat -m smollm2-135m-instruct

      printf 'Hello!\nWhat did I just say?\n' | manas chat -m qwen2.5-0.5b-instruct -t 0
    """
    from .commands import chat as command

    settings = GenerationSettings(
        max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=()
    )
    command.run(
        system=system,
        chat_template=chat_template,
        settings=settings,
        stats=stats,
        json_output=json_output,
        model_options=model_options,
    )


@app.command(no_args_is_help=True)
def pull(
    repo: Annotated[
        str,
        typer.Argument(
            help="A Hugging Face repository, OWNER/NAME[@REVISION]; a GGUF one as OWNER/NAME-GGUF[:QUANT] (the file "
            "of that quantization; Q4_K_M, else Q8_0, else the first by default)."
        ),
    ],
    name: Annotated[
        Optional[str], typer.Option(help="The store name. Default: the repository's name, lower case.")
    ] = None,
    quantize: Annotated[
        Optional[Quantization], typer.Option(help="Store an int8 or int4 copy too, as NAME-int8 or NAME-int4.")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a stored model of that name.")] = False,
) -> None:
    """Download a model from the Hugging Face Hub and store it under a name that -m/-c take.

    Only the files convert reads are downloaded (config, safetensors weights, tokenizer, generation config, chat
    template; of a GGUF repository, the one file), into the Hugging Face cache ($HF_HOME; $HF_TOKEN, $HF_ENDPOINT
    and $HF_HUB_OFFLINE are honoured), so an interrupted pull resumes; the store is $MANAS_HOME (default
    ~/.local/share/manas). Needs the pull extra (huggingface_hub).

    Examples:

      manas pull HuggingFaceTB/SmolLM2-135M-Instruct

      manas pull Qwen/Qwen2.5-0.5B-Instruct --name qwen --quantize int8

      manas pull bartowski/SmolLM2-135M-Instruct-GGUF:Q8_0

      manas generate -m smollm2-135m-instruct -p 'The capital of France is'
    """
    from .commands import store as command

    command.pull(repo=repo, name=name, quantize=quantize.value if quantize else None, force=force)


@app.command("list")
def list_command(json_output: JsonOption = False) -> None:
    """The models in the store ($MANAS_HOME) and the shipped one: name, architecture, parameters, weights, size,
    window, whether it has a chat template. Each name is what -m/-c take.

    Examples:

      manas list

      manas list --json | jq -r '.[].name'
    """
    from .commands import store as command

    command.list_models(as_json=json_output)


@app.command("rm", no_args_is_help=True)
def rm_command(name: Annotated[str, typer.Argument(help="A store name (manas list).")]) -> None:
    """Remove a model from the store ($MANAS_HOME); the shipped model stays.

    Examples:

      manas rm smollm2-135m-instruct-int8
    """
    from .commands import store as command

    command.remove(name=name)


@app.command("tokenize")
def tokenize_command(
    text: Annotated[
        Optional[str], typer.Argument(help="The text; standard input without it.", show_default=False)
    ] = None,
    source: checkpoint_option(
        "A checkpoint, a store name, a Hugging Face tokenizer.json, or a GGUF file (a model, or a vocabulary alone "
        "as llama.cpp's ggml-vocab-*.gguf)."
    ) = None,
    special: Annotated[
        bool,
        typer.Option(
            "--special/--no-special",
            help="Special-token text (<|im_start|>) as those tokens, as a prompt's; --no-special: plain text.",
        ),
    ] = True,
    json_output: Annotated[
        bool, typer.Option("--json", help='One JSON object: {"ids": [...], "pieces": [...]}, each id\'s text.')
    ] = False,
    jsonl: Annotated[
        bool,
        typer.Option("--jsonl", help="Each line of standard input a JSON string: a line of ids for each, in order."),
    ] = False,
) -> None:
    """Print a text's token ids, space-separated on one line, as the model's tokenizer gives them.

    llama.cpp's llama-tokenize, for checking a tokenizer against another tool. No BOS is added: these are the
    text's own ids (a prompt of a model that has one begins with its BOS).

    Examples:

      manas tokenize -m smollm2-135m-instruct "Hello world"

      manas tokenize -c tokenizer.json --json < text.txt

      jq -R . lines.txt | manas tokenize -c ggml-vocab-qwen2.gguf --jsonl --no-special
    """
    from .commands import tokenize as command

    command.run(source=source, text=text, special=special, json_output=json_output, jsonl=jsonl)


@app.command("tokenizer", no_args_is_help=True)
def tokenizer_command(
    src: Annotated[
        Path, typer.Argument(help="A Hugging Face GPT-2 folder holding vocab.json and merges.txt, or a tokenizer.json.")
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="The .tiktoken ranks file to write.")],
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out if it exists.")] = False,
) -> None:
    """Write a GPT-2 folder's tokenizer (vocab.json + merges.txt, or tokenizer.json) as a .tiktoken file for
    --tokenizer-file.

    convert reads a GPT-2 folder's own tokenizer files by itself; this is for a nanoGPT checkpoint trained with
    GPT-2's tokenizer, whose ckpt.pt carries none.

    Examples:

      hf download openai-community/gpt2 vocab.json merges.txt --local-dir gpt2

      manas tokenizer gpt2 --out gpt2.tiktoken

      manas convert out/ckpt.pt --out mine.safetensors --tokenizer-file gpt2.tiktoken
    """
    from .commands import tokenizer as command

    command.run(src=src, out=out, force=force)


batch_app = typer.Typer(
    name="batch",
    help="Generate or score every line of a JSONL file on a Ray cluster or a local Ray instance, each record what "
    "the line alone gives.\n\n"
    "The records are written in input order, to OUT.partial as they come and to OUT when all are there; --resume "
    "goes on after a killed job. Needs Ray: pip install 'manas-cli[ray]'. docs/scale.md has the details.\n\n"
    "Examples:\n\n"
    "  manas batch generate prompts.jsonl --out records.jsonl -n 64 -t 0\n\n"
    "  manas batch score corpus.jsonl --out scores.jsonl --ray 10.0.0.5:6379",
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(batch_app)

InputFileArgument = Annotated[Path, typer.Argument(metavar="IN.jsonl", help="One JSON object per line.")]
BatchOutOption = Annotated[
    Path,
    typer.Option(
        "--out",
        "-o",
        help="Where the records go, one per input line, in input order. Written to OUT.partial as they come and "
        "renamed to OUT when all are there.",
    ),
]
RayOption = Annotated[
    Optional[str],
    typer.Option(
        "--ray",
        envvar="RAY_ADDRESS",
        show_envvar=True,
        metavar="ADDRESS",
        help="The Ray cluster (HOST:PORT of its head, or 'auto'). Default: a local Ray instance on this machine, "
        "listening on loopback only.",
    ),
]
ActorsOption = Annotated[
    Optional[int],
    typer.Option(min=1, help="Actors, each with the model loaded once. Default: the cluster's CPUs over --threads."),
]
ResumeOption = Annotated[
    bool, typer.Option("--resume", help="Go on from the records an interrupted run left in OUT.partial.")
]
ForceOption = Annotated[bool, typer.Option("--force", "-f", help="Replace OUT if it exists.")]


# The flags both batch commands take, declared once: name -> (annotation, default; required where none).
BATCH_FLAGS = {
    "source": (InputFileArgument, inspect.Parameter.empty),
    "out": (BatchOutOption, inspect.Parameter.empty),
    "ray": (RayOption, None),
    "actors": (ActorsOption, None),
    "resume": (ResumeOption, False),
    "force": (ForceOption, False),
}


def batch_files_of(*, ray: Optional[str], **values) -> dict:
    """The batch flags as commands.batch.run takes them: --ray is the cluster's address."""
    return {"address": ray, **values}


def task_lines_option(default: int) -> type:
    return Annotated[
        int,
        typer.Option(
            min=1,
            help=f"Lines each Ray task takes (default {default}): more keeps an actor's rows full, fewer spreads the "
            "work and redoes less when a worker dies.",
        ),
    ]


@batch_app.command("generate", no_args_is_help=True)
@takes_model_flags(cache=False)
@takes_setting_flags()
@takes_flags(BATCH_FLAGS, batch_files_of, "files")
def batch_generate(
    task_lines: task_lines_option(256) = 256,
    batch_size: BatchSizeOption = 16,
    overflow: OverflowOption = Overflow.recompute,
    *,
    files: dict,
    settings: GenerationSettings,
    model_options: "ModelOptions",
) -> None:
    """Generate for every line of IN.jsonl on Ray: the records --jsonl writes, in input order.

    A line is what `manas generate --jsonl` reads: 'prompt', optionally 'id' and any setting by its name; the flags
    give the settings' defaults. Each record equals the one `manas generate --jsonl` writes for the line alone
    (seeded and greedy ones bit for bit on the native engine; their timings aside). The model is a file every node
    can read, or a store name pulled on each node.

    Examples:

      manas batch generate prompts.jsonl --out records.jsonl -n 64 -t 0

      manas batch generate prompts.jsonl -o records.jsonl --ray 10.0.0.5:6379 -m smollm2-135m-instruct

      manas batch generate prompts.jsonl -o records.jsonl --resume
    """
    from .commands import batch as command

    options = {"batch_size": batch_size, "overflow": overflow.value, **vars(settings)}
    command.run(job=command.Job("generate", options, task_lines), **files, model_options=model_options)


@batch_app.command("score", no_args_is_help=True)
@takes_model_flags(cache=False)
@takes_flags(BATCH_FLAGS, batch_files_of, "files")
def batch_score(
    task_lines: task_lines_option(16) = 16,
    stride: Annotated[
        Optional[int], typer.Option(help="Tokens each window advances by (default: half the window), as score's.")
    ] = None,
    *,
    files: dict,
    model_options: "ModelOptions",
) -> None:
    """Score every line of IN.jsonl on Ray: score --json's record for each line's text, in input order.

    A line is {"text": ..., optionally "id" and "stride"}; each record is {"id", and the fields `manas score --json`
    writes for the text alone}, or {"id", "line", "error"} for a line that is bad input.

    Examples:

      manas batch score corpus.jsonl --out scores.jsonl

      manas batch score corpus.jsonl -o scores.jsonl --ray auto --actors 8 --stride 512
    """
    from .commands import batch as command

    command.run(job=command.Job("score", {"stride": stride}, task_lines), **files, model_options=model_options)


def summarize_commands() -> None:
    """The top-level help lists each command with its docstring's first sentence whole (click would cut it at 45
    characters with '...'); a group of commands (batch) with its help's."""
    for info in [*app.registered_commands, *batch_app.registered_commands]:
        info.short_help = first_sentence(info.callback.__doc__)
    for group in app.registered_groups:
        group.short_help = first_sentence(group.typer_instance.info.help)


def first_sentence(text: str) -> str:
    first = " ".join(text.split("\n\n")[0].split())  # its lines joined, indents dropped
    return first.split(". ")[0].rstrip(".")


summarize_commands()
