"""Text in, text out: the one path that both ``gpt2lab sample`` and ``gpt2lab serve`` take.

Loading (the model held for inference as measured: inference/probe.py, form.py), prompt encoding, seeding and
the token-by-token decode live here once, so a seeded request to the server and ``gpt2lab sample`` with the
same seed and settings cannot drift apart; so do the log-probabilities the server reports (``token_logprobs``,
``score_prompt``), one definition for both of its workers."""

from __future__ import annotations

import codecs
import collections
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch

from gpt2lab.data.tokenizer import for_model, short
from gpt2lab.model.gpt import GPT
from gpt2lab.model.sampling_defaults import SAMPLING

if TYPE_CHECKING:
    from gpt2lab.inference.choice import Decision


class PromptError(ValueError):
    """A prompt this model cannot take (tokens outside its vocabulary)."""


@dataclass(frozen=True)
class Sampling:
    """How to continue a prompt (the defaults: ``SAMPLING``, model/sampling_defaults.py); ``top_k`` 0 or
    None keeps every token, ``top_p`` 1 or None all the mass."""

    max_new_tokens: int = 100
    temperature: float = SAMPLING.temperature
    top_k: Optional[int] = SAMPLING.top_k
    top_p: Optional[float] = SAMPLING.top_p
    stop_at_eot: bool = True

    def filters(self) -> dict:
        """top_k and top_p as sample_next takes them: 0 (top-k) or 1 (top-p) keep everything."""
        top_p = self.top_p if self.top_p is not None and self.top_p < 1 else None
        return {"top_k": self.top_k or None, "top_p": top_p}


def check_request(request, device: torch.device) -> None:
    """Refuse a precision or kernel this device cannot run (a ChoiceError, one line) before any loading."""
    from gpt2lab.inference.choice import candidates
    from gpt2lab.inference.form import detect_facts

    candidates(request, detect_facts(device))


def load_for_inference(
    spec: str,
    device: torch.device,
    request=None,
    command: str = "gpt2lab",
    check: Optional[Callable[[GPT], None]] = None,
) -> tuple[GPT, "Decision"]:
    """(The model named by ``spec`` (see load.load_model, its tokenizer with it) held for ``request`` (an
    InferenceRequest; default: sampling one row, dtype auto) on ``device`` as measured (inference/probe.py),
    the decision, which rank 0 makes (measures) and prints on stderr, the same on every rank under torchrun).
    ``check`` sees the model as loaded, before the (possibly measured) choice: a request it cannot serve fails first."""
    from gpt2lab.distributed.dist import decided_on_rank_0, rank
    from gpt2lab.inference.choice import InferenceRequest
    from gpt2lab.inference.form import hold
    from gpt2lab.inference.probe import announce, decide
    from gpt2lab.weights.load import load_model

    request = request or InferenceRequest()
    check_request(request, device)
    model = load_model(spec, device)
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:  # its text would be noise ("????"): said once, as it is loaded
        print(
            f"{command}: warning: {spec} holds NaN or infinite weights ({len(bad)} of its tensors, the first "
            f"{bad[0]}): what it writes means nothing; train it again or load another checkpoint",
            file=sys.stderr,
            flush=True,
        )
    if check is not None:
        check(model)
    decision = decided_on_rank_0(lambda: decide(model, device, request, command=command))
    if rank() == 0:
        announce(decision, command)
    return hold(model, decision.candidate, request.rows, inplace=True, tile_rows=decision.tile_rows), decision


