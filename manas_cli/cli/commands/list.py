"""`manas list`: the models in the store (store.py) and the shipped one."""

import json

from ..flags import JsonOption


def run(*, as_json: bool) -> None:
    from ... import store
    from ..render import plain_table

    entries = store.entries()
    if as_json:
        print(json.dumps([_as_dict(entry) for entry in entries], indent=2))
        return
    rows = [
        [
            entry.name + (" (shipped)" if entry.shipped else ""),
            entry.architecture,
            f"{entry.parameters / 1e6:,.1f}M",
            entry.weights,
            f"{entry.size_bytes / 2**20:,.1f} MiB",
            f"{entry.window:,}",
            "yes" if entry.chat_template else "no",
        ]
        for entry in entries
    ]
    print(plain_table(["NAME", "ARCHITECTURE", "PARAMETERS", "WEIGHTS", "SIZE", "WINDOW", "CHAT"], rows))


def _as_dict(entry) -> dict:
    return {**entry.__dict__, "path": str(entry.path)}


# ---- the command: its flags and help, and the call ------------------------------------------------------------


def command(json_output: JsonOption = False) -> None:
    """The models in the store ($MANAS_HOME) and the shipped one: name, architecture, parameters, weights, size,
    window, whether it has a chat template. Each name is what -m/-c take.

    Examples:

      manas list

      manas list --json | jq -r '.[].name'
    """

    run(as_json=json_output)
