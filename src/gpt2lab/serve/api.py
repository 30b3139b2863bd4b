"""The FastAPI app: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, and
the playground at ``/``.

Responses and stream chunks have OpenAI's shapes, so the official ``openai`` client, curl and
lm-evaluation-harness's ``local-completions`` work unchanged. Every bad request gets a 4xx with
OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` (an unknown route 404, a
wrong method 405) and the server goes on serving; a full queue gets 429 at once, a request past
the timeout 504, a body past MAX_BODY_BYTES 413 however it is framed. A client that hangs up frees
its row, streamed or not. ``/metrics`` is Prometheus' text format; every request leaves one line
in the access log (logger ``gpt2lab.serve.access``).
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import re
import secrets
import socket
import threading
import time
from importlib import resources
from typing import AsyncIterator, Awaitable, Iterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from gpt2lab.inference import chat
from gpt2lab.data.tokenizer import short
from gpt2lab.inference.completion import (PromptError, Sampling, TokenLogprob, TokenText, check_ids, encode_prompt,
                                          fits_context, prompt_text, tokenizer_for)
from gpt2lab.serve.engine import (Engine, Failed, Finish, Job, QueueFull, ShuttingDown, Text, TimedOut, Work,
                                  Worker)
from gpt2lab.serve.metrics import ServeMetrics

MAX_N = 16  # choices per request (per prompt)
MAX_PROMPTS = 16
MAX_STOPS = 4  # as OpenAI
MAX_LOGPROBS = 5  # as OpenAI's completions
# A request body past this is refused (413), unread when its Content-Length says so, else as soon
# as this much has come: GPT-2's longest context is 1024 tokens, a few KB of text; 1 MiB leaves
# room for token-id lists and many prompts.
MAX_BODY_BYTES = 1 << 20

ROUTES = ("/", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")
access_log = logging.getLogger("gpt2lab.serve.access")


class CompletionRequest(BaseModel):
    """OpenAI's completion parameters; ``top_k`` is an extra (0 or absent keeps every token). Strict:
    ``true`` is not an integer (pydantic's lax mode takes it as 1), nor ``1`` a boolean."""
    model_config = ConfigDict(extra="forbid", strict=True)

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
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    # accepted for compatibility only at their neutral values
    best_of: Optional[int] = None
    presence_penalty: Optional[float] = 0
    frequency_penalty: Optional[float] = 0
    logit_bias: Optional[dict] = None
    suffix: Optional[str] = None
    user: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: str
    content: Union[str, list[dict], None] = None
    name: Optional[str] = None  # OpenAI's participant name: accepted, not written into the template


class ChatRequest(BaseModel):
    """OpenAI's chat parameters (the ones a plain-text template can honour); ``top_k`` is an extra."""
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    messages: list[ChatMessage]
    max_tokens: Optional[int] = Field(None, ge=1)  # None: the rest of the context, up to --max-tokens
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # OpenAI's newer name for it
    temperature: Optional[float] = Field(1.0, ge=0)
    top_p: Optional[float] = Field(1.0, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    n: Optional[int] = Field(1, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(None, ge=0, lt=2 ** 63)
    stream: Optional[bool] = False
    stream_options: Optional[dict] = None
    # accepted for compatibility only at their neutral values
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    presence_penalty: Optional[float] = 0
    frequency_penalty: Optional[float] = 0
    logit_bias: Optional[dict] = None
    response_format: Optional[dict] = None  # {"type": "text"} only (OpenAI's default)
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


def _unsupported(checks: tuple[tuple[str, bool], ...]) -> None:
    for name, bad in checks:
        if bad:
            raise APIError(400, f"{name} is not supported by gpt2lab serve; leave it out", param=name)


def _prompts(req: CompletionRequest, model) -> tuple[list[list[int]], list[str]]:
    """Token ids of each prompt for ``model``, and each prompt's text (for echo and
    logprobs' text offsets)."""
    p, vocab = req.prompt, model.config.real_vocab_size
    texts = None
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(x, str) for x in p)):
        texts = [prompt_text(t) for t in ([p] if isinstance(p, str) else p)]  # a lone surrogate is U+FFFD
        ids = [encode_prompt(t, model) for t in texts]  # as sample
    elif isinstance(p, list) and p and all(isinstance(x, int) for x in p):
        ids = [p]
    else:
        ids = list(p) if isinstance(p, list) else []
    if not ids or len(ids) > MAX_PROMPTS:
        raise APIError(400, f"prompt: pass 1 to {MAX_PROMPTS} prompts (text or token ids)", param="prompt")
    for i, one in enumerate(ids):
        try:
            check_ids(one, vocab, from_text=texts is not None, tokenizer=short(model.config.tokenizer))
        except PromptError as e:
            where = f"prompt[{i}]" if len(ids) > 1 else "prompt"
            raise APIError(400, f"{where}: {e}", param="prompt") from None
    return ids, texts or [_decode(one, model) for one in ids]


def _decode(ids: list[int], model) -> str:
    """The text of token ids as the tokens' text is streamed (TokenText: ids past the tokenizer's as <|id|>)."""
    text = TokenText(model)
    return "".join(text.feed(t) for t in ids) + text.flush()


def _check_length(prompts: list[list[int]], max_tokens: int, worker: Worker, default: bool, what: str) -> None:
    """Refuse a request past --max-tokens or the model's context, saying what it asked: ``default``
    when the request left max_tokens out; ``what`` names its prompt ("prompt" or "messages")."""
    said = f"max_tokens' default of {max_tokens}" if default else f"max_tokens {max_tokens}"
    if max_tokens > worker.limits.max_tokens:
        raise APIError(400, f"max_tokens: this server gives at most {worker.limits.max_tokens} tokens per "
                            f"choice (--max-tokens); you asked for {said}", param="max_tokens")
    longest, block = max(len(p) for p in prompts), worker.block_size
    if longest > block or (longest == block and max_tokens > 0):  # no max_tokens could make it fit
        alone = {"prompt": f"the {'longest ' if len(prompts) > 1 else ''}prompt alone takes {longest} tokens",
                 "messages": f"the messages alone take {longest} tokens (as the chat template writes them)"}[what]
        room = "" if longest > block else ", which leaves no room for a completion"
        raise APIError(400, f"This model's maximum context length is {block} tokens, and {alone}{room}. "
                            f"Shorten the {what}.", param=what, code="context_length_exceeded")
    if not fits_context(longest, max_tokens, block):
        raise APIError(400, f"This model's maximum context length is {block} tokens; you asked for "
                            f"{longest + max_tokens} ({longest} in the {what}, {said}). Shorten the {what} or "
                            "lower max_tokens.", param="max_tokens", code="context_length_exceeded")


def _stops(stop: Optional[Union[str, list[str]]]) -> list[str]:
    stops = [prompt_text(s) for s in ([stop] if isinstance(stop, str) else list(stop or []))]
    if len(stops) > MAX_STOPS:
        raise APIError(400, f"stop: at most {MAX_STOPS} sequences", param="stop")
    return stops


def _worker(model: str, workers: dict[str, Worker]) -> Worker:
    if model not in workers:
        raise APIError(404, f"The model {model!r} does not exist; this server has: "
                            f"{', '.join(workers)}", param="model", code="model_not_found")
    return workers[model]


class Completion:
    """One validated completion request: its worker, its work, and the response id."""

    def __init__(self, req: CompletionRequest, workers: dict[str, Worker]) -> None:
        self.req, self.worker = req, _worker(req.model, workers)
        _unsupported((("best_of", req.best_of not in (None, 1, req.n)),
                      ("presence_penalty", bool(req.presence_penalty)),
                      ("frequency_penalty", bool(req.frequency_penalty)),
                      ("logit_bias", bool(req.logit_bias)), ("suffix", bool(req.suffix))))
        self.prompts, self.texts = _prompts(req, self.worker.model)
        default = req.max_tokens is None or "max_tokens" not in req.model_fields_set
        self._prepare(16 if req.max_tokens is None else req.max_tokens, _stops(req.stop),
                      echo=self.texts if req.echo else [], logprobs=req.logprobs, default=default)
        self.id = f"cmpl-{secrets.token_hex(12)}"

    def _prepare(self, max_tokens: int, stops: list[str], echo: list[str], logprobs: Optional[int],
                 default: bool, what: str = "prompt") -> None:
        """The work of ``self.prompts`` with the request's sampling settings (shared with chat)."""
        req = self.req
        _check_length(self.prompts, max_tokens, self.worker, default, what)
        self.sampling = Sampling(max_new_tokens=max_tokens, temperature=_or(req.temperature, 1.0),
                                 top_k=req.top_k, top_p=req.top_p)
        # without a seed each prompt draws its own (equal prompts get their own samples); with one,
        # every prompt starts from it, as `gpt2lab sample --seed` does
        seeds = ([req.seed] * len(self.prompts) if req.seed is not None
                 else [secrets.randbelow(2 ** 63) for _ in self.prompts])
        self.n = req.n or 1
        self.work = Work(self.prompts, self.sampling, n=self.n, seeds=seeds, stops=stops, echo=echo,
                         logprobs=logprobs)
        self.created = int(time.time())

    def start(self) -> Job:
        """Hand the request to its worker; a full queue answers 429 at once."""
        job = Job(self.work, asyncio.get_running_loop(), self.worker.limits.timeout_s)
        try:
            self.worker.submit(job)
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full", kind="server_busy") from None
        except ShuttingDown as e:
            raise _shutting_down(e) from None
        return job

    def usage(self, completion_tokens: int) -> dict:
        prompt_tokens = sum(len(p) for p in self.prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def chunk(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.req.model,
                "choices": choices, **extra}

    def logprobs(self) -> dict[int, "Logprobs"]:
        """Each choice's logprobs, built as its tokens come (empty without ``logprobs``). Text offsets
        count from the start of the prompt, echoed or not, as OpenAI's do."""
        if self.work.logprobs is None:
            return {}
        return {i: Logprobs(0 if self.work.echo else len(self.texts[i // self.n]), self.worker.model)
                for i in range(len(self.prompts) * self.n)}


class ChatCompletion(Completion):
    """One validated chat request: the messages in the model's chat template as one prompt (inference/chat.py)."""

    def __init__(self, req: ChatRequest, workers: dict[str, Worker]) -> None:
        self.req, self.worker = req, _worker(req.model, workers)
        _unsupported((("logprobs", bool(req.logprobs)), ("top_logprobs", req.top_logprobs is not None),
                      ("presence_penalty", bool(req.presence_penalty)),
                      ("frequency_penalty", bool(req.frequency_penalty)), ("logit_bias", bool(req.logit_bias))))
        if req.response_format is not None and req.response_format.get("type") != "text":
            raise APIError(400, "response_format: only {\"type\": \"text\"} is supported (a base model cannot be "
                                f"held to a format); got {req.response_format!r}", param="response_format")
        if not req.messages:
            raise APIError(400, "messages: pass at least one message", param="messages")
        try:  # text in a message is text: "<|endoftext|>" or "<|im_end|>" typed there cannot end a turn
            prompt = chat.chat_prompt(self.worker.model, [(m.role, _content(i, m)) for i, m in enumerate(req.messages)])
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        ids, text, self.strip = prompt.ids, prompt.text, prompt.strip
        try:
            check_ids(ids, self.worker.model.config.real_vocab_size)
        except PromptError as e:
            raise APIError(400, f"messages: {e}", param="messages") from None
        self.prompts, self.texts = [ids], [text]
        max_tokens = req.max_completion_tokens or req.max_tokens
        default = max_tokens is None
        if default:  # as OpenAI: what the context leaves, here up to --max-tokens
            max_tokens = max(1, min(self.worker.limits.max_tokens, self.worker.block_size - len(ids)))
        self._prepare(max_tokens, [*_stops(req.stop), *prompt.stops], echo=[], logprobs=None, default=default,
                      what="messages")
        self.id = f"chatcmpl-{secrets.token_hex(12)}"

    def chunk(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.req.model,
                "choices": choices, **extra}


def _content(i: int, m: ChatMessage) -> str:
    """A message's text: a string, or the text of its ``{"type": "text"}`` parts (a lone surrogate
    as U+FFFD, as in a prompt)."""
    if m.content is None or isinstance(m.content, str):
        return prompt_text(m.content or "")
    parts = []
    for part in m.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                             f"are supported, got {part.get('type')!r}")
        parts.append(prompt_text(part["text"]))
    return "".join(parts)


def token_str(t: int, model) -> str:
    """A token as OpenAI's logprobs name it: its text, or ``bytes:\\xNN...`` for bytes that are not
    whole UTF-8 characters (a character split across tokens); ids past the model's tokenizer's as ``<|id|>``."""
    enc = tokenizer_for(model)
    if t >= enc.n_vocab:
        return f"<|{t}|>"
    raw = enc.decode_single_token_bytes(t)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class Logprobs:
    """One choice's ``logprobs`` in OpenAI's completions shape, token by token: ``tokens``,
    ``token_logprobs`` (None for an echoed prompt's first token: nothing predicts it), ``top_logprobs``
    (the ``logprobs`` most likely tokens, and the token itself when it is not among them, as OpenAI:
    up to logprobs + 1 entries; None where the logprob is) and ``text_offset`` (where each token's
    text starts)."""

    def __init__(self, offset: int, model) -> None:
        self.offset, self.text, self.model = offset, TokenText(model), model
        self.whole: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(self, entries: list[TokenLogprob]) -> dict:
        """The part of ``entries`` (in the shape of the whole), which the whole takes on."""
        part: dict[str, list] = {key: [] for key in self.whole}
        for e in entries:
            part["tokens"].append(token_str(e.token, self.model))
            part["token_logprobs"].append(e.logprob)
            top = None
            if e.logprob is not None:
                top = {token_str(t, self.model): lp for t, lp in e.top}
                top.setdefault(token_str(e.token, self.model), e.logprob)
            part["top_logprobs"].append(top)
            part["text_offset"].append(self.offset)
            self.offset += len(self.text.feed(e.token))
        for key, values in part.items():
            self.whole[key] += values
        return part


def _or(value, default):
    return default if value is None else value


def _choice(index: int, text: str, finish: Optional[str], logprobs: Optional[dict] = None) -> dict:
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}


async def _events(job: Job) -> AsyncIterator[Union[Text, Finish]]:
    try:
        while (event := await job.out.get()) is not None:
            if isinstance(event, Failed):
                raise event.error
            yield event
    finally:
        job.cancel()  # a client that went away frees its queue place now, its row or turn at the next step


async def _collect(c: Completion, job: Job) -> tuple[dict[int, str], dict[int, str], int, dict[int, Logprobs]]:
    """Every choice's text, finish reason and logprobs, and the completion tokens of a request."""
    texts = {i: [] for i in range(len(c.prompts) * c.n)}
    finish, tokens, logprobs = {}, 0, c.logprobs()
    async for event in _events(job):
        if isinstance(event, Text):
            texts[event.index].append(event.text)
            if event.logprobs and logprobs:
                logprobs[event.index].add(event.logprobs)
        else:
            finish[event.index], tokens = event.reason, tokens + event.tokens
    return {i: "".join(parts) for i, parts in texts.items()}, finish, tokens, logprobs


async def _complete(c: Completion, job: Job) -> dict:
    texts, finish, tokens, logprobs = await _collect(c, job)
    choices = [_choice(i, text, finish.get(i), logprobs[i].whole if logprobs else None) for i, text in texts.items()]
    return c.chunk(choices, usage=c.usage(tokens))


async def _complete_chat(c: ChatCompletion, job: Job) -> dict:
    texts, finish, tokens, _ = await _collect(c, job)
    choices = [{"index": i, "message": {"role": "assistant", "content": text.lstrip() if c.strip else text},
                "logprobs": None,
                "finish_reason": finish.get(i)} for i, text in texts.items()]
    return {**c.chunk(choices, usage=c.usage(tokens)), "object": "chat.completion"}


async def _stream(c: Completion, job: Job) -> AsyncIterator[str]:
    tokens, logprobs = 0, c.logprobs()
    async for event in _events(job):
        if isinstance(event, Text):
            if event.text or event.logprobs:  # a token's chunk carries its logprobs, text or not
                part = logprobs[event.index].add(event.logprobs or []) if logprobs else None
                yield _sse(c.chunk([_choice(event.index, event.text, None, part)]))
        else:
            tokens += event.tokens
            yield _sse(c.chunk([_choice(event.index, "", event.reason)]))
    if (c.req.stream_options or {}).get("include_usage"):
        yield _sse(c.chunk([], usage=c.usage(tokens)))


async def _stream_chat(c: ChatCompletion, job: Job) -> AsyncIterator[str]:
    def delta(index: int, content: dict, finish: Optional[str] = None) -> str:
        return _sse(c.chunk([{"index": index, "delta": content, "logprobs": None, "finish_reason": finish}]))

    choices = range(len(c.prompts) * c.n)
    for i in choices:  # as OpenAI: each choice opens with the role
        yield delta(i, {"role": "assistant", "content": ""})
    tokens, started = 0, {i: False for i in choices}
    async for event in _events(job):
        if isinstance(event, Text):
            # a base model's reply loses its leading space (the plain template)
            text = event.text if started[event.index] or not c.strip else event.text.lstrip()
            started[event.index] = started[event.index] or bool(text)
            if text:
                yield delta(event.index, {"content": text})
        else:
            tokens += event.tokens
            yield delta(event.index, {}, event.reason)
    if (c.req.stream_options or {}).get("include_usage"):
        yield _sse(c.chunk([], usage=c.usage(tokens)))


async def _sse_stream(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's events, then ``[DONE]``; an error after the headers went out is an event, as OpenAI's."""
    try:
        async for chunk in chunks:
            yield chunk
    except TimedOut as e:
        yield _sse(error_body(str(e), kind="timeout", code="timeout"))
    except ShuttingDown as e:
        e = _shutting_down(e)
        yield _sse(error_body(e.message, e.kind, code=e.code))
    except Exception as e:
        yield _sse(error_body(f"generation failed: {e}", kind="server_error"))
    yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _shutting_down(e: ShuttingDown) -> APIError:
    return APIError(503, str(e), kind="server_error", code="server_shutting_down")


async def _respond(c: Completion, stream, whole, request: Request):
    """Start ``c`` (before the response starts, so that a full queue is a 429), then stream it or
    answer once; errors as OpenAI's JSON."""
    job = c.start()
    if c.req.stream:  # StreamingResponse watches for the client's hang-up itself
        return StreamingResponse(_sse_stream(stream(c, job)), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        answer = await _unless_hung_up(whole(c, job), request)
    except APIError:
        raise
    except TimedOut as e:
        raise APIError(504, str(e), kind="timeout", code="timeout") from None
    except ShuttingDown as e:
        raise _shutting_down(e) from None
    except Exception as e:
        raise APIError(500, f"generation failed: {e}", kind="server_error") from e
    return Response(status_code=499) if answer is None else JSONResponse(answer)  # 499: nobody to answer


async def _unless_hung_up(work: Awaitable[dict], request: Request) -> Optional[dict]:
    """``work``'s answer, or None when the client hangs up first: ``work`` is then cancelled, and its
    job with it (_events), so that its queue place is free now and its row at the worker's next step."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_hang_up(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its job is cancelled once this returns
    return None if task.cancelled() else task.result()


async def _hang_up(request: Request) -> None:
    """Returns when the client has gone: the body is read, so the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """Routing's own errors (an unknown route, a wrong method, a body that is not text) in OpenAI's
        error body."""
        where = f"{request.method} {request.url.path}"
        bad = exc.__cause__  # FastAPI's "error parsing the body" keeps what went wrong here
        if isinstance(bad, UnicodeDecodeError):
            message = (f"the request body is not UTF-8 JSON: byte {bad.object[bad.start]:#04x} at position "
                       f"{bad.start} is not UTF-8; send the JSON encoded as UTF-8")
        elif exc.status_code == 404:
            message = f"Invalid URL ({where}): this server answers {', '.join(ROUTES)}"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "another method")
            message = f"Method not allowed ({where}): this route takes {allowed}"
        else:
            message = f"{where}: {exc.detail}"
        return JSONResponse(status_code=exc.status_code, content=error_body(message), headers=exc.headers)

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
            {"id": name, "object": "model", "created": 0, "owned_by": "gpt2lab", "context_length": w.block_size,
             "chat_template": w.model.config.chat_template, "note": chat.note(w.model.config), **_inference(w)}
            for name, w in workers.items()]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await _respond(Completion(req, workers), _stream, _complete, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        return await _respond(ChatCompletion(req, workers), _stream_chat, _complete_chat, request)

    return app


def _inference(worker: Worker) -> dict:
    """How the worker's model is held (inference/choice.py's decision and its measured figures), where it was
    decided (serve/models.py)."""
    return {"inference": worker.decision.record()} if worker.decision is not None else {}


# What a union-typed field takes, for an error that fits none of its types (pydantic reports one per type)
UNIONS = {"prompt": "text, a list of texts, a list of token ids (integers) or a list of such lists",
          "stop": "a string or a list of strings", "content": 'a string, a list of {"type": "text"} parts or null'}
# The tags pydantic puts in an error's location for a union's member types: "str", "list[int]", ...
_MEMBER = re.compile(r"(str|int|float|bool|dict|list|none)(\[.*\])?")


def _where(loc: tuple) -> tuple[str, bool]:
    """An error's location as OpenAI names it ("messages[0].content"), and whether it went into a
    union's member types (left out of the name)."""
    path = ""
    for x in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(x, int):
            path += f"[{x}]"
        elif _MEMBER.fullmatch(str(x)):
            return path, True
        else:
            path += f".{x}" if path else str(x)
    return path, False


def _validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's checks (malformed JSON, wrong types, out-of-range values) as one OpenAI error."""
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({first.get('msg')}); "
                             "send a JSON object with Content-Type: application/json")
    where, union = _where(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unrecognized request argument: {where or '?'}", param=where or None)
    msg = first.get("msg")
    if union:
        field = re.sub(r".*[.\]]", "", where)  # "messages[0].content" -> "content"
        msg = f"expected {UNIONS.get(field, 'another type')}"
    return APIError(400, f"{where or 'body'}: {msg} (got {first.get('input')!r})", param=where or None)


class BodyTooLarge(Exception):
    pass


# A body not whole this many seconds after its request began is refused (408): a client that opens
# requests and trickles their bodies (or never ends them) would otherwise hold a connection and its
# buffer for as long as it likes. The largest body taken, 1 MiB, arrives in well under a second on
# any link a server is reached over; 30 s leaves room for a slow one (35 KB/s).
BODY_TIMEOUT_S = 30.0
# A body refused for its size is still read, and thrown away, up to this many bytes more (for at most
# DRAIN_S seconds) before the 413: a server that closes a connection with unread data in it makes
# the kernel reset it, and the client, still sending, never reads its answer. Nothing read is kept.
DRAIN_BYTES, DRAIN_S = 8 << 20, 2.0


async def _drain(receive) -> None:
    """Read and discard what is left of a request's body, DRAIN_BYTES at most."""
    n = 0
    while n < DRAIN_BYTES:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return
        n += len(message.get("body", b""))


async def read_body(scope, receive) -> Optional[bytes]:
    """The request's body, read whole whatever its framing (Content-Length or chunked); None if the
    client left while sending it. Past MAX_BODY_BYTES, BodyTooLarge: unread when Content-Length says
    so, else as soon as that much has come, so no more than that is ever held."""
    size = dict(scope.get("headers") or []).get(b"content-length", b"")
    if size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise BodyTooLarge(f"the request body is {int(size)} bytes; this server takes at most {MAX_BODY_BYTES}")
    parts, n = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        n += len(message.get("body", b""))
        if n > MAX_BODY_BYTES:
            raise BodyTooLarge(f"the request body is over {MAX_BODY_BYTES} bytes (read {n} before stopping); "
                               f"this server takes at most {MAX_BODY_BYTES}")
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive):
    """An ASGI receive that gives ``body`` as one message, then the client's own messages (its disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()
    return replay


class AccessLog:
    """ASGI middleware: reads each request's body, refusing one over MAX_BODY_BYTES (413) however it
    is framed (read_body), then logs one line per request and counts it in ``/metrics`` as its
    response's last part goes out (a stream's too): before the client has it all, so what the client
    does next is logged after it."""

    def __init__(self, app, metrics: ServeMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status, logged = time.monotonic(), [0], [False]

        def finished() -> None:  # once per request: counted and logged
            if logged[0]:
                return
            logged[0] = True
            client = scope.get("client") or ("-", 0)
            code = status[0] or 499  # 499: the client went away before a response started
            path = scope["path"] if scope["path"] in ROUTES else "other"  # bounded label values
            self.metrics.requests.labels(path, str(code)).inc()
            access_log.info('%s "%s %s" %d %.3fs', client[0], scope["method"], scope["path"], code,
                            time.monotonic() - t0)

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished()  # before the client has the whole answer: its next request (or signal) comes after
            await send(message)

        try:
            try:
                body = await asyncio.wait_for(read_body(scope, receive), BODY_TIMEOUT_S)
            except BodyTooLarge as e:  # Connection: close, so that the server reads no more of it than _drain
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(_drain(receive), DRAIN_S)
                response = JSONResponse(status_code=413, content=error_body(str(e)), headers={"Connection": "close"})
                return await response(scope, receive, sending)
            except asyncio.TimeoutError:
                response = JSONResponse(status_code=408, headers={"Connection": "close"}, content=error_body(
                    f"the request body was not whole {BODY_TIMEOUT_S:g} s after the request began; send it at once",
                    code="request_timeout"))
                return await response(scope, receive, sending)
            if body is not None:  # else the client left before its request was whole: nothing to answer
                await self.app(scope, _replay(body, receive), sending)
        finally:
            finished()  # a request that ended without its last body (the client left, an error)


@contextlib.contextmanager
def serving_in_thread(workers: dict[str, Worker], host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``workers`` with uvicorn and their engine each in a background thread on a free port;
    yield the base URL (for tests). The workers are closed on exit."""
    engine = Engine(workers).start()
    with _uvicorn_in_thread(workers, bind(host, 0)) as url:  # port 0: the OS picks a free port
        try:
            yield url
        finally:
            engine.close()


def serve_here(workers: dict[str, Worker], sock: socket.socket, client=None, stopping=None) -> None:
    """Serve ``workers`` on ``sock``: uvicorn from a background thread, the models from this one (the
    Engine's docstring says why this thread). With ``client`` (a function of the base URL), run it in
    a third thread and stop when it returns (``gpt2lab bench serve``); without, serve until Ctrl-C.
    Ctrl-C stops the models at once; every open request ends with a "server shutting down" error (a
    stream's last event before ``[DONE]``, else a 503), ``stopping`` (if given) is called with how
    many, and the KeyboardInterrupt is raised again once uvicorn has sent those and stopped."""
    engine = Engine(workers)
    with _uvicorn_in_thread(workers, sock, stopping) as url:
        if client is not None:
            errors: list[BaseException] = []

            def drive() -> None:
                try:
                    client(url)
                except BaseException as e:  # handed to the caller below
                    errors.append(e)
                finally:
                    for w in workers.values():
                        w.close()

            threading.Thread(target=drive, name="gpt2lab-serve-client", daemon=True).start()
        try:
            engine.run()  # Ctrl-C stops it here; _uvicorn_in_thread ends the open requests
        finally:
            for w in workers.values():
                w.close()
    if client is not None and errors:
        raise errors[0]


@contextlib.contextmanager
def _uvicorn_in_thread(workers: dict[str, Worker], sock: socket.socket, stopping=None) -> Iterator[str]:
    """uvicorn serving ``workers``' app on ``sock`` from a thread; yields the base URL once it accepts.
    A KeyboardInterrupt (from the start-up wait or the caller's block, where the engine runs) ends the
    workers' open requests with ShuttingDown and tells ``stopping`` how many, before uvicorn stops."""
    server = make_server(workers)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    host, port = sock.getsockname()[:2]
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server thread did not start")
            time.sleep(0.02)
        yield f"http://{f'[{host}]' if ':' in host else host}:{port}"
    except KeyboardInterrupt:  # nothing will answer the open requests now: end them, so that uvicorn can drain
        error = ShuttingDown("server shutting down: the request was ended before it finished; retry it later")
        ended = sum(w.shut_down(error) for w in workers.values())
        if stopping is not None:
            stopping(ended)
        raise
    finally:
        server.should_exit = True
        thread.join(timeout=10)
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
