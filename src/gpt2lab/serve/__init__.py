"""``gpt2lab serve``: an OpenAI-compatible completions server and a playground page.

``engine`` runs generation (one worker thread per model, requests taking turns token by
token); ``api`` is the FastAPI app (request checks, OpenAI-shaped JSON and SSE, the page).
"""
