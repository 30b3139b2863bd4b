"""The one chat template of ``/v1/chat/completions``: the messages as plain-text turns.

GPT-2, and the models gpt2lab trains from it or from scratch, are base language models, not
chat models: nothing taught them to follow turns. The server writes the conversation as
lines of text and lets the model continue it::

    System: You are a helpful assistant.
    User: Hello!
    Assistant: Hi there.
    User: How are you?
    Assistant:

Each message is ``ROLE: content`` on a line of its own (the content as sent, newlines
included; ``developer`` is written as ``System``), and the text ends with ``Assistant:``.
The model's continuation, its leading whitespace removed, is the reply. It ends at
<|endoftext|>, at ``NEXT_TURN`` (the model starting the user's next line), at the
request's own stop strings, or at max_tokens.
"""
from __future__ import annotations

ROLES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
REPLY = "Assistant:"  # the text ends here; the model writes the reply
NEXT_TURN = "\nUser:"  # a stop string: the model began the user's next turn
NOTE = ("a base language model, not a chat model: /v1/chat/completions writes the messages as plain "
        "'System: ...', 'User: ...' lines and lets the model continue after 'Assistant:'")


def render(messages: list[tuple[str, str]]) -> str:
    """The prompt of a conversation, (role, content) pairs in order; ValueError for an unknown role."""
    lines = []
    for i, (role, content) in enumerate(messages):
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role {role!r}: not a role this server takes "
                             f"({', '.join(ROLES)})")
        lines.append(f"{ROLES[role]}: {content}")
    return "\n".join([*lines, REPLY])
