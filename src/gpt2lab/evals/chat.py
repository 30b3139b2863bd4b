"""Chat evals: how well a chat model takes its turn (``gpt2lab eval chat``) and solves GSM8K (``eval gsm8k``).

``evaluate_chat``: on held-out conversations, (1) the loss on the assistant's tokens (the tokens
fine-tuning is supervised on: data/chat.py's mask), every conversation cut into windows of the
model's block as the training loader cuts them, and (2) the share of greedy replies that end their
turn (``<|im_end|>``) within ``max_tokens``: one reply per conversation, to the turns before its
first assistant turn. A base model is scored in the same template: what fine-tuning changes is
what is measured.

``evaluate_gsm8k``: each question as a user turn, the greedy reply, exact match of the number after
``####`` against the reference's. With ``calculator`` on, the reply's calculator annotations run as
a tool, as nanochat's engine does: when the model has written ``<<expr=``, the value of ``expr``
and ``>>`` are appended to its reply as if it had written them (the data writes ``<<48/2=24>>24``);
the tool evaluates + - * / % ** and parentheses on numbers only (``calculate``).

Where the data comes from: ``chat_data`` (``eval chat``: a file, a prepared directory's held-out
conversations, or by default those of the data the run trained on) and ``gsm8k_test_file`` (``eval
gsm8k``: GSM8K's official test split, downloaded once into gpt2lab's cache by evals/download.py).
"""

from __future__ import annotations

import ast
import math
import operator
import os
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from tqdm import tqdm

from gpt2lab.data.chat import ChatFormatError, Message, conversation, encode_chat
from gpt2lab.data.tokenizer import Tokenizer, for_chat, for_config
from gpt2lab.evals.download import DataSet, cached_file, json_lines
from gpt2lab.evals.hellaswag import score_rows
from gpt2lab.model.sampling import generate_stream

# GSM8K's official test split (1,319 problems, rows {"question", "answer"}, each answer ending
# "#### N"); the Hugging Face dataset's "main" config holds the same rows, the second source.
GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/test.jsonl"
GSM8K_HF = "openai/gsm8k"


def chat_tokenizer(model) -> Tokenizer:
    """The model's tokenizer with the template's turn tokens (GPT-2's chat variant for a GPT-2 base model)."""
    return for_chat(for_config(model.config, model.tokenizer))


def _check(model) -> None:
    """A chat model, or a base model with rows for the turn tokens (scored in the template all the same:
    its turn tokens are untrained rows); anything else a ValueError saying why."""
    im_end, config = chat_tokenizer(model).im_end_id, model.config
    if config.chat_template is not None and config.real_vocab_size <= im_end:
        raise ValueError("the model's vocabulary has no turn tokens")
    if config.vocab_size <= im_end:  # GPT-2's own 50257 rows: <|im_start|> and <|im_end|> would index past them
        raise ValueError(
            f"the model's {config.vocab_size} embedding rows hold no chat turn tokens (<|im_end|> is id {im_end}); "
            "evaluate a chat model, or a base model gpt2lab trained (its vocabulary is padded past them)"
        )


# -- the assistant-token loss -----------------------------------------------------------------
@torch.no_grad()
def assistant_loss(model, conversations: Sequence[Sequence[Message]], device: torch.device) -> tuple[float, int]:
    """(mean loss over the assistant's tokens, their number) of ``conversations``: each one's ids cut
    into windows of block_size, each predicting the next tokens (masked targets not scored), a
    conversation's windows in one forward (evals/hellaswag.py's ``score_rows``)."""
    T, tok = model.config.block_size, chat_tokenizer(model)
    total, kept = 0.0, 0
    for turns in conversations:
        ids, mask = encode_chat(turns, tokenizer=tok)
        x, y = ids[:-1], [t if keep else -1 for t, keep in zip(ids[1:], mask[1:])]
        rows = [(x[s : s + T], 0, y[s : s + T]) for s in range(0, len(x), T) if any(t != -1 for t in y[s : s + T])]
        if rows:
            total += float(score_rows(model, rows, device=device, dtype="float32").sum())
            kept += sum(t != -1 for t in y)
    return total / max(kept, 1), kept


# -- greedy replies ----------------------------------------------------------------------------
@dataclass
class Reply:
    ids: list[int]  # the reply's tokens, <|im_end|> excluded
    text: str
    ended: bool  # the model wrote <|im_end|> within max_tokens
    tool_calls: int = 0


