"""The command line: the Typer app (flags and help, no heavy imports), one module per command, the settings that
flags and --jsonl lines share, text streaming, rendering and the live display. It does no tensor math."""
