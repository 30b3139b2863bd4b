"""gpt2lab demo: prepare Tiny Shakespeare, train a small GPT on it, sample from it.

A few minutes on two CPU cores, from a fresh clone (``make demo``). ``--recipe fast`` (the default) trains
``shakespeare-cpu-fast``, the modern recipe; ``--recipe faithful`` trains ``shakespeare-cpu``, GPT-2's. Each
demo run gets its own run directory, so running it twice never touches an earlier run.

``--chat``: the next step, base model to chat model. It fine-tunes a base model (``--base RUN``, or the
default demo's at ``CHAT_BASE_LAYERS`` layers, trained first) on the bundled conversations (preset
``chat-cpu``: the loss on the assistant's tokens only) and shows three fixed messages answered before and
after, greedily."""

from __future__ import annotations

import argparse
import math
import os
import time

from gpt2lab.commands import program
from gpt2lab.system.choices import DTYPE_CHOICES as DTYPE_NAMES

# The demo's recipes: the preset each trains and what to say about it; the figures live in
# docs/benchmarks.md ("The demo preset"), with the machine they were measured on.
RECIPES = {"fast": "shakespeare-cpu-fast", "faithful": "shakespeare-cpu"}
WHY = {
    "fast": "the modern recipe (rotary, RMSNorm, QK-norm, ReLU^2, Muon, warmup-stable-decay): a lower "
    "validation loss than GPT-2's in the same time (measured: docs/benchmarks.md, \"The modern "
    "recipe in the demo\"); --recipe faithful trains GPT-2's",
    "faithful": "GPT-2's recipe (learned positions, LayerNorm, GELU, AdamW); the default --recipe fast "
    "reaches a lower loss in the same time",
}
# --chat without --base trains its base as the demo does but 4 layers deep (the preset: 2). Fine-tuned
# on the conversations, the 4-layer model's greedy replies to held-out messages ended their turn at
# 89.7-100% over five seeds (at least 95% at four), the 2-layer one's at 57-100% (three); the rest loop
# (docs/benchmarks.md, "Fine-tuning on conversations"). It costs ~15 s more.
CHAT_BASE_LAYERS = 4


def add_parser(sub) -> None:
    from gpt2lab.commands import DefaultsHelp

    p = sub.add_parser(
        "demo",
        help="prepare Tiny Shakespeare, train a small GPT, sample (minutes on CPU)",
        formatter_class=DefaultsHelp,
    )
    p.add_argument(
        "--recipe",
        default="fast",
        choices=sorted(RECIPES),
        help="fast: the modern recipe (shakespeare-cpu-fast); faithful: GPT-2's (shakespeare-cpu)",
    )
    p.add_argument("--data", default="data/tinyshakespeare", help="where the token shards go (reused if complete)")
    p.add_argument("--out", help="run directory (default runs/<preset>-<time>; with --chat, the chat model's)")
    p.add_argument("--max-steps", type=int, help="override the preset's step count (with --chat: of each run)")
    p.add_argument("--prompt", default="ROMEO:", help="prompt of the final sample")
    p.add_argument("--tokens", type=int, default=200, help="tokens in the final sample")
    p.add_argument("--seed", type=int, default=1337, help="seed of the final sample")
    p.add_argument("--dtype", default="auto", choices=DTYPE_NAMES, help="training dtype; auto: bf16 where it is faster")
    p.add_argument(
        "--chat",
        action="store_true",
        help="fine-tune a base model into a chat model on the bundled conversations (preset chat-cpu) "
        "and show three messages answered before and after",
    )
    p.add_argument(
        "--base",
        metavar="RUN",
        help=f"with --chat: the base model (default: the default demo's, trained first {CHAT_BASE_LAYERS} layers deep)",
    )
    p.add_argument("--chat-data", default="data/chitchat", help="with --chat: where the conversations' shards go")
    p.set_defaults(func=run)


# What each demo prepares (gpt2lab prepare's sources), as its lines name it.
SOURCES = {"tinyshakespeare": "Tiny Shakespeare", "chitchat": "the bundled conversations"}
# The chat demo's messages: small talk, as the bundled conversations are.
CHAT_PROMPTS = ("Hi! How are you doing today?", "What do you like to do on the weekend?", "Do you have any pets?")


def run(args: argparse.Namespace) -> int:
    if args.base and not args.chat:
        from gpt2lab.system.errors import UsageError

        raise UsageError("--base is for --chat (the model fine-tuned into a chat model); drop it or add --chat")
    return run_chat(args) if args.chat else run_base(args)


