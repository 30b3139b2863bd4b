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
from gpt2lab.serve.logprobs import Logprobs


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
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": text.lstrip() if c.strip else text},
            "logprobs": None,
            "finish_reason": finish.get(i),
        }
        for i, text in texts.items()
    ]
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


async def respond(c: Completion, stream, whole, request: Request):
    """Start ``c`` (before the response starts, so that a full queue is a 429), then stream it or
    answer once; errors as OpenAI's JSON."""
    job = c.start()
    if c.req.stream:  # StreamingResponse watches for the client's hang-up itself
        return StreamingResponse(
            _sse_stream(stream(c, job)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        answer = await _unless_hung_up(whole(c, job), request)
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
