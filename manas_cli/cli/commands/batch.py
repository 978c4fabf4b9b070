"""`manas batch generate|score IN.jsonl --out OUT.jsonl`: the lines of a file through the Ray Data classes
(manas_cli.ray_data) on a Ray cluster, or on a local Ray instance; the records written in input order, into
OUT.partial as they come and to OUT once all are there, so a killed job leaves no half OUT and `--resume` goes on
from the records already written."""

import inspect
import json
import os
import stat
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from ...errors import InputError, ManasError, first_line, interrupt_exit_code
from ...settings import GenerationSettings, as_overrides
from ..flags import (
    DEFAULT_BATCH_SIZE,
    BatchSizeOption,
    Overflow,
    OverflowOption,
    takes_flags,
    takes_model_flags,
    takes_setting_flags,
)

if TYPE_CHECKING:
    from ...batch import RawLine
    from ...models import ModelOptions


RAY_MISSING = 'manas batch runs on Ray, which is not installed: pip install "manas-cli[ray]"'
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


@dataclass(frozen=True)
class Job:
    """What runs on the actors: the Ray Data class, its keyword arguments, and the lines each task takes."""

    kind: str  # "generate" or "score"
    options: dict  # the class's keyword arguments beyond the model's
    task_lines: int


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def read_lines(source: Path) -> "list[RawLine]":
    """IN's non-blank lines (each at most batch.MAX_LINE_BYTES, as --jsonl reads them), read on this machine."""
    from ...batch import read_raw_lines
    from .common import read_file

    return read_file(source, "input file", lambda f: list(read_raw_lines(f)))


def job_path(partial: Path) -> Path:
    """Beside OUT.partial, the job that writes it: its input's hash and its settings (see job_identity)."""
    return partial.with_name(partial.name + ".job")


def job_identity(lines: "list[RawLine]", job: Job, model: str | None, model_options: "ModelOptions") -> dict:
    """What makes the records: the input lines (hashed), the command, its settings, the model and how it runs (its
    thread count aside: the records are the same on any count)."""
    import hashlib

    digest = hashlib.sha256()
    for line in lines:
        digest.update(json.dumps([line.number, line.text, line.error]).encode() + b"\n")
    running = {
        name: value for name, value in vars(model_options).items() if name not in ("checkpoint", "threads", "debug")
    }
    identity = {"input_sha256": digest.hexdigest(), "command": job.kind, "options": job.options, "model": model}
    return json.loads(json.dumps({**identity, "model_options": running}, sort_keys=True, default=str))


def open_partial(partial: Path, resume: bool, lines: int, identity: dict) -> tuple[int, int, int]:
    """OUT.partial open for appending, with how many records an interrupted run left in it and how many of them
    are error records. A new job names itself in OUT.partial.job first. A resumed one must be this job's (the same
    identity), a regular file and not a link (never followed: no file of the user's is truncated or appended to),
    and hold at most `lines` JSON objects; a last line cut short by a kill is dropped. Without --resume, a partial
    file is refused rather than lost."""
    if not os.path.lexists(partial):
        _name_the_job(job_path(partial), identity)
        return os.open(partial, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), 0, 0
    if not resume:
        raise InputError(
            f"{partial} holds the records of an interrupted run: add --resume to go on from them, or delete it to "
            "start again"
        )
    _check_job(partial, identity)
    try:
        descriptor = os.open(partial, os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW)
    except OSError:  # ELOOP: a link put there since
        raise InputError(
            f"{partial} is a link: manas resumes only the file it wrote; delete it to start again"
        ) from None
    try:
        with os.fdopen(os.dup(descriptor), "rb") as f:
            data = f.read()
        whole = data.rfind(b"\n") + 1  # a record is written whole, but a kill can still cut the last one
        try:
            records = [json.loads(line) for line in data[:whole].splitlines()]
        except ValueError:
            records = None
        if records is None or not all(isinstance(record, dict) for record in records):
            raise InputError(f"{partial} is not a file of records (JSON lines): is it this job's?")
        if len(records) > lines:
            raise InputError(
                f"{partial} holds {len(records)} records and the input only {lines} lines: is it this job's?"
            )
        os.ftruncate(descriptor, whole)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor, len(records), sum("error" in record for record in records)


def _regular_file(path: Path, what: str) -> None:
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise InputError(f"{path} is a link: manas resumes only the {what} it wrote; delete it to start again")
    if not stat.S_ISREG(mode):
        raise InputError(f"{path} is not a regular file: manas resumes only the {what} it wrote; delete it")


