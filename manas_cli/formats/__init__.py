"""File formats: manas's checkpoint, tokenizers (tiktoken ranks, GPT-2's files, the BPE trainer), and the outside
formats manas reads or writes: nanoGPT, Hugging Face GPT-2 and Starcoder2, GGUF. Built on the engine's model."""
