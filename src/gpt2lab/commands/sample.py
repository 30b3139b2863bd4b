"""gpt2lab sample: stream text from a model (hub name, HF directory, run dir or checkpoint)."""
from __future__ import annotations

import argparse
import codecs
import sys

from typing import TYPE_CHECKING

from gpt2lab.commands import DTYPE_NAMES
from gpt2lab.tokenizer import EOT_ID, get_tokenizer

if TYPE_CHECKING:
    import torch


def add_parser(sub) -> None:
    p = sub.add_parser("sample", help="generate text from a model, streamed as it is sampled")
    p.add_argument("--model", default="gpt2",
                   help="HF name (gpt2, gpt2-medium, gpt2-large, gpt2-xl), HF model dir, run dir or checkpoint dir")
    p.add_argument("--prompt", default="Hello, I'm a language model,",
                   help="text to continue ('' starts from <|endoftext|>)")
    p.add_argument("--num-samples", type=int, default=1, help="how many continuations, one after another")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=50, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: smallest set holding this much mass")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, mps or auto (cuda > mps > cpu)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                   help="autocast dtype; auto (default): bf16 where the device runs it faster, else fp32")
    p.add_argument("--stop-at-eot", action=argparse.BooleanOptionalAction, default=True,
                   help="end a sample at <|endoftext|> (default on)")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    if args.num_samples < 1:
        raise SystemExit(f"--num-samples {args.num_samples}: must be at least 1")
    if args.max_new_tokens < 0:
        raise SystemExit(f"--max-new-tokens {args.max_new_tokens}: must be >= 0")
    if args.temperature < 0:
        raise SystemExit(f"--temperature {args.temperature}: must be >= 0 (0 is greedy)")
    if args.top_k is not None and args.top_k < 0:
        raise SystemExit(f"--top-k {args.top_k}: must be >= 0 (0 keeps every token)")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise SystemExit(f"--top-p {args.top_p}: must be in (0, 1]")


def _prompt_ids(text: str, vocab: int) -> list[int]:
    ids = get_tokenizer().encode(text, allowed_special={"<|endoftext|>"}) if text else [EOT_ID]
    if max(ids) >= vocab:
        raise SystemExit(
            f"--prompt: token id {max(ids)} is outside the model's vocabulary of {vocab}; "
            "this model was not trained with the GPT-2 tokenizer"
        )
    return ids


def run(args: argparse.Namespace) -> int:
    import torch

    from gpt2lab.dist import autocast, pick_device
    from gpt2lab.load import load_model
    from gpt2lab.runtime import inference_dtype

    _check(args)
    device = pick_device(args.device)
    dtype = inference_dtype(device, args.dtype, "gpt2lab sample")
    model = load_model(args.model, device)
    if device.type == "cpu":
        model.use_decode_layout()  # faster one-row matmuls on CPU; same numbers
    ids = _prompt_ids(args.prompt, model.config.real_vocab_size)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    prompt = torch.tensor([ids], dtype=torch.long, device=device)
    for i in range(args.num_samples):
        print(f"--- sample {i + 1}/{args.num_samples}", flush=True)
        with autocast(device, dtype):
            _stream_one(model, prompt, args, generator)
    return 0


def _stream_one(model, prompt: torch.Tensor, args: argparse.Namespace, generator: torch.Generator) -> None:
    """Print the prompt, then each token as it comes; bytes of a character split across
    tokens are held back until the character is complete."""
    from gpt2lab.generate import generate_stream

    enc = get_tokenizer()
    out = sys.stdout
    out.write(args.prompt)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    stop = EOT_ID if args.stop_at_eot else None
    stream = generate_stream(model, prompt, args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k or None, top_p=args.top_p, generator=generator, stop_token=stop)
    for tok, finished in stream:
        t = int(tok[0])
        if stop is not None and t == stop:
            break
        if t >= enc.n_vocab:  # a model whose vocabulary outgrows GPT-2's: show the id, do not hide it
            out.write(decoder.decode(b"", final=True) + f"<|{t}|>")
        else:
            out.write(decoder.decode(enc.decode_single_token_bytes(t)))
        out.flush()
    out.write(decoder.decode(b"", final=True) + "\n")
    out.flush()
