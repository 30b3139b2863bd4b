"""``gpt2lab serve``: an OpenAI-compatible completions and chat server and a playground page.

``batch`` runs generation (one worker per model: continuous batching, the active requests as one
batch per step, or with ``--deterministic`` requests in turns) in ``rows``, its KV cache; ``jobs``
a request's work, the events and errors it is sent, and the loop that steps the workers;
``schemas`` what a request body may hold; ``completions`` a request's further checks, the
work it becomes and a choice's logprobs; ``errors`` OpenAI's error body; ``responses``
OpenAI-shaped answers and SSE; ``asgi`` the body cap and
timeout and the access log; ``app`` the routes, the page and /metrics; ``server`` the socket and
uvicorn beside the engine; ``models`` the workers of the --model specs; ``metrics`` the
Prometheus counters; ``limits`` the flags' values.
"""
