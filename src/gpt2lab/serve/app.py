"""The FastAPI app: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, the
playground at ``/`` and Prometheus' ``/metrics``; routing's own errors (an unknown route 404, a
wrong method 405, a body that is not UTF-8 or not JSON) in OpenAI's error body.

Responses and stream chunks have OpenAI's shapes, so the official ``openai`` client, curl and
lm-evaluation-harness's ``local-completions`` work unchanged. Every bad request gets a 4xx with
OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` and the server goes on
serving; a full queue gets 429 at once, a request past the timeout 504, a body past
asgi.MAX_BODY_BYTES 413 however it is framed. A client that hangs up frees its row, streamed or not.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from gpt2lab.inference import chat
from gpt2lab.serve.asgi import BODY, AccessLog, HostCheck
from gpt2lab.serve.batch import Worker
from gpt2lab.serve.completions import ChatCompletion, Completion
from gpt2lab.serve.errors import APIError
from gpt2lab.serve.metrics import ServeMetrics
from gpt2lab.serve.responses import respond
from gpt2lab.serve.schemas import ChatRequest, CompletionRequest, huge_integer, validation_error

# The paths served: named in a 404's message, counted by name in /metrics (any other path as "other")
ROUTES = ("/", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")


def create_app(workers: dict[str, Worker], host: str = "127.0.0.1", allowed_hosts: tuple[str, ...] = ()) -> FastAPI:
    """The app serving ``workers``: they report to its own ``/metrics`` from now on. ``host``, the
    address it is bound to, and ``allowed_hosts`` decide which Host names it answers (asgi.HostCheck)."""
    metrics = ServeMetrics()
    for w in workers.values():
        metrics.watch(w)
    app = FastAPI(title="gpt2lab serve", docs_url=None, redoc_url=None)
    app.state.metrics = metrics  # the server's connection guard reports to it too (server.serve_here)
    app.add_middleware(AccessLog, metrics=metrics, routes=ROUTES, hosts=HostCheck(host, allowed_hosts))
    page = (resources.files("gpt2lab") / "assets" / "playground.html").read_text(encoding="utf-8")

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """Routing's own errors (an unknown route, a wrong method, a body that is not text) in OpenAI's
        error body."""
        where = f"{request.method} {request.url.path}"
        bad = exc.__cause__  # FastAPI's "error parsing the body" keeps what went wrong here
        huge = huge_integer(request.scope.get(BODY, b""), request.url.path) if isinstance(bad, ValueError) else None
        if huge is not None:  # an integer too long to read: the field named
            return huge.response()
        if isinstance(bad, UnicodeDecodeError):
            message = (
                f"the request body is not UTF-8 JSON: byte {bad.object[bad.start]:#04x} at position "
                f"{bad.start} is not UTF-8; send the JSON encoded as UTF-8"
            )
        elif exc.status_code == 404:
            message = f"Invalid URL ({where}): this server answers {', '.join(ROUTES)}"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "another method")
            message = f"Method not allowed ({where}): this route takes {allowed}"
        else:
            message = f"{where}: {exc.detail}"
        return APIError(exc.status_code, message).response(exc.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        kind = request.headers.get("content-type", "")
        if request.method == "POST" and kind.split(";")[0].strip().lower() != "application/json":
            got = f"Content-Type: {kind}" if kind else "no Content-Type header"
            message = f"send the request body as JSON with the header Content-Type: application/json (got {got})"
            return APIError(415, message).response()
        return validation_error(exc).response()

    @app.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse)
    async def playground() -> str:
        return page

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "gpt2lab",
                    "context_length": w.block_size,
                    "chat_template": w.model.config.chat_template,
                    "note": chat.note(w.model.config),
                    **({"inference": w.decision.record()} if w.decision is not None else {}),  # how it is held
                }
                for name, w in workers.items()
            ],
        }

    # A request is checked and its prompt tokenized in a thread: a long prompt takes a second or two to
    # tokenize (refused past the context only then), while the event loop goes on streaming others' tokens.
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await respond(await run_in_threadpool(Completion, req, workers), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        return await respond(await run_in_threadpool(ChatCompletion, req, workers), request)

    return app
