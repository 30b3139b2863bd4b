"""OpenAI's answers: a whole completion or chat completion, and the server-sent events of a stream (an error
after the headers went out is an event, then ``[DONE]``); ``respond`` answers one started request, whole or
streamed, and frees its row when the client hangs up before the answer is whole."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Awaitable, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gpt2lab.serve.completions import KEYS, ChatCompletion, Completion
from gpt2lab.serve.errors import error_body, failed
from gpt2lab.serve.jobs import Finish


async def _parts(c: Completion) -> AsyncIterator[tuple[int, str, Optional[str], Optional[dict]]]:
    """(choice, text, finish reason, logprobs part) as the request's events come: a piece of a choice's text
    with its tokens' logprobs (a base model's chat reply without its leading space: the plain template), or a
    choice's finish, its tokens counted in ``c.tokens``."""
    job, logprobs, started = c.job, c.logprobs(), set()
    try:
        while (event := await job.out.get()) is not None:
            if isinstance(event, BaseException):
                raise event
            i = event.index
            if isinstance(event, Finish):
                c.tokens += event.tokens
                yield i, "", event.reason, None
                continue
            text = event.text if i in started or not c.strip else event.text.lstrip()
            if text:
                started.add(i)
            if text or event.logprobs:  # a token's chunk carries its logprobs, text or not
                yield i, text, None, logprobs[i].add(event.logprobs or []) if logprobs else None
    finally:
        job.cancel()  # a client that went away frees its queue place now, its row or turn at the next step


async def _chunks(c: Completion) -> AsyncIterator[dict]:
    """A stream's chunks (a chat's choices each open with the role, as OpenAI's), then the usage."""
    if isinstance(c, ChatCompletion):
        for i in range(c.count):
            yield c.chunk([{**c.part(i, "", None), "delta": {"role": "assistant", "content": ""}}])
    async for part in _parts(c):
        yield c.chunk([c.part(*part)])
    yield c.chunk([], usage=c.usage())


async def _whole(c: Completion) -> dict:
    """The answer of a request not streamed: each choice's text (a chat's as its message), logprobs and finish
    reason, and the usage."""
    texts, finish = [""] * c.count, [None] * c.count
    logprobs = [None if c.job.logprobs is None else {key: [] for key in KEYS} for _ in range(c.count)]
    async for i, text, reason, part in _parts(c):
        texts[i] += text
        finish[i] = reason or finish[i]
        for key, values in (part or {}).items():
            logprobs[i][key].extend(values)
    choices = [c.part(*choice, whole=True) for choice in zip(range(c.count), texts, finish, logprobs)]
    return {**c.chunk(choices, usage=c.usage()), "object": c.WHOLE}


async def _sse_stream(c: Completion) -> AsyncIterator[str]:
    """A stream's events (the usage where the request asks for it), then ``[DONE]``; an error after the
    headers went out is an event, as OpenAI's."""
    usage = (c.req.stream_options or {}).get("include_usage")
    try:
        async for chunk in _chunks(c):
            if chunk["choices"] or usage:
                yield _sse(chunk)
    except Exception as e:
        e = failed(e)
        yield _sse(error_body(e.message, e.kind, code=e.code))
    yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def respond(c: Completion, request: Request):
    """Hand ``c`` to its worker (before the response starts, so that a full queue is a 429 at once), then
    stream it or answer once; errors as OpenAI's JSON."""
    try:
        c.worker.submit(c.job, asyncio.get_running_loop())
        if c.req.stream:  # StreamingResponse watches for the client's hang-up itself
            return StreamingResponse(
                _sse_stream(c),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        answer = await _unless_hung_up(_whole(c), request)
    except Exception as e:
        raise failed(e) from e
    return Response(status_code=499) if answer is None else JSONResponse(answer)  # 499: nobody to answer


async def _unless_hung_up(work: Awaitable[dict], request: Request) -> Optional[dict]:
    """``work``'s answer, or None when the client hangs up first: ``work`` is then cancelled, and its
    job with it (_parts), so that its queue place is free now and its row at the worker's next step."""
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
