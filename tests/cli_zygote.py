"""A process that has imported what a `manas` run spends its first second or two importing (torch, the CLI), and
forks a child for each run the tests ask of it: the child takes the run's pipes as its stdin, stdout and stderr,
its environment, working folder and arguments, and runs `python -m manas_cli` as the interpreter would, to its own
exit status. Each run is still a process of its own, and everything a run does after start-up is the real CLI's.

cli_fixtures.run_cli (under manas() and cli()) sends runs here; a run whose environment changes what is read at
start-up (PYTHON*, locale, OpenMP: the names in cli_fixtures.STARTUP) gets a fresh interpreter instead, as does
every run when MANAS_TEST_FRESH=1.

Protocol, over the SOCK_SEQPACKET socket whose descriptor is argv[1]: a request is one JSON message ({"args",
"env", "cwd", "umask", "address_space"}) carrying three descriptors (stdin, stdout, stderr); the answers are
{"pid"} once the child runs and {"status"} (os.waitstatus_to_exitcode's) once it has ended. An empty message ends
the zygote."""

from __future__ import annotations

import atexit
import importlib
import json
import os
import pkgutil
import resource
import runpy
import socket
import sys
import threading

# Imported once here, so that no child imports them. None reads more at import time than the environment variables
# in cli_fixtures.STARTUP; huggingface_hub, transformers and ray, which read HF_ENDPOINT and the like into constants,
# are left to the children (manas_cli imports them inside the functions that use them), and preload checks that.
LEFT_TO_THE_CHILDREN = ("huggingface_hub", "transformers", "ray")
PRELOAD = ("torch", "safetensors.torch", "tokenizers", "jinja2", "rich", "typer")


def preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    import manas_cli

    for module in pkgutil.walk_packages(manas_cli.__path__, "manas_cli."):
        if module.name != "manas_cli.__main__":
            importlib.import_module(module.name)
    loaded = sorted(name for name in sys.modules if name.split(".")[0] in LEFT_TO_THE_CHILDREN)
    assert not loaded, f"the zygote imported {loaded}, which read the environment as they load"


def run_child(request: dict, descriptors: list[int]) -> None:
    """In the forked child: become `python -m manas_cli ARGS` with the request's stdio, environment and folder."""
    for target, descriptor in enumerate(descriptors):
        os.dup2(descriptor, target)
        os.close(descriptor)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # as `python -m` puts the folder it runs in first, where this script's folder was
    if request["umask"] is not None:
        os.umask(request["umask"])
    if request["address_space"] is not None:
        resource.setrlimit(resource.RLIMIT_AS, (request["address_space"], request["address_space"]))
    sys.argv = ["manas_cli", *request["args"]]
    try:
        runpy.run_module("manas_cli", run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as stop:
        status = exit_status(stop.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    finish(status)


def exit_status(code: object) -> int:
    """The status `python -m` ends with on SystemExit(code): None is 0, an int itself, anything else printed, 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def finish(status: int) -> None:
    """End as the interpreter ends (threads joined, atexit run, stdio flushed), without tearing down every module:
    that takes half a second with torch imported, and no run's output depends on it."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            status = status or 120  # as the interpreter does when flushing stdout fails at exit
    os._exit(status)


def serve(channel: socket.socket) -> None:
    while True:
        message, descriptors, _, _ = socket.recv_fds(channel, 1 << 22, 3)
        if not message:
            return
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            channel.close()
            run_child(request, descriptors)
        for descriptor in descriptors:
            os.close(descriptor)
        channel.send(json.dumps({"pid": pid}).encode())
        _, status = os.waitpid(pid, 0)
        channel.send(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())


if __name__ == "__main__":
    preload()
    serve(socket.socket(fileno=int(sys.argv[1])))