def prompt_text(text: str) -> str:
    """``text`` with each lone surrogate (half of a UTF-16 pair: ``"\\ud800"`` in JSON, or an
    undecodable byte of a command-line argument) as U+FFFD, which is how the tokenizer reads it:
    so the text echoed or printed is the text the model was given, and it can be written as UTF-8."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def end_token(model: GPT) -> int:
    """The token a model ends its text with: <|im_end|> for a chat model (its turn), else <|endoftext|>."""
    tok = for_model(model)
    return tok.im_end_id if model.config.chat_template else tok.eot_id


def encode_prompt(text: str, model: GPT) -> list[int]:
    """A raw prompt's ids for ``model`` ('' is a lone <|endoftext|>): its special tokens
    written out (``<|endoftext|>``, a chat model's ``<|im_start|>``) are the tokens, as a whole
    prompt is the caller's own text (chat messages never are: inference/chat.py)."""
    tok = for_model(model)
    return tok.encode(prompt_text(text), allowed_special="all") if text else [tok.eot_id]


def prompt_ids(text: str, model: GPT) -> list[int]:
    """Token ids of ``text`` for ``model`` (encode_prompt); raises PromptError past its vocabulary."""
    ids = encode_prompt(text, model)
    check_ids(ids, model.config.real_vocab_size, from_text=True, tokenizer=short(model.config.tokenizer))
    return ids


def check_ids(ids: list[int], vocab: int, from_text: bool = False, tokenizer: str = "GPT-2's BPE") -> None:
    """PromptError for an empty prompt or an id outside 0..vocab-1. Ids the model's tokenizer made from
    text can only be too large for a model with a smaller vocabulary (the model's fault); ids a
    caller passed are checked against the range."""
    if not ids:
        raise PromptError("the prompt is empty; pass text ('' starts from <|endoftext|>) or token ids")
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is None:
        return
    if from_text:
        raise PromptError(
            f"the tokenizer ({tokenizer}) gives token id {ids[bad]}, outside this model's vocabulary "
            f"of {vocab}; this model was not trained with that tokenizer"
        )
    raise PromptError(
        f"token id {ids[bad]} at position {bad} is out of range: this model's token ids are 0 to {vocab - 1}"
    )


def fits_context(prompt_tokens: int, max_new_tokens: int, context: int) -> bool:
    """The one rule of ``sample`` and ``serve``: the prompt and every token asked for fit the model's
    context (nothing of a prompt is ever dropped, and no position runs past the model's last)."""
    return prompt_tokens + max_new_tokens <= context


def seeded_generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


@dataclass(frozen=True)
class TokenLogprob:
    """A token and its log-probability under the model (None for a text's first token, which
    nothing predicts), with the most likely tokens at that position, most likely first."""

    token: int
    logprob: Optional[float]
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab: int, top: int) -> list[TokenLogprob]:
    """Each target's log-probability under the logits (T, V) that predict it, and the ``top`` most
    likely tokens there: the model's own distribution, a float32 log-softmax over its first
    ``vocab`` (real) tokens, before any temperature, top-k or top-p."""
    lp = torch.log_softmax(logits[:, :vocab].float(), dim=-1)
    chosen = lp.gather(-1, targets[:, None].to(lp.device))[:, 0].tolist()
    best = lp.topk(min(top, vocab), dim=-1)  # top 0: no column
    tops = [tuple(zip(i, v)) for i, v in zip(best.indices.tolist(), best.values.tolist())]
    return [TokenLogprob(t, c, k) for t, c, k in zip(targets.tolist(), chosen, tops)]


def score_prompt(model: GPT, ids: list[int], top: int) -> list[TokenLogprob]:
    """Every token of ``ids`` with its log-probability given the tokens before it (one forward of
    the whole prompt); the first token's is None."""
    idx = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    with torch.inference_mode():
        logits, _ = model(idx)
    first = TokenLogprob(ids[0], None)
    return [first, *token_logprobs(logits[0, :-1], idx[0, 1:], model.config.real_vocab_size, top)]


def stream_tokens(
    model: GPT,
    ids: list[int],
    sampling: Sampling,
    generator: torch.Generator,
    logprobs: Optional[int] = None,
    watch=None,
) -> Iterator[tuple[int, Optional[TokenLogprob]]]:
    """Yield (token id, log-probability) per sampled token, up to the limit or, with ``sampling.stop_at_eot``,
    the model's end token (``end_token``, yielded last): their text and where it ends is SampleText's. The
    log-probability (``token_logprobs``, with the ``logprobs`` most likely tokens) only when ``logprobs`` is
    given, else None. ``watch`` (inference/probe.py's Watch), if given, sees how long each decode step's
    forward took."""
    import time

    from gpt2lab.model.sampling import generate_stream

    prompt = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    seen: list[torch.Tensor] = []  # the logits each token was drawn from, when logprobs are asked
    started = [0.0, len(ids)]  # when the step now running began, and its new token's position

    def on_logits(logits: torch.Tensor) -> None:
        if watch is not None and started[1] > len(ids):  # a decode step (the first is the prefill)
            watch.see(started[1], 1e3 * (time.perf_counter() - started[0]))
        if logprobs is not None:
            seen.append(logits)

    stream = generate_stream(
        model,
        prompt,
        sampling.max_new_tokens,
        temperature=sampling.temperature,
        **sampling.filters(),
        generator=generator,
        stop_token=end_token(model) if sampling.stop_at_eot else None,  # the stream's last token
        on_logits=None if logprobs is None and watch is None else on_logits,
    )
    for tok, _ in stream:
        lp = None if logprobs is None else token_logprobs(seen.pop(), tok, model.config.real_vocab_size, logprobs)[0]
        yield int(tok[0]), lp
        started[0], started[1] = time.perf_counter(), started[1] + 1  # the next step starts


