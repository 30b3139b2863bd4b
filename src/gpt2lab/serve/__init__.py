"""``gpt2lab serve``: an OpenAI-compatible completions and chat server and a playground page.

``batch`` runs generation (one worker per model: continuous batching, the active requests as one
batch per step, or with ``--deterministic`` requests in turns) in ``rows``, its KV cache; ``engine``
steps the workers and holds the events and errors they send;
``schemas`` what a request body may hold; ``completions`` a request's further checks and the
work it becomes; ``errors`` OpenAI's error body; ``logprobs`` a choice's logprobs; ``responses``
OpenAI-shaped answers and SSE; ``asgi`` the body cap and
timeout and the access log; ``app`` the routes, the page and /metrics; ``server`` the socket and
uvicorn beside the engine; ``models`` the workers of the --model specs; ``metrics`` the
Prometheus counters; ``limits`` the flags' values.
"""
