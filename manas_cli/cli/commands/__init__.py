"""One file per command: its Typer function (flags, help, the call) beside its body; app.py assembles them. A
command module imports only typer, the shared flags (cli/flags.py) and the standard library at its top, and the
engine when it runs, so `manas --help` loads none of it."""