class TokenText:
    """Text of sampled tokens, one token at a time: the bytes of a character split across
    tokens are held back until it is complete; ids past the tokenizer's vocabulary show as <|id|>.
    ``model``: whose tokenizer (data/tokenizer.for_model)."""

    def __init__(self, model: GPT) -> None:
        self.enc = for_model(model)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, t: int) -> str:
        if t >= self.enc.n_vocab:  # a model whose vocabulary outgrows GPT-2's: show the id, do not hide it
            return self.decoder.decode(b"", final=True) + f"<|{t}|>"
        return self.decoder.decode(self.enc.decode_single_token_bytes(t))

    def flush(self) -> str:
        return self.decoder.decode(b"", final=True)


class StopString:
    """A stop string and its prefix function (Knuth-Morris-Pratt): ``border[i]``, the longest proper prefix
    of ``text[: i + 1]`` that also ends it. The table grows only as far as a text has matched the string, one
    entry a character matched, so a stop string of any length costs what the text matched of it, never
    its own length; one object serves every choice of a request (the engine's thread alone grows it)."""

    def __init__(self, text: str) -> None:
        self.text, self.border = text, [0]

    def __len__(self) -> int:
        return len(self.text)

    def step(self, q: int, c: str) -> int:
        """The characters of the string matched after ``c``, ``q`` being those matched before it (amortised O(1))."""
        s, border = self.text, self.border
        while q and s[q] != c:
            q = border[q - 1]
        if s[q] != c:
            return q
        if q == len(border) and q + 1 < len(s):  # border[q] is the next a mismatch may need
            k = border[q - 1]  # q >= 1: border[0] is there from the start
            while k and s[q] != s[k]:
                k = border[k - 1]
            border.append(k + (s[q] == s[k]))
        return q + 1


class StopFilter:
    """Cuts a growing text where a stop string first ends (of several ending at the same character, before
    the longest); holds back the tail that may begin one, emitting each character once the text past it
    shows that no stop string starts there. Each stop string is an incremental matcher (``StopString``),
    so a piece costs O(1) a character and a stop string, whatever the strings' lengths; ``stops`` may
    be StopStrings a request's choices share."""

    def __init__(self, stops: list) -> None:
        self.stops = [s if isinstance(s, StopString) else StopString(s) for s in stops if s]  # '' stops nothing
        self.matched = [0] * len(self.stops)  # characters of each stop string the text ends with
        self.pending: collections.deque[str] = collections.deque()  # the held-back text, in pieces
        self.held = 0  # its length

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was reached)."""
        if not self.stops:  # nothing to hold back (gpt2lab sample, most requests): no per-character work
            return piece, False
        self.pending.append(piece)
        self.held += len(piece)
        for j, c in enumerate(piece):
            ended = 0
            for i, stop in enumerate(self.stops):
                self.matched[i] = q = stop.step(self.matched[i], c)
                if q == len(stop):
                    ended = max(ended, q)
            if ended:
                text = self.flush()
                return text[: len(text) - (len(piece) - j - 1) - ended], True
        return self._emit(self.held - max(self.matched, default=0)), False

    def _emit(self, n: int) -> str:
        """The first ``n`` held-back characters, no longer held."""
        out, self.held = [], self.held - n
        while n:
            head = self.pending.popleft()
            if len(head) > n:
                head, rest = head[:n], head[n:]
                self.pending.appendleft(rest)
            out.append(head)
            n -= len(head)
        return "".join(out)

    def flush(self) -> str:
        return self._emit(self.held)


class SampleText:
    """One sample's text token by token, and the one rule of where it ends (both of serve's workers): at
    ``model``'s end token (when ``sampling.stop_at_eot``), where a stop string is reached (StopFilter) or after
    ``max_new_tokens``. ``reason``: None while it goes on, then "stop" or "length"; ``tokens``: those sampled
    (the end token is none of them)."""

    def __init__(self, model: GPT, sampling: Sampling, stops: list) -> None:
        self.text, self.stop, self.tokens, self.reason = TokenText(model), StopFilter(stops), 0, None
        self.end, self.limit = end_token(model) if sampling.stop_at_eot else None, sampling.max_new_tokens

    def feed(self, t: Optional[int]) -> tuple[Optional[str], list[str]]:
        """(The text token ``t`` adds, None for the end token or None (the text ended before it); the texts
        that close the sample once it ends, [] while it goes on)."""
        piece = None
        if t is not None and t != self.end:
            self.tokens += 1
            piece, hit = self.stop.feed(self.text.feed(t))
            if hit or self.tokens < self.limit:
                self.reason = "stop" if hit else None
                return piece, []
        text, hit = self.stop.feed(self.text.flush())
        self.reason = "length" if not hit and self.tokens == self.limit else "stop"
        return piece, [text] * bool(text) + ([] if hit else [self.stop.flush()])  # '' once a stop string cut it