def greedy_reply(
    model, prompt: Sequence[int], max_tokens: int, tool: Optional[Callable[[str], Optional[str]]] = None
) -> Reply:
    """The model's greedy continuation of ``prompt`` up to ``<|im_end|>`` or ``max_tokens`` tokens
    (model/sampling.py's loop at temperature 0). ``tool(reply_text)`` may return text to append (a
    calculator's result): its tokens are fed to the model as if generated, and count toward ``max_tokens``."""
    enc = chat_tokenizer(model)
    budget = min(max_tokens, model.config.block_size - len(prompt))
    if budget < 1:
        raise ValueError(
            f"the prompt of {len(prompt)} tokens leaves no room in the model's {model.config.block_size}-token context"
        )
    out, calls = [], 0

    def then(tok: torch.Tensor) -> list[int]:
        nonlocal calls
        extra = tool(enc.decode([*out, int(tok)], errors="replace")) if tool and int(tok) != enc.im_end_id else None
        calls += bool(extra)
        return enc.encode_ordinary(extra) if extra else []

    idx = torch.tensor([list(prompt)], device=next(model.parameters()).device)
    for tok, ended in generate_stream(model, idx, budget, temperature=0, stop_token=enc.im_end_id, then=then):
        if ended[0]:
            return Reply(out, enc.decode(out, errors="replace"), True, calls)
        out.append(int(tok[0]))
    return Reply(out, enc.decode(out, errors="replace"), False, calls)


def first_reply_prompt(turns: Sequence[Message], tokenizer: Optional[Tokenizer] = None) -> Optional[list[int]]:
    """The ids of the turns before the first assistant turn, ready for the reply (None: no such turn)."""
    for i, (role, _) in enumerate(turns):
        if role == "assistant":
            return encode_chat(turns[:i], add_generation_prompt=True, tokenizer=tokenizer)[0] if i else None
    return None


def evaluate_chat(
    model, conversations: Sequence[Sequence[Message]], *, max_tokens: int, progress: bool = False
) -> dict:
    """The assistant-token loss and the share of greedy replies that end their turn (module docstring)."""
    _check(model)
    loss, kept = assistant_loss(model, conversations, next(model.parameters()).device)
    prompts = [first_reply_prompt(turns, chat_tokenizer(model)) for turns in conversations]
    fit = [p for p in prompts if p is not None and len(p) < model.config.block_size]
    bar = tqdm(fit, desc="replies", unit="conv", dynamic_ncols=True, disable=not progress)
    replies = [greedy_reply(model, prompt, max_tokens) for prompt in bar]
    ended, n = sum(r.ended for r in replies), len(replies)
    return {
        "task": "chat",
        "conversations": len(conversations),
        "assistant_tokens": kept,
        "assistant_loss": loss,
        "replies": n,
        "ended": ended,
        "ended_share": ended / n if n else None,
        "max_tokens": max_tokens,
        "mean_reply_tokens": sum(len(r.ids) for r in replies) / n if n else None,
        "skipped_no_room": len(prompts) - n,
    }


# -- GSM8K ---------------------------------------------------------------------------------------
_ANSWER = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


def final_number(text: str) -> Optional[str]:
    """The number after the first ``####`` of ``text``, commas removed (None: no such number)."""
    m = _ANSWER.search(text)
    return m.group(1).replace(",", "") if m else None


