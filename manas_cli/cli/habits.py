"""llama.cpp's flags that mean something else in manas, read from the command line before click parses it: what
would be a confusing error or, worse, silently another setting (`-t 4`: llama.cpp's threads, manas's temperature)
becomes what the user meant, with a notice saying what manas does instead, or a hint at the manas flag.

docs/models.md's table of habits lists each."""

from __future__ import annotations

# Options whose next argument is free text, never read as a flag (a prompt may well be "-i").
TEXT_OPTIONS = ("-p", "--prompt", "--stop", "--system")
GPU_LAYERS = ("-ngl", "--n-gpu-layers", "--gpu-layers")
# llama-cli's flags with no meaning of their own in manas: the manas way, as a usage error's hint
HINTS = {
    "-cnv": "llama-cli's conversation mode is `manas chat -m MODEL` (or `manas run MODEL`)",
    "--conversation": "llama-cli's conversation mode is `manas chat -m MODEL` (or `manas run MODEL`)",
    "-i": "llama-cli's interactive mode is `manas chat -m MODEL` (or `manas run MODEL`)",
    "--interactive": "llama-cli's interactive mode is `manas chat -m MODEL` (or `manas run MODEL`)",
    "--n-predict": "the tokens to generate are -n/--max-tokens in manas (-n 64; -1: until the end of text)",
    "-r": "llama.cpp's reverse prompt is --stop TEXT in manas (generation stops before it)",
    "--reverse-prompt": "llama.cpp's reverse prompt is --stop TEXT in manas (generation stops before it)",
}
# Options that run `generate` when the command line starts with one and names no command (llama-cli's way).
GENERATE_FIRST = ("-m", "--model", "-c", "--checkpoint", "-p", "--prompt", "-f", "--prompt-file")
# The commands that run a model as llama.cpp's tools do, where its flags are typed (bench's -r is llama-bench's)
COMMANDS = {"generate", "chat", "run", "serve", "bench", "score", "inspect-cache"}
HOT_TEMPERATURE = 2.0


class HabitError(Exception):
    """A flag of llama.cpp's that manas does not take, with the manas way to say it."""


def translate(args: list[str]) -> tuple[list[str], list[str]]:
    """The arguments as manas reads them, and the notices to show; HabitError for a flag that has a manas
    equivalent the user should type instead."""
    if next((arg for arg in args if arg != "--debug"), None) in GENERATE_FIRST:
        args = ["generate", *args]  # `manas -m model.gguf -p ... -n 64`, as llama-cli
    command = next((arg for arg in args if arg != "--debug"), None)
    if command not in COMMANDS:
        return args, []
    kept, notices, index = [], [], 0
    while index < len(args):
        arg, following = args[index], args[index + 1] if index + 1 < len(args) else None
        if arg == "--":
            kept.extend(args[index:])
            break
        name = arg.split("=", 1)[0]
        if arg in TEXT_OPTIONS and following is not None:
            kept += [arg, following]
            index += 2
            continue
        if name in GPU_LAYERS:
            notices.append(
                f"notice: {name} (llama.cpp's layers on the GPU) is ignored: manas runs the whole model on one "
                "device, which --device chooses (auto: a CUDA GPU where torch has one, else the CPU)"
            )
            index += 1 if "=" in arg or following is None else 2
            continue
        if arg in HINTS and not (command == "bench" and arg == "-r"):
            raise HabitError(f"no such option: {arg}: {HINTS[arg]}")
        if arg == "-t" and _number(following) is not None and _number(following) > HOT_TEMPERATURE:
            notices.append(
                f"notice: -t {following} is the temperature in manas (llama.cpp's -t is threads): "
                f"the threads are --threads {following}"
            )
        kept.append(arg)
        index += 1
    return kept, notices


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None