def _check_job(partial: Path, identity: dict) -> None:
    """OUT.partial is this job's: its .job file names the same input and settings."""
    _regular_file(partial, "file of records")
    named = job_path(partial)
    if not os.path.lexists(named):
        raise InputError(f"{partial} does not say which job wrote it (no {named.name}): delete it to start again")
    _regular_file(named, "job file")
    try:
        with open(named, "rb") as f:
            written = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        written = None
    if written != identity:
        raise InputError(
            f"{partial} holds another job's records (its input, settings or model differ): run that job's command "
            f"with --resume, or delete {partial.name} and {named.name} to start again"
        )


def _name_the_job(named: Path, identity: dict) -> None:
    """Write OUT.partial.job afresh (a stale one, or a link, is removed, never followed)."""
    if os.path.lexists(named):
        os.unlink(named)
    descriptor = os.open(named, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as f:
        f.write(json.dumps(identity, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def model_argument(model_options: "ModelOptions", address: str | None) -> str | None:
    """The model as the actors are to open it. A store name stays a name, for each node's own store (checked here
    when the instance is local); a file found here goes as its absolute path (a worker's folder is not ours); a
    path not found here goes as given when a cluster is named (its nodes may have it: docs/scale.md)."""
    from ... import store
    from ...models import checkpoint_file, resolve_checkpoint

    option = model_options.checkpoint
    if option is not None and not option.exists() and store.is_name(str(option)):
        if address is None:
            resolve_checkpoint(option)  # not in this machine's store: say so before Ray starts
        return str(option)
    try:
        return str(checkpoint_file(resolve_checkpoint(option)).resolve())
    except InputError:
        if address is None or option is None:
            raise
        return str(option)


def start_ray(address: str | None):
    """Ray, connected to the cluster at `address`, or to a new local instance. A local instance, or a cluster at a
    loopback address, stays on loopback: Ray otherwise swaps 127.0.0.1 for the machine's outside address and
    listens on every interface (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is Ray's switch for that; set before Ray is
    imported, as Ray reads it then)."""
    import logging

    host = (address or "").rpartition(":")[0]
    if address is None or host in LOOPBACK_HOSTS:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
        import ray.data  # noqa: F401 (Ray Data is the `ray[data]` part of the extra)
    except ImportError:
        raise InputError(RAY_MISSING) from None
    try:
        # "local": a new instance, never the last cluster this machine started (which Ray would join otherwise)
        ray.init(address=address or "local", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    except Exception as exc:  # ConnectionError, OSError, and the bare Exception of a node that did not start
        ray.shutdown()  # whatever part of a local instance did start
        if address is not None:
            raise InputError(
                f"cannot reach the Ray cluster at {address}: {first_line(exc)} (is it running? `ray status` there "
                "says; --debug shows Ray's own messages)"
            ) from None
        raise InputError(
            f"cannot start a local Ray instance: {first_line(exc)} (check the free memory and disk of "
            "${RAY_TMPDIR:-/tmp}; --debug shows Ray's own messages)"
        ) from None
    logging.getLogger("ray.data").setLevel(logging.ERROR)  # its plan and progress lines: ours are on a terminal
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # the records come back in input order
    context.max_consecutive_actor_init_deaths = 3  # a worker killed while it loads the model is replaced, not fatal
    context.enable_progress_bars = False  # ours shows records/s and ETA
    context.print_on_execution_start = False
    return ray


@contextmanager
def ray_logs_aside(debug: bool):
    """Ray's C++ core and the processes it starts write their log lines to descriptor 2 (`core_worker.cc … E`,
    on every successful job), into the user's stderr and the middle of the progress bar. While Ray runs, descriptor
    2 is /dev/null (Ray keeps its own logs in its session folder) and Python's sys.stderr writes to a copy of the
    real one; --debug leaves them be."""
    if debug:
        yield
        return
    sys.stderr.flush()
    original, real = sys.stderr, os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    sys.stderr = open(real, "w", encoding="utf-8", errors="backslashreplace", buffering=1)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)
        sys.stderr.close()
        sys.stderr = original


def cause(exc: BaseException) -> ManasError | None:
    """The manas error an actor raised (a model it cannot open), through Ray's wrappers."""
    seen = exc
    while seen is not None:
        if isinstance(seen, ManasError):
            return seen
        if isinstance(getattr(seen, "cause", None), BaseException):
            seen = seen.cause
        else:
            seen = seen.__cause__ or seen.__context__
    return None


def records(ray, lines: "list[RawLine]", job: Job, model: str | None, model_options: "ModelOptions", actors: int):
    """The records of `lines`, in their order, as Ray's actors make them."""
    from ...ray_data import MODEL_KEYS, Generator, Scorer

    threads = model_options.threads or 1
    keys = {**{name: getattr(model_options, name) for name in MODEL_KEYS}, "threads": threads}
    rows = [{"line": line.number, "request": line.text, "unreadable": line.error} for line in lines]
    # At least 4 tasks an actor where the lines allow, so that none waits long for the last one's; a short job
    # still gives every actor some.
    per_task = max(1, min(job.task_lines, -(-len(rows) // (4 * actors))))
    dataset = ray.data.from_items(rows, override_num_blocks=max(1, -(-len(rows) // per_task)))
    mapped = dataset.map_batches(
        Generator if job.kind == "generate" else Scorer,
        fn_constructor_args=(model,),
        fn_constructor_kwargs={**keys, **job.options},
        batch_size=per_task,
        # Two tasks at a time an actor, not Ray's four: the first actor up would queue the whole of a short job.
        compute=ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=2),
        num_cpus=threads,
    )
    for batch in mapped.iter_batches(batch_size=None, batch_format="numpy"):
        yield from zip(batch["record"].tolist(), batch["failed"].tolist())


def default_actors(ray, threads: int) -> int:
    """As many actors as the cluster has CPUs for, at `threads` each."""
    return max(1, int(ray.cluster_resources().get("CPU", 1)) // threads)


def append_records(
    written,
    lines: "list[RawLine]",
    job: Job,
    model: str | None,
    model_options: "ModelOptions",
    address: str | None,
    actors: int | None,
    partial: Path,
) -> int:
    """The records of `lines` appended to OUT.partial as Ray makes them, with a progress bar on a terminal and
    Ray's own log lines aside; how many of them are error records."""
    from ..render import stderr_console

    with ray_logs_aside(model_options.debug):
        console = stderr_console()  # on the real stderr, which descriptor 2 no longer is
        ray = start_ray(address)
        actors = actors or default_actors(ray, model_options.threads or 1)
        made = records(ray, lines, job, model, model_options, actors)
        return write_records(written, made, ray, f"{job.kind} on {actors} actors", len(lines), console, partial)


def write_records(written, made, ray, what: str, count: int, console, partial: Path) -> int:
    """Each record whole on disk before the next (for --resume); how many of them are error records."""
    from ..render import say, token_progress

    failed = 0
    with token_progress(console, count, what, "records") as advance:
        try:
            for record, bad in made:
                written.write(record + "\n")
                written.flush()
                failed += bad
                advance()
        except ray.exceptions.RayError as exc:
            raise cause(exc) or ManasError(f"the Ray job failed: {first_line(exc)}") from None
        except KeyboardInterrupt as exc:
            say(console, f"interrupted: the records so far are in {partial}; --resume goes on from them")
            raise typer.Exit(interrupt_exit_code(exc)) from None
    return failed


def run(
    *,
    job: Job,
    source: Path,
    out: Path,
    address: str | None,
    actors: int | None,
    resume: bool,
    force: bool,
    model_options: "ModelOptions",
) -> None:
    from ...files import check_output_file, publish, refuse_inputs
    from ..render import say, stderr_console

    console = stderr_console()
    partial = partial_path(out)
    check_output_file(out, force, inputs=(source,))
    refuse_inputs(partial, (source,))
    lines = read_lines(source)
    model = model_argument(model_options, address)
    identity = job_identity(lines, job, model, model_options)
    descriptor, done, failed = open_partial(partial, resume, len(lines), identity)  # private (0600) until published
    try:
        with os.fdopen(descriptor, "a", encoding="utf-8") as written:
            if done < len(lines):  # else an interrupted run wrote them all, and only the rename was left
                failed += append_records(written, lines[done:], job, model, model_options, address, actors, partial)
            os.fsync(written.fileno())
    except BaseException:
        if os.lstat(partial).st_size == 0:  # nothing written (Ray missing, the model refused): nothing to resume
            partial.unlink()
            job_path(partial).unlink(missing_ok=True)
        raise
    publish(partial, out, overwrite=force)
    partial.unlink(missing_ok=True)
    job_path(partial).unlink(missing_ok=True)
    resumed = f" ({done:,} of them from the interrupted run)" if done else ""
    say(console, f"{len(lines):,} records in {out}{resumed}")
    if failed:
        console.print(f"error: {failed} of {len(lines)} lines failed (their records have an 'error' field)")
        raise typer.Exit(1)


# ---- the command: its flags and help, and the call ------------------------------------------------------------


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


@takes_model_flags(cache=False)
@takes_setting_flags()
@takes_flags(BATCH_FLAGS, batch_files_of, "files")
def generate_command(
    task_lines: task_lines_option(256) = 256,
    batch_size: BatchSizeOption = None,
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

    options = {"batch_size": batch_size or DEFAULT_BATCH_SIZE, "overflow": overflow.value, **as_overrides(settings)}
    run(job=Job("generate", options, task_lines), **files, model_options=model_options)


@takes_model_flags(cache=False)
@takes_flags(BATCH_FLAGS, batch_files_of, "files")
def score_command(
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

    run(job=Job("score", {"stride": stride}, task_lines), **files, model_options=model_options)
