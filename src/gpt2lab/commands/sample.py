"""gpt2lab sample: stream text from a model (hub name, HF directory, run dir or checkpoint)."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import TYPE_CHECKING

from gpt2lab.model.sampling_defaults import SAMPLING
from gpt2lab.system.choices import finite_float
from gpt2lab.system.errors import UsageError

if TYPE_CHECKING:
    import torch


def add_parser(sub) -> None:
    from gpt2lab.commands import DefaultsHelp, add_model_flags

    p = sub.add_parser(
        "sample",
        help="generate text from a model, streamed as it is sampled",
        description="Generate text from a model, streamed as it is sampled. Its sampling defaults are the "
        "server's and generate()'s: a request with the same seed gives this command's text.",
        formatter_class=DefaultsHelp,
    )
    add_model_flags(p, default="gpt2")
    p.add_argument(
        "--prompt",
        default="Hello, I'm a language model,",
        help="text to continue ('' starts from <|endoftext|>); with --max-new-tokens it must fit the model's context",
    )
    for flag, kind, default, says in (  # the sampling defaults: one set with the server and generate()
        ("--num-samples", int, 1, "how many continuations, one after another"),
        ("--max-new-tokens", int, 100, "tokens to generate after the prompt"),
        ("--temperature", finite_float, SAMPLING.temperature, "0 means greedy"),
        ("--top-k", int, SAMPLING.top_k, "sample from the k most likely tokens; 0 keeps every token"),
        ("--top-p", finite_float, SAMPLING.top_p, "nucleus sampling: the likeliest tokens holding this mass (1: all)"),
        ("--seed", int, 42, "seed of the sampling generator"),
    ):
        p.add_argument(flag, type=kind, default=default, help=says)
    p.add_argument(
        "--stop-at-eot",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end a sample at the model's end token: <|endoftext|>, a chat model's <|im_end|>",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="talk turn by turn: each stdin line is your message, the reply streams back (in the model's chat "
        "template, or 'User:'/'Assistant:' lines for a base model); an empty line ends it; --prompt is unused",
    )
    p.add_argument("--system", default=None, help="with --chat: a system message opening the conversation")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    """Flag values that cannot work: a UsageError (exit 2) naming the flag."""
    for flag, bad, must in (
        ("num_samples", args.num_samples < 1, "must be at least 1"),
        ("max_new_tokens", args.max_new_tokens < 0, "must be >= 0"),
        ("temperature", args.temperature < 0, "must be >= 0 (0 is greedy)"),
        ("top_k", args.top_k < 0, "must be >= 0 (0 keeps every token)"),
        ("top_p", not 0 < args.top_p <= 1, "must be in (0, 1]"),
    ):
        if bad:
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: {must}")


def run(args: argparse.Namespace) -> int:
    from gpt2lab.commands import note_live
    from gpt2lab.distributed.dist import pick_device
    from gpt2lab.inference.completion import PromptError, Sampling, load_for_inference, prompt_ids, seeded_generator
    from gpt2lab.inference.flags import inference_request
    from gpt2lab.inference.probe import watch

    _check(args)
    device = pick_device(args.device)
    ids: list[int] = []

    def check(model) -> None:  # before the model is prepared (which may measure for a while)
        from gpt2lab.inference.completion import fits_context

        try:
            ids.extend(prompt_ids(args.prompt, model))
        except PromptError as e:
            raise SystemExit(f"--prompt: {e}") from None
        n, context = len(ids), model.config.block_size
        if not fits_context(n, args.max_new_tokens, context):  # the server's rule, before any text is printed
            room = f"shorten the prompt to under {context} tokens"
            if n < context:
                room = f"lower --max-new-tokens to {context - n} or shorten the prompt"
            raise UsageError(
                f"--prompt is {n} tokens and --max-new-tokens {args.max_new_tokens}: {n + args.max_new_tokens} "
                f"tokens, more than this model's context of {context} tokens; {room}"
            )

    # a bad --model, --dtype, --prompt or --max-new-tokens fails before any other output (--chat: each turn)
    model, decision = load_for_inference(
        args.model, device, inference_request(args, "sample"), "gpt2lab sample", check=None if args.chat else check
    )
    note_live("gpt2lab sample", [args.model])  # a run still training: its newest checkpoint is read
    generator = seeded_generator(device, args.seed)
    seen = watch(decision, model, device, "gpt2lab sample")  # steps far slower than measured: measured again
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.stop_at_eot or args.chat)
    if args.chat:
        return _chat(model, args, sampling, generator, seen)
    for i in range(args.num_samples):
        print(f"--- sample {i + 1}/{args.num_samples}", flush=True)
        stream_one(model, ids, args.prompt, sampling, generator, seen)
    return 0


def stream_one(model, ids: list[int], prompt, sampling, generator: torch.Generator, watch=None, stops=(), strip=False):
    """Print ``prompt`` (None: nothing), then each token's text as it comes, up to the end completion.SampleText
    finds (the model's end token, one of ``stops``, the limit); ``strip``: without the leading whitespace.
    Returns the text sampled."""
    from gpt2lab.inference.completion import SampleText, prompt_text, stream_tokens

    if prompt is not None:  # the text the model was given (an undecodable byte as U+FFFD)
        print(prompt_text(prompt), end="", flush=True)
    texts, sample = [], SampleText(model, sampling, list(stops))
    for tok, _ in stream_tokens(model, ids, sampling, generator, watch=watch):
        piece, tail = sample.feed(tok)
        text = "".join([piece or "", *tail])
        texts.append(text.lstrip() if strip and not any(texts) else text)
        print(texts[-1], end="", flush=True)
        if sample.reason:
            break
    print(flush=True)
    return "".join(texts)


def _chat(model, args: argparse.Namespace, sampling, generator: torch.Generator, watch=None) -> int:
    """Turn by turn: each stdin line a user message, the reply streamed (inference/chat.py's prompt,
    ended by the server's rule: the model's end token or its template's stop strings). The oldest turns
    leave the prompt once the conversation outgrows the context (said once)."""
    from gpt2lab.inference.chat import chat_prompt, note

    say = functools.partial(print, file=sys.stderr, flush=True)
    say(f"gpt2lab sample --chat: {note(model.config, 'this chat')}; type a message, an empty line or Ctrl-D ends")
    system = [("system", args.system)] if args.system else []
    turns: list[tuple[str, str]] = []
    told = False
    while True:
        if sys.stdin.isatty():
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line.strip():
            return 0
        turns.append(("user", line.rstrip("\n")))
        prompt = chat_prompt(model, system + turns)
        while len(prompt.ids) + args.max_new_tokens > model.config.block_size and len(turns) > 1:
            turns = turns[2:] if turns[0][0] == "user" and len(turns) > 2 else turns[1:]
            prompt = chat_prompt(model, system + turns)
            if not told:
                say(
                    "gpt2lab sample --chat: note: the conversation outgrew the model's context "
                    f"({model.config.block_size} tokens); its first turns are left out"
                )
                told = True
        reply = stream_one(model, prompt.ids, None, sampling, generator, watch, prompt.stops, prompt.strip)
        turns.append(("assistant", reply))
