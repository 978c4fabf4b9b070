"""One module per command: flags in (typed, from cli.py), engine calls, rendering out. Imported only when a
command runs, so `manas --help` loads none of the engine."""
