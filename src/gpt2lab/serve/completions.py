"""One request past its schema: ``Completion`` (``/v1/completions``) and ``ChatCompletion`` (the
messages in the model's chat template as one prompt) check what the schema cannot (the model, the
prompt's tokens, the context length, the --max-tokens cap, the parameters served only at their
neutral values), each refusal an ``APIError`` naming its field, and become the worker's ``Job``."""

from __future__ import annotations

import secrets
import time
from typing import Optional, Union

from gpt2lab.data.tokenizer import short
from gpt2lab.inference import chat
from gpt2lab.inference.completion import (
    PromptError,
    Sampling,
    StopString,
    TokenLogprob,
    TokenText,
    check_ids,
    encode_prompt,
    fits_context,
    prompt_text,
)
from gpt2lab.model.sampling_defaults import SAMPLING
from gpt2lab.serve.batch import Worker
from gpt2lab.serve.errors import APIError
from gpt2lab.serve.jobs import Job
from gpt2lab.serve.schemas import MAX_PROMPTS, MAX_STOPS, ChatMessage, ChatRequest, CompletionRequest


def _or(value, default):
    return default if value is None else value


def _unsupported(req, **checks: bool) -> None:
    """A 400 for a parameter (beyond the penalties and logit_bias, which both requests take) sent at another
    than its neutral value."""
    penalties = {"presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty}
    for name, bad in {**penalties, "logit_bias": req.logit_bias, **checks}.items():
        if bad:
            raise APIError(400, f"{name} is not supported by gpt2lab serve; leave it out", param=name)


def _prompts(req: CompletionRequest, model) -> tuple[list[list[int]], list[str]]:
    """Token ids of each prompt for ``model``, and each prompt's text (for echo and
    logprobs' text offsets)."""
    p, vocab = [req.prompt] if isinstance(req.prompt, str) else req.prompt, model.config.real_vocab_size
    texts = None
    if p and all(isinstance(x, str) for x in p):  # the schema's types: texts, token ids, lists of token ids
        texts = [prompt_text(t) for t in p]  # as sample
        ids = [encode_prompt(t, model) for t in texts]  # as sample
    else:
        ids = [p] if p and isinstance(p[0], int) else p
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
        cap = f"this server gives at most {worker.limits.max_tokens} tokens per choice (--max-tokens)"
        raise APIError(400, f"max_tokens: {cap}; you asked for {said}", param="max_tokens")
    longest, block = max(len(p) for p in prompts), worker.block_size
    if longest > block or (longest == block and max_tokens > 0):  # no max_tokens could make it fit
        alone = {
            "prompt": f"the {'longest ' if len(prompts) > 1 else ''}prompt alone takes {longest} tokens",
            "messages": f"the messages alone take {longest} tokens (as the chat template writes them)",
        }[what]
        room = "" if longest > block else ", which leaves no room for a completion"
        why, param = f", and {alone}{room}. Shorten the {what}.", what
    elif not fits_context(longest, max_tokens, block):
        asked = f"{longest + max_tokens} ({longest} in the {what}, {said})"
        why, param = f"; you asked for {asked}. Shorten the {what} or lower max_tokens.", "max_tokens"
    else:
        return
    context = f"This model's maximum context length is {block} tokens"
    raise APIError(400, context + why, param=param, code="context_length_exceeded")


def _stops(stop: Optional[Union[str, list[str]]]) -> list[str]:
    stops = [prompt_text(s) for s in ([stop] if isinstance(stop, str) else list(stop or []))]
    if len(stops) > MAX_STOPS:
        raise APIError(400, f"stop: at most {MAX_STOPS} sequences", param="stop")
    return stops


KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


class Logprobs:
    """One choice's ``logprobs`` in OpenAI's completions shape, token by token: ``tokens``,
    ``token_logprobs`` (None for an echoed prompt's first token: nothing predicts it), ``top_logprobs``
    (the ``logprobs`` most likely tokens, and the token itself when it is not among them, as OpenAI:
    up to logprobs + 1 entries; None where the logprob is) and ``text_offset`` (where each token's
    text starts)."""

    def __init__(self, offset: int, model) -> None:
        self.offset, self.text = offset, TokenText(model)

    def name(self, t: int) -> str:
        """A token as OpenAI's logprobs name it: its text, or ``bytes:\\xNN...`` for bytes that are not
        whole UTF-8 characters (a character split across tokens); ids past the model's tokenizer's as ``<|id|>``."""
        enc = self.text.enc
        if t >= enc.n_vocab:
            return f"<|{t}|>"
        raw = enc.decode_single_token_bytes(t)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def add(self, entries: list[TokenLogprob]) -> dict:
        """The part of the choice's logprobs that ``entries`` are (the whole: its parts, each key's lists joined)."""
        part: dict[str, list] = {key: [] for key in KEYS}
        for e in entries:
            token = self.name(e.token)
            part["tokens"].append(token)
            part["token_logprobs"].append(e.logprob)
            top = None
            if e.logprob is not None:
                top = {self.name(t): lp for t, lp in e.top}
                top.setdefault(token, e.logprob)
            part["top_logprobs"].append(top)
            part["text_offset"].append(self.offset)
            self.offset += len(self.text.feed(e.token))
        return part


class Completion:
    """One validated completion request: its worker, its work, the response id, and the completion tokens
    its choices have taken so far (``tokens``)."""

    OBJECT, WHOLE, ID, WHAT = "text_completion", "text_completion", "cmpl", "prompt"  # chunk, answer, id, prompt
    strip, tokens = False, 0  # whether a reply's leading whitespace is dropped (chat's plain template)

    def __init__(self, req: Union[CompletionRequest, ChatRequest], workers: dict[str, Worker]) -> None:
        if req.model not in workers:
            message = f"The model {req.model!r} does not exist; this server has: {', '.join(workers)}"
            raise APIError(404, message, param="model", code="model_not_found")
        self.req, self.worker = req, workers[req.model]
        max_tokens, default, stops, echo, logprobs = self._read(req)
        _check_length(self.prompts, max_tokens, self.worker, default, self.WHAT)
        sampling = Sampling(
            max_new_tokens=max_tokens,  # a field sent as null is its default, as left out (OpenAI's reading)
            temperature=_or(req.temperature, SAMPLING.temperature),
            top_k=_or(req.top_k, SAMPLING.top_k),
            top_p=_or(req.top_p, SAMPLING.top_p),
        )
        # without a seed each prompt draws its own (equal prompts get their own samples); with one,
        # every prompt starts from it, as `gpt2lab sample --seed` does
        seeds = [_or(req.seed, secrets.randbelow(2**63)) for _ in self.prompts]
        stops = [StopString(s) for s in stops if s]  # matched incrementally, shared by the request's choices
        self.job = Job(self.prompts, sampling, n=req.n or 1, seeds=seeds, stops=stops, echo=echo, logprobs=logprobs)
        self.count = len(self.prompts) * self.job.n  # choices
        self.created, self.id = int(time.time()), f"{self.ID}-{secrets.token_hex(12)}"

    def _read(self, req: CompletionRequest) -> tuple[int, bool, list[str], list[str], Optional[int]]:
        """Set the prompts (ids, text); (max_tokens, whether left out, stop strings, echo, logprobs)."""
        _unsupported(req, best_of=req.best_of not in (None, 1, req.n), suffix=bool(req.suffix))
        self.prompts, self.texts = _prompts(req, self.worker.model)
        default = req.max_tokens is None or "max_tokens" not in req.model_fields_set
        return _or(req.max_tokens, 16), default, _stops(req.stop), self.texts if req.echo else [], req.logprobs

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        return {"prompt_tokens": prompt, "completion_tokens": self.tokens, "total_tokens": prompt + self.tokens}

    def chunk(self, choices: list[dict], **extra) -> dict:
        return {
            "id": self.id,
            "object": self.OBJECT,
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
            **extra,
        }

    def part(self, i: int, text: str, finish: Optional[str], logprobs: Optional[dict] = None, whole=False) -> dict:
        """Choice ``i`` in a chunk (``whole``: in the answer): its text, its logprobs, its finish reason."""
        return {"text": text, "index": i, "logprobs": logprobs, "finish_reason": finish}

    def logprobs(self) -> dict[int, Logprobs]:
        """Each choice's logprobs, built as its tokens come (empty without ``logprobs``). Text offsets
        count from the start of the prompt, echoed or not, as OpenAI's do."""
        if self.job.logprobs is None:
            return {}
        offset = lambda i: 0 if self.job.echo else len(self.texts[i // self.job.n])  # noqa: E731
        return {i: Logprobs(offset(i), self.worker.model) for i in range(self.count)}


class ChatCompletion(Completion):
    """One validated chat request: the messages in the model's chat template as one prompt (inference/chat.py)."""

    OBJECT, WHOLE, ID, WHAT = "chat.completion.chunk", "chat.completion", "chatcmpl", "messages"

    def _read(self, req: ChatRequest) -> tuple[int, bool, list[str], list[str], Optional[int]]:
        _unsupported(req, logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs is not None)
        if req.response_format is not None and req.response_format.get("type") != "text":
            only = 'response_format: only {"type": "text"} is supported (a base model cannot be held to a format)'
            raise APIError(400, f"{only}; got {req.response_format!r}", param="response_format")
        if not req.messages:
            raise APIError(400, "messages: pass at least one message", param="messages")
        try:  # text in a message is text: "<|endoftext|>" or "<|im_end|>" typed there cannot end a turn
            prompt = chat.chat_prompt(self.worker.model, [(m.role, _content(i, m)) for i, m in enumerate(req.messages)])
            check_ids(prompt.ids, self.worker.model.config.real_vocab_size)
        except PromptError as e:
            raise APIError(400, f"messages: {e}", param="messages") from None
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        self.prompts, self.texts, self.strip = [prompt.ids], [prompt.text], prompt.strip
        max_tokens = req.max_completion_tokens or req.max_tokens
        default = max_tokens is None
        if default:  # as OpenAI: what the context leaves, here up to --max-tokens
            max_tokens = max(1, min(self.worker.limits.max_tokens, self.worker.block_size - len(prompt.ids)))
        return max_tokens, default, [*_stops(req.stop), *prompt.stops], [], None

    def part(self, i: int, text: str, finish: Optional[str], logprobs: Optional[dict] = None, whole=False) -> dict:
        said = {"role": "assistant", "content": text} if whole else {"content": text} if text else {}
        return {"index": i, "message" if whole else "delta": said, "logprobs": None, "finish_reason": finish}


def _content(i: int, m: ChatMessage) -> str:
    """A message's text: a string, or the text of its ``{"type": "text"}`` parts (read as a prompt is)."""
    if m.content is None or isinstance(m.content, str):
        return prompt_text(m.content or "")
    parts = []
    for part in m.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(
                f'messages[{i}].content: only text parts ({{"type": "text", "text": ...}}) '
                f"are supported, got {part.get('type')!r}"
            )
        parts.append(prompt_text(part["text"]))
    return "".join(parts)
