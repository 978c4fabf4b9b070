"""One file per command: its Typer function (flags, help, the call) beside its body; app.py assembles them. A
command module imports only typer, the shared flags (cli/flags.py) and the standard library at its top, and the
engine when it runs, so `manas --help` loads none of it. Command modules do not postpone their annotations (no
`from __future__ import annotations`): typer reads each flag's Annotated metadata through the flag decorators'
signatures, where a string would stay a string; a name imported only for type checkers is written in quotes."""
