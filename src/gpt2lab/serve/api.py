"""The FastAPI app: OpenAI's ``/v1/completions`` and ``/v1/models``, and the playground at ``/``.

Responses and stream chunks have OpenAI's shapes, so the official ``openai`` client and
curl work unchanged. Every bad request gets a 4xx with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}`` and the server goes on serving; a full
queue gets 429 at once, a request past the timeout 504. ``/metrics`` is Prometheus' text
format; every request leaves one line in the access log (logger ``gpt2lab.serve.access``).
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import secrets
import socket
import threading
import time
from importlib import resources
from typing import AsyncIterator, Iterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from gpt2lab.inference.completion import PromptError, Sampling, check_ids
from gpt2lab.serve.engine import Failed, Finish, Job, QueueFull, Text, TimedOut, Work, Worker
from gpt2lab.serve.metrics import ServeMetrics
from gpt2lab.data.tokenizer import EOT_ID, get_tokenizer

MAX_N = 16  # choices per request (per prompt)
MAX_PROMPTS = 16
MAX_STOPS = 4  # as OpenAI
# A request body past this is refused (413) before it is read: GPT-2's longest context is
# 1024 tokens, a few KB of text; 1 MiB leaves room for token-id lists and many prompts.
MAX_BODY_BYTES = 1 << 20

ROUTES = ("/", "/metrics", "/v1/models", "/v1/completions")
access_log = logging.getLogger("gpt2lab.serve.access")


class CompletionRequest(BaseModel):
    """OpenAI's completion parameters; ``top_k`` is an extra (0 or absent keeps every token)."""
    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: Union[str, list[str], list[int], list[list[int]]] = "<|endoftext|>"
    max_tokens: Optional[int] = Field(16, ge=0)
    temperature: Optional[float] = Field(1.0, ge=0)
    top_p: Optional[float] = Field(1.0, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    n: Optional[int] = Field(1, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(None, ge=0, lt=2 ** 63)
    stream: Optional[bool] = False
    stream_options: Optional[dict] = None
    echo: Optional[bool] = False
    # accepted for compatibility only at their neutral values
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    presence_penalty: Optional[float] = 0
    frequency_penalty: Optional[float] = 0
    logit_bias: Optional[dict] = None
    suffix: Optional[str] = None
    user: Optional[str] = None


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=error_body(self.message, self.kind, self.param,
                                                                        self.code))


def error_body(message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    # a request's text may hold lone surrogates ("\ud800" in its JSON), which UTF-8 cannot encode:
    # they are shown escaped, so that the answer is still JSON
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _unsupported(req: CompletionRequest) -> None:
    checks = (("logprobs", req.logprobs is not None), ("best_of", req.best_of not in (None, 1, req.n)),
              ("presence_penalty", bool(req.presence_penalty)), ("frequency_penalty", bool(req.frequency_penalty)),
              ("logit_bias", bool(req.logit_bias)), ("suffix", bool(req.suffix)))
    for name, bad in checks:
        if bad:
            raise APIError(400, f"{name} is not supported by gpt2lab serve; leave it out", param=name)


def _prompts(req: CompletionRequest, vocab: int) -> tuple[list[list[int]], list[str]]:
    """Token ids of each prompt, and each prompt's text (for echo)."""
    p = req.prompt
    enc = get_tokenizer()
    texts = None
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(x, str) for x in p)):
        texts = [p] if isinstance(p, str) else p
        ids = [enc.encode(t, allowed_special={"<|endoftext|>"}) if t else [EOT_ID] for t in texts]  # as sample
    elif isinstance(p, list) and p and all(isinstance(x, int) for x in p):
        ids = [p]
    else:
        ids = list(p) if isinstance(p, list) else []
    if not ids or len(ids) > MAX_PROMPTS:
        raise APIError(400, f"prompt: pass 1 to {MAX_PROMPTS} prompts (text or token ids)", param="prompt")
    for one in ids:
        try:
            check_ids(one, vocab)
        except PromptError as e:
            raise APIError(400, f"prompt: {e}", param="prompt") from None
    return ids, texts or [enc.decode([t for t in one if t < enc.n_vocab]) for one in ids]


