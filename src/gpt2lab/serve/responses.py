"""OpenAI's answers: a whole completion or chat completion, and the server-sent events of a stream (an error
after the headers went out is an event, then ``[DONE]``); ``respond`` answers one started request, whole or
streamed, and frees its row when the client hangs up before the answer is whole."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Awaitable, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gpt2lab.serve.completions import ChatCompletion, Completion
from gpt2lab.serve.engine import Finish, Job, ShuttingDown, Text, TimedOut
from gpt2lab.serve.errors import APIError, error_body, shutting_down
from gpt2lab.serve.logprobs import KEYS


def _choice(index: int, text: str, finish: Optional[str], logprobs: Optional[dict] = None) -> dict:
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}


async def _events(job: Job) -> AsyncIterator[Union[Text, Finish]]:
    try:
        while (event := await job.out.get()) is not None:
            if isinstance(event, BaseException):
                raise event
            yield event
    finally:
        job.cancel()  # a client that went away frees its queue place now, its row or turn at the next step


async def stream_completion(c: Completion, job: Job) -> AsyncIterator[dict]:
    """A completion's chunks as its events come: a piece of a choice's text (with its tokens' logprobs), a
    choice's finish; then the usage."""
    tokens, logprobs = 0, c.logprobs()
    async for event in _events(job):
        if isinstance(event, Text):
            if event.text or event.logprobs:  # a token's chunk carries its logprobs, text or not
                part = logprobs[event.index].add(event.logprobs or []) if logprobs else None
                yield c.chunk([_choice(event.index, event.text, None, part)])
        else:
            tokens += event.tokens
            yield c.chunk([_choice(event.index, "", event.reason)])
    yield c.chunk([], usage=c.usage(tokens))


async def stream_chat(c: ChatCompletion, job: Job) -> AsyncIterator[dict]:
    """A chat completion's chunks, as ``stream_completion``'s, in chat's shape."""

    def delta(index: int, content: dict, finish: Optional[str] = None) -> dict:
        return c.chunk([{"index": index, "delta": content, "logprobs": None, "finish_reason": finish}])

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
    yield c.chunk([], usage=c.usage(tokens))


async def _whole(c: Completion, chunks: AsyncIterator[dict]) -> dict:
    """The answer of a request not streamed: its chunks folded into one, each choice's text (a chat's as its
    message), logprobs and finish reason, and the usage."""
    count = len(c.prompts) * c.n
    texts, finish = [""] * count, [None] * count
    logprobs = [None if c.work.logprobs is None else {key: [] for key in KEYS} for _ in range(count)]
    async for chunk in chunks:
        for part in chunk["choices"]:
            i = part["index"]
            texts[i] += part["text"] if "text" in part else part["delta"].get("content", "")
            finish[i] = part["finish_reason"] or finish[i]
            for key, values in (part["logprobs"] or {}).items():
                logprobs[i].setdefault(key, []).extend(values)
    if not isinstance(c, ChatCompletion):
        return c.chunk([_choice(i, texts[i], finish[i], logprobs[i]) for i in range(count)], usage=chunk["usage"])
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": texts[i]},
            "logprobs": None,
            "finish_reason": finish[i],
        }
        for i in range(count)
    ]
    return {**c.chunk(choices, usage=chunk["usage"]), "object": "chat.completion"}


async def _sse_stream(c: Completion, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """A stream's events (the usage where the request asks for it), then ``[DONE]``; an error after the
    headers went out is an event, as OpenAI's."""
    usage = (c.req.stream_options or {}).get("include_usage")
    try:
        async for chunk in chunks:
            if chunk["choices"] or usage:
                yield _sse(chunk)
    except Exception as e:
        e = _api_error(e)
        yield _sse(error_body(e.message, e.kind, code=e.code))
    yield "data: [DONE]\n\n"


def _api_error(e: Exception) -> APIError:
    """What a request that failed while it ran answers: 504 past its time, 503 at a shutdown, else 500."""
    if isinstance(e, TimedOut):
        return APIError(504, str(e), kind="timeout", code="timeout")
    return (
        shutting_down(e)
        if isinstance(e, ShuttingDown)
        else APIError(500, f"generation failed: {e}", kind="server_error")
    )


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def respond(c: Completion, request: Request):
    """Start ``c`` (before the response starts, so that a full queue is a 429), then stream it or
    answer once; errors as OpenAI's JSON."""
    job = c.start()
    chunks = (stream_chat if isinstance(c, ChatCompletion) else stream_completion)(c, job)
    if c.req.stream:  # StreamingResponse watches for the client's hang-up itself
        return StreamingResponse(
            _sse_stream(c, chunks),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        answer = await _unless_hung_up(_whole(c, chunks), request)
    except APIError:
        raise
    except Exception as e:
        raise _api_error(e) from e
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
