"""What a request body may hold: OpenAI's completion and chat parameters as strict pydantic models,
the limits on their lists (MAX_N, MAX_PROMPTS, MAX_STOPS, MAX_LOGPROBS), FastAPI's validation
errors (malformed JSON, wrong types, out-of-range values) as one OpenAI error naming the field, and
no text anywhere in a body (a key or a value) with a lone UTF-16 surrogate (``no_lone_surrogate``)."""

from __future__ import annotations

import json
import re
import sys
from typing import Iterator, Optional, Union

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpt2lab.model.sampling_defaults import SAMPLING
from gpt2lab.serve.errors import APIError

MAX_N = 16  # choices per request (per prompt)
MAX_PROMPTS = 16
MAX_STOPS = 4  # as OpenAI
MAX_LOGPROBS = 5  # as OpenAI's completions


class _Strict(BaseModel):
    """Strict: ``true`` is not an integer (pydantic's lax mode takes it as 1), nor ``1`` a boolean; no number is
    infinite or NaN (``Infinity``, ``NaN`` and ``1e999`` parse as JSON numbers in Python)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Sampled(_Strict):
    """What both requests share; ``top_k`` is an extra (0 keeps every token). ``temperature``, ``top_p`` and
    ``top_k`` left out are ``gpt2lab sample``'s defaults (``SAMPLING``: 1, 1, 50)."""

    model: str
    temperature: Optional[float] = Field(SAMPLING.temperature, ge=0)
    top_p: Optional[float] = Field(SAMPLING.top_p, gt=0, le=1)
    top_k: Optional[int] = Field(SAMPLING.top_k, ge=0)
    n: Optional[int] = Field(1, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    stream: Optional[bool] = False
    stream_options: Optional[dict] = None
    # accepted for compatibility only at their neutral values
    presence_penalty: Optional[float] = 0
    frequency_penalty: Optional[float] = 0
    logit_bias: Optional[dict] = None
    user: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, body):
        """A body with a lone surrogate in a key or a string is a 400 naming it, before any other check (pydantic
        takes one in a value, and cannot name one in a key)."""
        no_lone_surrogate(body)
        return body


class CompletionRequest(_Sampled):
    """OpenAI's completion parameters."""

    prompt: Union[str, list[str], list[int], list[list[int]]] = "<|endoftext|>"
    max_tokens: Optional[int] = Field(16, ge=0)
    echo: Optional[bool] = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Optional[int] = None  # accepted at its neutral value only, as suffix
    suffix: Optional[str] = None


class ChatMessage(_Strict):
    role: str
    content: Union[str, list[dict], None] = None
    name: Optional[str] = None  # OpenAI's participant name: accepted, not written into the template


class ChatRequest(_Sampled):
    """OpenAI's chat parameters (the ones a plain-text template can honour)."""

    messages: list[ChatMessage]
    max_tokens: Optional[int] = Field(None, ge=1)  # None: the rest of the context, up to --max-tokens
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # OpenAI's newer name for it
    # accepted for compatibility only at their neutral values
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    response_format: Optional[dict] = None  # {"type": "text"} only (OpenAI's default)


# What a union-typed field takes, for an error that fits none of its types (pydantic reports one per type)
UNIONS = {
    "prompt": "text, a list of texts, a list of token ids (integers) or a list of such lists",
    "stop": "a string or a list of strings",
    "content": 'a string, a list of {"type": "text"} parts or null',
}
# The tags pydantic puts in an error's location for a union's member types: "str", "list[int]", ...
_MEMBER = re.compile(r"(str|int|float|bool|dict|list|none)(\[.*\])?")


def _where(loc: tuple) -> tuple[str, bool]:
    """An error's location as OpenAI names it ("messages[0].content"), and whether it went into a
    union's member types (left out of the name)."""
    path = ""
    for x in loc[1:] if loc[:1] == ("body",) else loc:
        if _MEMBER.fullmatch(str(x)):
            return path, True
        path = _join(path, x)
    return path, False


def _join(path: str, key) -> str:
    """``path``'s item ``key`` as OpenAI names it: "messages" and 0 -> "messages[0]", then "content" ->
    "messages[0].content"."""
    return f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)


# JSON's "\ud800" escape without its pair parses to a lone surrogate: a code point no text holds (UTF-8
# cannot encode it; a tokenizer would swap in U+FFFD unasked). A pair parses to one character.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _walk(value, path: str = "", key=None) -> Iterator[tuple[str, object, object]]:
    """(where, key, value) of a parsed request body and of everything in it, each container before what it
    holds: ``where`` as OpenAI names it ("messages[0].content"), ``key`` its name or index in its container."""
    yield path, key, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, item in items:
        yield from _walk(item, _join(path, k), k)


def no_lone_surrogate(body) -> None:
    """Raise a 400 naming the first key or string in a parsed request body that holds a lone surrogate: a key
    as an unrecognized argument, a value as not text."""
    for where, key, value in _walk(body):  # a lone surrogate shown as its escape: errors.error_body
        if isinstance(key, str) and _SURROGATE.search(key):
            why = "its name holds a lone UTF-16 surrogate, which no parameter's name has"
            raise APIError(400, f"unrecognized request argument: {where} ({why})", param=where)
        m = _SURROGATE.search(value) if isinstance(value, str) else None
        if m is not None:
            at = f"{m.group()} at character {m.start()}"
            why = "which is not text; send valid Unicode (a surrogate only as half of a pair)"
            raise APIError(400, f"{where or 'body'}: holds a lone UTF-16 surrogate ({at}), {why}", param=where or None)


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's checks (malformed JSON, wrong types, out-of-range values) as one OpenAI error."""
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        send = "send a JSON object with Content-Type: application/json"
        return APIError(400, f"the request body is not valid JSON ({first.get('msg')}); {send}")
    where, union = _where(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unrecognized request argument: {where or '?'}", param=where or None)
    msg = first.get("msg")
    if union:
        field = re.sub(r".*[.\]]", "", where)  # "messages[0].content" -> "content"
        msg = f"expected {UNIONS.get(field, 'another type')}"
    return APIError(400, f"{where or 'body'}: {msg} (got {first.get('input')!r})", param=where or None)


_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def huge_integer(body: bytes, route: str) -> Optional[APIError]:
    """A body FastAPI could not read for an integer past the digits Python reads from text (a bound on the
    cost of reading it), as one error naming the field and what it takes; None for any other body."""

    class Huge(int):  # an integer too long to read, as its number of digits
        pass

    def read_int(text: str) -> int:
        digits = len(text.lstrip("-"))
        return int(text) if digits <= sys.get_int_max_str_digits() else Huge(digits)

    try:
        data = json.loads(body, parse_int=read_int)
    except ValueError:
        return None
    items = data.items() if isinstance(data, dict) else ()
    field, digits = next(((k, x) for k, v in items for _, _, x in _walk(v) if isinstance(x, Huge)), (None, 0))
    if field is None:
        return None
    info = (ChatRequest if route.endswith("/chat/completions") else CompletionRequest).model_fields.get(field)
    metadata = info.metadata if info else ()
    bounds = [f"{op} {getattr(m, k)}" for m in metadata for k, op in _BOUNDS.items() if hasattr(m, k)]
    takes = (
        f"an integer {' and '.join(bounds)}" if bounds else f"integers of at most {sys.get_int_max_str_digits()} digits"
    )
    return APIError(400, f"{field}: an integer of {digits} digits; {field} takes {takes}", param=field)