def _check_length(prompts: list[list[int]], max_tokens: int, worker: Worker) -> None:
    if max_tokens > worker.limits.max_tokens:
        raise APIError(400, f"max_tokens: this server gives at most {worker.limits.max_tokens} tokens per "
                            f"choice (--max-tokens); you asked for {max_tokens}", param="max_tokens")
    longest = max(len(p) for p in prompts)
    if longest + max_tokens > worker.block_size:
        raise APIError(400, f"This model's maximum context length is {worker.block_size} tokens; you asked "
                            f"for {longest + max_tokens} ({longest} in the prompt, {max_tokens} max_tokens). "
                            "Shorten the prompt or lower max_tokens.", param="max_tokens",
                       code="context_length_exceeded")


class Completion:
    """One validated request: its worker, its events, and the response id."""

    def __init__(self, req: CompletionRequest, workers: dict[str, Worker]) -> None:
        if req.model not in workers:
            raise APIError(404, f"The model {req.model!r} does not exist; this server has: "
                                f"{', '.join(workers)}", param="model", code="model_not_found")
        _unsupported(req)
        self.req, self.worker = req, workers[req.model]
        self.prompts, texts = _prompts(req, self.worker.model.config.real_vocab_size)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        _check_length(self.prompts, max_tokens, self.worker)
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > MAX_STOPS:
            raise APIError(400, f"stop: at most {MAX_STOPS} sequences", param="stop")
        self.sampling = Sampling(max_new_tokens=max_tokens, temperature=_or(req.temperature, 1.0),
                                 top_k=req.top_k, top_p=req.top_p)
        # without a seed each prompt draws its own (equal prompts get their own samples); with one,
        # every prompt starts from it, as `gpt2lab sample --seed` does
        self.seeds = ([req.seed] * len(self.prompts) if req.seed is not None
                      else [secrets.randbelow(2 ** 63) for _ in self.prompts])
        self.n = req.n or 1
        self.stops, self.echo = stops, texts if req.echo else []
        self.id, self.created = f"cmpl-{secrets.token_hex(12)}", int(time.time())

    def start(self) -> Job:
        """Hand the request to its worker; a full queue answers 429 at once."""
        work = Work(self.prompts, self.sampling, n=self.n, seeds=self.seeds, stops=self.stops, echo=self.echo)
        job = Job(work, asyncio.get_running_loop(), self.worker.limits.timeout_s)
        try:
            self.worker.submit(job)
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full", kind="server_busy") from None
        return job

    def usage(self, completion_tokens: int) -> dict:
        prompt_tokens = sum(len(p) for p in self.prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def chunk(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.req.model,
                "choices": choices, **extra}


def _or(value, default):
    return default if value is None else value


def _choice(index: int, text: str, finish: Optional[str]) -> dict:
    return {"text": text, "index": index, "logprobs": None, "finish_reason": finish}


async def _events(job: Job) -> AsyncIterator[Union[Text, Finish]]:
    try:
        while (event := await job.out.get()) is not None:
            if isinstance(event, Failed):
                raise event.error
            yield event
    finally:
        job.cancel()  # a client that went away frees its queue place now, its row or turn at the next step


async def _complete(c: Completion, job: Job) -> JSONResponse:
    texts = {i: [] for i in range(len(c.prompts) * c.n)}
    finish, tokens = {}, 0
    async for event in _events(job):
        if isinstance(event, Text):
            texts[event.index].append(event.text)
        else:
            finish[event.index], tokens = event.reason, tokens + event.tokens
    choices = [_choice(i, "".join(parts), finish.get(i)) for i, parts in texts.items()]
    return JSONResponse(c.chunk(choices, usage=c.usage(tokens)))


async def _stream(c: Completion, job: Job) -> AsyncIterator[str]:
    tokens = 0
    try:
        async for event in _events(job):
            if isinstance(event, Text):
                if event.text:
                    yield _sse(c.chunk([_choice(event.index, event.text, None)]))
            else:
                tokens += event.tokens
                yield _sse(c.chunk([_choice(event.index, "", event.reason)]))
        if (c.req.stream_options or {}).get("include_usage"):
            yield _sse(c.chunk([], usage=c.usage(tokens)))
    except TimedOut as e:  # headers are sent: report in the stream, as OpenAI does
        yield _sse(error_body(str(e), kind="timeout", code="timeout"))
    except Exception as e:
        yield _sse(error_body(f"generation failed: {e}", kind="server_error"))
    yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def create_app(workers: dict[str, Worker]) -> FastAPI:
    metrics = ServeMetrics()
    for w in workers.values():
        w.metrics = metrics
        metrics.watch(w)
    app = FastAPI(title="gpt2lab serve", docs_url=None, redoc_url=None)
    app.add_middleware(AccessLog, metrics=metrics)
    page = (resources.files("gpt2lab") / "assets" / "playground.html").read_text(encoding="utf-8")

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        kind = request.headers.get("content-type", "")
        if request.method == "POST" and kind.split(";")[0].strip().lower() != "application/json":
            got = f"Content-Type: {kind}" if kind else "no Content-Type header"
            return APIError(415, f"send the request body as JSON with the header Content-Type: application/json "
                                 f"(got {got})").response()
        return _validation_error(exc).response()

    @app.get("/", response_class=HTMLResponse)
    async def playground() -> str:
        return page

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "gpt2lab", "context_length": w.block_size}
            for name, w in workers.items()]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        c = Completion(req, workers)
        job = c.start()  # before the response starts, so that a full queue is a 429
        if req.stream:
            return StreamingResponse(_stream(c, job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            return await _complete(c, job)
        except APIError:
            raise
        except TimedOut as e:
            raise APIError(504, str(e), kind="timeout", code="timeout") from None
        except Exception as e:
            raise APIError(500, f"generation failed: {e}", kind="server_error") from e

    return app


def _validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's checks (malformed JSON, wrong types, out-of-range values) as one OpenAI error."""
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({first.get('msg')}); "
                             "send a JSON object with Content-Type: application/json")
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unrecognized request argument: {loc[0] if loc else '?'}", param=loc[0] if loc else None)
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return APIError(400, f"{where}: {first.get('msg')} (got {first.get('input')!r})", param=param)


class AccessLog:
    """ASGI middleware: refuses bodies over MAX_BODY_BYTES (413, before reading them), then logs one
    line per request when its response ends (a stream's too) and counts it in ``/metrics``."""

    def __init__(self, app, metrics: ServeMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.monotonic(), [0]
        size = dict(scope.get("headers") or []).get(b"content-length", b"0")

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if size.isdigit() and int(size) > MAX_BODY_BYTES:
                status[0] = 413
                response = JSONResponse(status_code=413, content=error_body(
                    f"the request body is {int(size)} bytes; this server takes at most {MAX_BODY_BYTES}"))
                await response(scope, receive, send)
            else:
                await self.app(scope, receive, sending)
        finally:
            client = scope.get("client") or ("-", 0)
            code = status[0] or 499  # 499: the client went away before a response started
            path = scope["path"] if scope["path"] in ROUTES else "other"  # bounded label values
            self.metrics.requests.labels(path, str(code)).inc()
            access_log.info('%s "%s %s" %d %.3fs', client[0], scope["method"], scope["path"], code,
                            time.monotonic() - t0)


@contextlib.contextmanager
def serving_in_thread(workers: dict[str, Worker], host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``workers`` with uvicorn in a background thread on a free port; yield the base URL
    (for tests and ``gpt2lab bench serve``). The workers are closed on exit."""
    sock = bind(host, 0)  # port 0: the OS picks a free port, held from here on
    server = make_server(workers)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server thread did not start")
            time.sleep(0.02)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        for w in workers.values():
            w.close()
        sock.close()


def make_server(workers: dict[str, Worker]):
    """The uvicorn server of ``workers``' app (run it on a socket from ``bind``). uvicorn.Server,
    not uvicorn.run: after its graceful shutdown uvicorn raises the Ctrl-C it caught again, and
    cli.main turns that KeyboardInterrupt into exit 130 (uvicorn.run ate it)."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(create_app(workers), log_level="warning"))


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port``; a port out of range, in use or not ours to take is a
    UsageError (exit 2) naming --port or --host, not uvicorn's log line and exit 3."""
    from gpt2lab.system.errors import UsageError

    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port}: must be 0 to 65535 (0 lets the system pick a free one)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart at once after a stop
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            why = "is in use (another server?); stop it or pick another --port"
        elif e.errno in (errno.EACCES, errno.EPERM):
            why = "cannot be taken by this user (ports below 1024 need privileges); pick a --port above 1023"
        elif e.errno == errno.EADDRNOTAVAIL:
            raise UsageError(f"--host {host}: not an address of this machine; use 127.0.0.1 or 0.0.0.0") from None
        else:
            why = f"cannot be bound ({e.strerror})"
        raise UsageError(f"--port {port} on {host} {why}") from None
    sock.set_inheritable(True)
    return sock
