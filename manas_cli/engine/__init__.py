"""The engine: the model, its KV cache, generation (one request, or many batched), sampling, quantized layers,
scoring, speed measurement, threads and devices. It computes; it knows nothing of files' formats or terminals."""
