"""manas: fast text generation from small GPT checkpoints, with a KV cache you can inspect."""

__version__ = "0.1.0"