def _train(tag: str, source: str, preset: str, why: str = "", **flags) -> None:
    """Prepare ``source`` into ``flags["data"]`` (reused if complete), then train what `gpt2lab train --preset
    PRESET --progress false` with ``flags`` (those not None) as its flags trains (that command continues the
    run if it stops: the demo starts anew), saying so after ``tag``."""
    from gpt2lab.commands import train
    from gpt2lab.data.prepare import prepare
    from gpt2lab.distributed.dist import init_distributed
    from gpt2lab.train.run import train as train_run

    print(f"{tag} preparing {SOURCES[source]} into {flags['data']}", flush=True)
    prepare(source, flags["data"], progress=False)
    words = ["train", "--preset", preset, "--progress", "false"]
    words += [w for k, v in flags.items() if v is not None for w in (f"--{k.replace('_', '-')}", str(v))]
    parser = argparse.ArgumentParser()
    train.add_parser(parser.add_subparsers())
    request = train.request_from(parser.parse_args(words, argparse.Namespace(argv=words)))
    print(f"{tag} training {preset} for {request.get('max_steps')} steps into {request.out}{why}", flush=True)
    train_run(request, init_distributed(str(request.get("device"))))


def _new_out(name: str) -> str:
    return os.path.join("runs", time.strftime(f"{name}-%Y%m%d-%H%M%S"))


def run_base(args: argparse.Namespace) -> int:
    import torch

    from gpt2lab.commands.sample import stream_one
    from gpt2lab.inference.completion import Sampling, prompt_ids

    t0 = time.perf_counter()
    preset, out = RECIPES[args.recipe], args.out or _new_out(RECIPES[args.recipe])
    print(f"[demo] recipe {args.recipe}: {WHY[args.recipe]}", flush=True)
    flags = dict(data=args.data, out=out, dtype=args.dtype, max_steps=args.max_steps)
    _train("[demo]", "tinyshakespeare", preset, **flags, n_layer=getattr(args, "n_layer", None))
    model, vals = _load(out), val_losses(out)
    if vals:  # against a uniform guess over the model's outputs
        vocab = model.config.vocab_size
        print(f"[demo] validation loss {vals[-1]:.2f} (chance: ln {vocab} = {math.log(vocab):.2f})", flush=True)
    print(f"[demo] sample from the trained model ({args.prompt!r}, seed {args.seed}):\n", flush=True)
    # as `gpt2lab sample --temperature 0.8` prints it
    gen = torch.Generator().manual_seed(args.seed)
    stream_one(model, prompt_ids(args.prompt, model), args.prompt, Sampling(args.tokens, temperature=0.8), gen)
    print(f"\n[demo] done in {time.perf_counter() - t0:.0f} s. run dir: {out}")
    print(f"[demo] more samples: {program()} sample --model {out} --prompt 'JULIET:'", flush=True)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    """Base model -> chat model on the bundled conversations; three messages answered before and after."""
    t0 = time.perf_counter()
    base, out = args.base, args.out or _new_out("chat-cpu")
    if base is None:
        base = _new_out(RECIPES[args.recipe])
        print(f"[demo --chat] no --base: the default demo's model first, {CHAT_BASE_LAYERS} layers deep", flush=True)
        run_base(argparse.Namespace(**{**vars(args), "out": base, "n_layer": CHAT_BASE_LAYERS}))
    before = chat_replies(base)
    # as `gpt2lab train --preset chat-cpu --init-from BASE`: the architecture comes from the base
    why = f", fine-tuning {base} (the loss on the assistant's tokens only)"
    flags = dict(data=args.chat_data, out=out, dtype=args.dtype, max_steps=args.max_steps, init_from=base)
    _train("[demo --chat]", "chitchat", "chat-cpu", why, **flags)
    after, losses = chat_replies(out), val_losses(out)
    if len(losses) >= 2:
        said = f"{losses[0]:.2f} before, {losses[-1]:.2f} after"
        print(f"[demo --chat] loss on the held-out conversations' assistant tokens: {said}", flush=True)
    for message, old, new in zip(CHAT_PROMPTS, before, after):
        print(f"\nUser: {message}\n  base model: {_shown(old)}\n  chat model: {_shown(new)}", flush=True)
    print(f"\n[demo --chat] done in {time.perf_counter() - t0:.0f} s. chat model: {out}")
    print(f"[demo --chat] talk to it: {program()} sample --model {out} --chat", flush=True)
    return 0


def _load(model_dir: str):
    """The model held as ``gpt2lab sample`` holds it (the dtype and kernels measured fastest on this CPU)."""
    import torch

    from gpt2lab.inference.completion import load_for_inference

    return load_for_inference(model_dir, torch.device("cpu"), command="gpt2lab demo")[0]


def chat_replies(model_dir: str, max_tokens: int = 48) -> list:
    """The greedy replies of a model to CHAT_PROMPTS, each a conversation of its own (evals.chat's)."""
    from gpt2lab.data.chat import encode_chat
    from gpt2lab.evals.chat import greedy_reply

    model = _load(model_dir)
    return [
        greedy_reply(model, encode_chat([("user", m)], add_generation_prompt=True)[0], max_tokens) for m in CHAT_PROMPTS
    ]


def _shown(reply) -> str:
    text = reply.text.replace("\n", " / ")
    return text if reply.ended else f"{text} ... (did not end its turn in {len(reply.ids)} tokens)"


def val_losses(run_dir: str) -> list:
    """The validation losses in the run's metrics.jsonl, in order."""
    from gpt2lab.observe.metrics import read_metrics

    return [r["val_loss"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "val_loss" in r]
