"""Conversations as tokens: the ChatML template, its two turn tokens, and the loss mask.

A chat model's conversation is ChatML (the shape OpenAI introduced and Qwen, SmolLM and many
others use), after the ``<|endoftext|>`` every gpt2lab document starts with::

    <|endoftext|><|im_start|>system
    You answer briefly.<|im_end|>
    <|im_start|>user
    Hello!<|im_end|>
    <|im_start|>assistant
    Hi.<|im_end|>

``<|im_start|>`` and ``<|im_end|>`` are two tokens of their own: in GPT-2's vocabulary ids 50257 and
50258, the first two of the rows gpt2lab pads GPT-2's 50257 tokens with (50304), so a GPT-2 model
takes them without a new embedding table; a tokenizer gpt2lab trained has them as special tokens
of its own (data/bpe.py: ids 1 and 2). ``encode_chat`` takes the ids of the tokenizer it is given.
Text is encoded as ordinary text, never parsed for special tokens, so a message that contains the
characters ``<|im_end|>`` cannot end its turn or open another: only the template writes those two ids.

Every piece of text between two special tokens is encoded as one string (``role\\ncontent``,
then ``\\n``), which is exactly how a Hugging Face tokenizer encodes the template's text
(``CHAT_TEMPLATE``, the Jinja form an export carries): it splits at special tokens first and
encodes each piece alone. So ``apply_chat_template`` gives these ids for any conversation
whose text does not itself spell a special token (that tokenizer parses such text as the token).

The loss mask is 1 on the tokens an assistant wrote (its content and its ``<|im_end|>``) and 0
on everything else: the template, the system and user turns. A token is the assistant's when
it holds at least one byte of the assistant's content.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence

from gpt2lab.data.tokenizer import EOT_TOKEN, IM_END, IM_START, Tokenizer, for_chat, gpt2_tokenizer

TEMPLATE = "chatml"  # the name a manifest, a run's config and an export record
ROLES = ("system", "user", "assistant")
ASSISTANT = "assistant"

# The same template in Jinja, for Hugging Face's tokenizer_config.json (apply_chat_template). OpenAI's
# "developer" role, its newer name of "system", is written as "system", as the server writes it
# (inference/chat.py): the model was only ever taught "system".
CHAT_TEMPLATE = (
    "{{ '<|endoftext|>' }}"
    "{% for message in messages %}"
    "{% set role = 'system' if message['role'] == 'developer' else message['role'] %}"
    "{{ '<|im_start|>' + role + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatFormatError(ValueError):
    """A conversation record that is not one: the message names the field (``messages[2].role``)."""


Message = tuple[str, str]  # (role, content)


def conversation(row: Any) -> list[Message]:
    """The (role, content) turns of one JSON record: OpenAI's messages format
    ``{"messages": [{"role", "content"}, ...]}`` (content: text, or a list of text parts
    ``{"type": "text", "text": ...}``, joined, as the server takes it) or GSM8K's ``{"question", "answer"}`` (a user
    turn and an assistant turn). Raises ChatFormatError naming the field that is wrong."""
    if not isinstance(row, dict):
        raise ChatFormatError(f'a JSON {type(row).__name__}, not an object with "messages"')
    if "messages" not in row and "question" in row and "answer" in row:
        return [("user", _text(row, "question", "question")), (ASSISTANT, _text(row, "answer", "answer"))]
    if "messages" not in row:
        raise ChatFormatError(
            f'no "messages" (fields: {", ".join(list(row)[:10])}); a conversation is '
            '{"messages": [{"role": ..., "content": ...}, ...]} or {"question", "answer"}'
        )
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError('messages: must be a non-empty list of {"role", "content"} objects')
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatFormatError(f'messages[{i}]: a JSON {type(m).__name__}, not a {{"role", "content"}} object')
        role = m.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"messages[{i}].role: {role!r} is not one of {', '.join(ROLES)}")
        turns.append((role, _content(m, f"messages[{i}].content")))
    if not any(role == ASSISTANT for role, _ in turns):
        raise ChatFormatError("messages: no assistant turn, so nothing to learn from; drop the record")
    return turns


def _content(message: dict, field: str) -> str:
    """A message's content as the server takes it (serve/schemas.py): text, or a list of text parts
    ``[{"type": "text", "text": ...}, ...]``, joined; any other part names its place."""
    value = message.get("content")
    if not isinstance(value, list):
        return _text(message, "content", field)
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            got = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatFormatError(f'{field}[{j}]: only text parts ({{"type": "text", "text": ...}}), got {got!r}')
        texts.append(part["text"])
    return "".join(texts)


def _text(obj: dict, key: str, field: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        what = "missing" if key not in obj else f"{type(value).__name__}, not text"
        raise ChatFormatError(f"{field}: {what}")
    return value


def is_conversation(row: Any) -> bool:
    """Whether a JSON record looks like a conversation (``prepare``'s format detection)."""
    return isinstance(row, dict) and ("messages" in row or ("question" in row and "answer" in row))


def special_tokens(tok: Tokenizer) -> dict[str, int]:
    """The template's special tokens and their ids in ``tok`` (GPT-2's: its chat variant's)."""
    tok = for_chat(tok)
    return {EOT_TOKEN: tok.eot_id, IM_START: tok.im_start_id, IM_END: tok.im_end_id}


def encode_chat(
    turns: Sequence[Message], add_generation_prompt: bool = False, tokenizer: Optional[Tokenizer] = None
) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a conversation in the template, in ``tokenizer``'s ids (default GPT-2's);
    with ``add_generation_prompt`` the ids end with ``<|im_start|>assistant\\n``, where the model's
    reply begins."""
    enc = for_chat(tokenizer if tokenizer is not None else gpt2_tokenizer())
    ids, mask, newline = [enc.eot_id], [0], enc.encode_ordinary("\n")
    for role, content in turns:
        head = f"{role}\n"
        body = enc.encode_ordinary(head + content)
        ids += [enc.im_start_id, *body, enc.im_end_id, *newline]
        if role == ASSISTANT:  # the content's tokens (each holding a byte past the role line) and <|im_end|>
            ends = itertools.accumulate(len(enc.decode_single_token_bytes(t)) for t in body)
            mask += [0, *(1 if end > len(head.encode()) else 0 for end in ends), 1, *[0] * len(newline)]
        else:
            mask += [0] * (len(body) + 2 + len(newline))
    if add_generation_prompt:
        prompt = enc.encode_ordinary(f"{ASSISTANT}\n")
        ids += [enc.im_start_id, *prompt]
        mask += [0] * (1 + len(prompt))
    return ids, mask