_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expr: str) -> Optional[str]:
    """The value of an arithmetic expression (numbers, + - * / % **, parentheses; commas in numbers
    ignored) as GSM8K writes it (``24``, ``0.2``); None for anything else or a result out of range."""
    try:
        value = _eval(ast.parse(expr.replace(",", "").strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError, RecursionError):
        return None
    if not math.isfinite(value) or abs(value) > 1e15:
        return None
    return str(int(value)) if value == int(value) else f"{value:.10g}"


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {type(node).__name__}")


def calculator_tool(text: str) -> Optional[str]:
    """The calculator: when ``text`` ends inside an annotation at its ``=`` (``... <<48/2=``), the
    value and ``>>``; else None."""
    start = text.rfind("<<")
    if not text.endswith("=") or start < 0 or text.rfind(">>") > start:
        return None
    value = calculate(text[start + 2 : -1])
    return None if value is None else f"{value}>>"


def evaluate_gsm8k(
    model, problems: Sequence[Sequence[Message]], *, max_tokens: int, calculator: bool = True, progress: bool = False
) -> tuple[dict, list[dict]]:
    """(summary, one record per problem): each problem's user turn answered greedily, exact match of
    the number after ``####`` against the reference answer's."""
    _check(model)
    rows = []
    for turns in tqdm(problems, desc="gsm8k", unit="conv", dynamic_ncols=True, disable=not progress):
        prompt = first_reply_prompt(turns, chat_tokenizer(model))  # the user's turn
        r = greedy_reply(model, prompt, max_tokens, calculator_tool if calculator else None)
        answer, expected = final_number(r.text), final_number(turns[1][1])
        rows.append(
            {
                "question": turns[0][1],
                "reference": expected,
                "reply": r.text,
                "answer": answer,
                "correct": answer is not None and math.isclose(float(answer), float(expected), abs_tol=1e-9, rel_tol=0),
                "ended": r.ended,
                "tool_calls": r.tool_calls,
            }
        )
    n, correct = len(rows), sum(row["correct"] for row in rows)
    return (
        {
            "task": "gsm8k",
            "n": n,
            "correct": correct,
            "accuracy": correct / n if n else None,
            "calculator": calculator,
            "max_tokens": max_tokens,
        },
        rows,
    )


def _problem(row) -> list[Message]:
    """A GSM8K problem's two turns (its row or the messages format); ChatFormatError naming the field."""
    turns = conversation(row)
    if not (len(turns) == 2 and turns[0][0] == "user" and final_number(turns[1][1]) is not None):
        raise ChatFormatError("answer: GSM8K's answer must end with '#### <number>' after one user turn")
    return turns


def read_conversations(source: str, limit: Optional[int] = None, gsm8k: bool = False) -> list[list[Message]]:
    """The conversations of a JSON-lines file (directory, glob; compressed too): OpenAI's messages format
    or GSM8K's question/answer rows; a bad record is a SourceError naming file, line and field."""
    from gpt2lab.data.sources import JsonLine, SourceError, resolve_source

    out = []
    for doc in resolve_source(source).documents(0, limit):
        if not isinstance(doc, JsonLine):
            raise SourceError(f"{source}: conversations are JSON lines (.jsonl, also .jsonl.zst/.gz/.xz)")
        row = doc.row()
        try:
            turns = _problem(row) if gsm8k else conversation(row)
        except ChatFormatError as e:
            raise SourceError(f"{doc.path}:{doc.lineno}: {e}; fix or remove that line") from e
        out.append(turns)
    if not out:
        raise SourceError(f"{source}: no conversations")
    return out


# -- where the data comes from -----------------------------------------------------------------
def gsm8k_test_file() -> str:
    """The cached GSM8K test split (evals/download.py: the official file, then the HF dataset), downloaded
    on first use; offline or unreachable, a RuntimeError in one line naming the URL and --data."""
    test = DataSet(
        what="GSM8K's test split",
        url=GSM8K_URL,
        path=os.path.join("gsm8k", "test.jsonl"),
        form='JSON lines of GSM8K\'s {"question", "answer"} rows',
        check=_check_gsm8k_file,
        second=(GSM8K_HF, "main", "test", ("question", "answer")),
    )
    return cached_file(test)


def _check_gsm8k_file(path: str) -> None:
    """A ValueError naming the line of ``path`` that is not a GSM8K problem, or saying it holds none."""
    if not json_lines(path, _problem):
        raise ValueError("no problems in the file")


def chat_data(data: Optional[str], model: str) -> tuple[str, Optional[str]]:
    """What ``eval chat`` reads and, where it chose it, a note saying so: ``data`` as given (a file, a
    glob, a directory of JSON lines), a prepared directory's held-out conversations
    (data/manifest.py), or, with no ``data``, those of the prepared data the run ``model`` trained on.
    What cannot be found is a UsageError in one line saying what to pass."""
    from gpt2lab.data.manifest import HELD_OUT, held_out_file
    from gpt2lab.data.shards import MANIFEST_FILE
    from gpt2lab.system.errors import UsageError

    what = "pass --data FILE.jsonl (conversations in the messages format) or --data DIR (from gpt2lab prepare)"
    if data is not None:
        if not os.path.isfile(os.path.join(data, MANIFEST_FILE)):
            return data, None
        where, note = f"--data {data}: prepared data", None
        what = "pass --data FILE.jsonl (conversations in the messages format)"
    else:
        data = _run_data(model)
        if data is None:
            raise UsageError(f"--data is needed: --model {model} is not a run that names its prepared data; {what}")
        where = f"--data is needed: {data}, the data --model {model} trained on,"
        if not os.path.isdir(data):
            raise UsageError(f"{where} is not here; {what}")
        note = f"no --data: the held-out conversations of {data}, which --model {model} trained on: "
    found = held_out_file(data)
    if found is None:
        raise UsageError(
            f"{where} without held-out conversations ({HELD_OUT}: gpt2lab prepare writes it for conversations "
            f"with a val split; its same prepare command run again adds it); {what}"
        )
    return found, note and note + found


def _run_data(model: str) -> Optional[str]:
    """The --data a gpt2lab run (or one of its checkpoints) trained on, from its config.json; None for
    anything else (a hub name, an HF directory)."""
    from gpt2lab.system import formats
    from gpt2lab.system.files import read_json_object

    config = read_json_object(os.path.join(model, "config.json")) if os.path.isdir(model) else None
    data = config.get("data") if config is not None and formats.is_current(config, formats.RUN) else None
    return data if isinstance(data, str) else None
