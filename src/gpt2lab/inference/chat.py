"""The chat template a model is talked to in (``/v1/chat/completions``, ``gpt2lab sample --chat``).

A chat model (``GPTConfig.chat_template``: fine-tuned on conversations, data/chat.py) gets its own
template, ChatML with its two turn tokens; the reply ends at ``<|im_end|>``, the model's end token
(``completion.end_token``). Text in a message is encoded as text, so typed markers cannot open or
close a turn.

A base model (GPT-2, or a model gpt2lab trained on plain text) was never taught turns. It gets the
messages as plain-text lines and continues them::

    System: You are a helpful assistant.
    User: Hello!
    Assistant: Hi there.
    User: How are you?
    Assistant:

Each message is ``ROLE: content`` on a line of its own (the content as sent, newlines included;
``developer`` is written as ``System``), and the text ends with ``Assistant:``. The reply is the
continuation, its leading whitespace removed; it ends at <|endoftext|>, at ``NEXT_TURN`` (the model
starting the user's next line), at the caller's own stop strings, or at the token limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from gpt2lab.data.chat import ROLES as CHAT_ROLES
from gpt2lab.data.chat import encode_chat
from gpt2lab.data.tokenizer import for_model
from gpt2lab.model.config import GPTConfig
from gpt2lab.model.gpt import GPT

PLAIN_ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
REPLY = "Assistant:"  # the plain text ends here; the model writes the reply
NEXT_TURN = "\nUser:"  # a stop string: the model began the user's next turn
# OpenAI's "developer" is the newer name of "system"
TEMPLATE_ROLES = {**{r: r for r in CHAT_ROLES}, "developer": "system"}


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation as the model is given it: its ids, its text, the stop strings of its template
    (beyond the model's end token), and whether the reply's leading whitespace is dropped."""

    ids: list[int]
    text: str
    stops: tuple[str, ...]
    strip: bool


def note(config: GPTConfig, who: str = "/v1/chat/completions") -> str:
    """What ``/v1/models`` (``sample --chat``'s banner: ``who`` "this chat") says of a model's chat: which
    template it is talked to in."""
    if config.chat_template:
        return (
            f"a chat model: {who} writes the messages in its {config.chat_template} template "
            "and the reply ends at its end-of-turn token"
        )
    return (
        f"a base language model, not a chat model: {who} writes the messages as plain "
        "'System: ...', 'User: ...' lines and lets the model continue after 'Assistant:'"
    )


def chat_prompt(model: GPT, messages: Sequence[tuple[str, str]]) -> ChatPrompt:
    """The prompt of ``messages`` for ``model``: in its chat template, or plain text for a base
    model; a ValueError naming ``messages[i].role`` for a role neither takes."""
    for i, (role, _) in enumerate(messages):
        if role not in PLAIN_ROLES:
            raise ValueError(f"messages[{i}].role {role!r}: not a role this server takes ({', '.join(PLAIN_ROLES)})")
    tok = for_model(model)
    if model.config.chat_template:
        ids = encode_chat([(TEMPLATE_ROLES[r], c) for r, c in messages], add_generation_prompt=True, tokenizer=tok)[0]
        return ChatPrompt(ids, tok.decode(ids), (), strip=False)
    text = "\n".join([*(f"{PLAIN_ROLES[role]}: {content}" for role, content in messages), REPLY])
    return ChatPrompt(tok.encode(text, disallowed_special=()), text, (NEXT_TURN,), strip=True)
