"""`manas serve`: OpenAI's completions API over HTTP (http.py), its request and response shapes (api.py), and the
one engine thread that batches every request (scheduler.py)."""
