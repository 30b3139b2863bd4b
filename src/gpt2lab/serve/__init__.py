"""``gpt2lab serve``: an OpenAI-compatible completions and chat server and a playground page.

``batch`` runs generation (continuous batching: the active requests as one batch per step);
``engine`` holds what workers share and the ``--deterministic`` worker (requests in turns);
``api`` is the FastAPI app (request checks, OpenAI-shaped JSON and SSE, the page, /metrics);
``chat`` the chat template; ``metrics`` the Prometheus counters; ``limits`` the flags' values.
"""
