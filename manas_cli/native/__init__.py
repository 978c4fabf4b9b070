"""The native core: the forward pass in plain C (core.c), compiled on first use (build.py), bound with ctypes to the
torch model's own tensors (binding.py). engine/native.py runs it as an engine."""
