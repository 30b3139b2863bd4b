"""A choice's ``logprobs`` in OpenAI's completions shape: each token named as OpenAI names it, its
log-probability, the most likely tokens, and where its text starts."""

from __future__ import annotations

from gpt2lab.inference.completion import TokenLogprob, TokenText, tokenizer_for


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


KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


class Logprobs:
    """One choice's ``logprobs`` in OpenAI's completions shape, token by token: ``tokens``,
    ``token_logprobs`` (None for an echoed prompt's first token: nothing predicts it), ``top_logprobs``
    (the ``logprobs`` most likely tokens, and the token itself when it is not among them, as OpenAI:
    up to logprobs + 1 entries; None where the logprob is) and ``text_offset`` (where each token's
    text starts)."""

    def __init__(self, offset: int, model) -> None:
        self.offset, self.text, self.model = offset, TokenText(model), model

    def add(self, entries: list[TokenLogprob]) -> dict:
        """The part of the choice's logprobs that ``entries`` are (the whole: its parts, each key's lists joined)."""
        part: dict[str, list] = {key: [] for key in KEYS}
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
        return part
