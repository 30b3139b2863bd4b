"""OpenAI's answers: the error body (``APIError``), a choice's ``logprobs``, a whole completion or chat
completion, and the server-sent events of a stream (an error after the headers went out is an
event, then ``[DONE]``); ``respond`` answers one started request, whole or streamed, and frees its
row when the client hangs up before the answer is whole."""
from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gpt2lab.inference.completion import TokenLogprob, TokenText, tokenizer_for
from gpt2lab.serve.engine import Failed, Finish, Job, ShuttingDown, Text, TimedOut

if TYPE_CHECKING:  # for the type hints only: completions.py imports this module
    from gpt2lab.serve.completions import ChatCompletion, Completion


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


async def whole_completion(c: Completion, job: Job) -> dict:
    texts, finish, tokens, logprobs = await _collect(c, job)
    choices = [_choice(i, text, finish.get(i), logprobs[i].whole if logprobs else None) for i, text in texts.items()]
    return c.chunk(choices, usage=c.usage(tokens))


async def whole_chat(c: ChatCompletion, job: Job) -> dict:
    texts, finish, tokens, _ = await _collect(c, job)
    choices = [{"index": i, "message": {"role": "assistant", "content": text.lstrip() if c.strip else text},
                "logprobs": None,
                "finish_reason": finish.get(i)} for i, text in texts.items()]
    return {**c.chunk(choices, usage=c.usage(tokens)), "object": "chat.completion"}


async def stream_completion(c: Completion, job: Job) -> AsyncIterator[str]:
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


async def stream_chat(c: ChatCompletion, job: Job) -> AsyncIterator[str]:
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
        e = shutting_down(e)
        yield _sse(error_body(e.message, e.kind, code=e.code))
    except Exception as e:
        yield _sse(error_body(f"generation failed: {e}", kind="server_error"))
    yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def shutting_down(e: ShuttingDown) -> APIError:
    return APIError(503, str(e), kind="server_error", code="server_shutting_down")


async def respond(c: Completion, stream, whole, request: Request):
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
        raise shutting_down(e) from None
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
