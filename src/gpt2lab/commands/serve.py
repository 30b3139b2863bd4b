"""gpt2lab serve: an OpenAI-compatible completions API and a playground page for one or more models."""
from __future__ import annotations

import argparse
import sys

from gpt2lab.commands import add_inference_dtype_flag
from gpt2lab.serve.models import load_workers, model_names


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve models over an OpenAI-compatible API, with a playground page at /")
    p.add_argument("--model", action="append", required=True, metavar="[NAME=]MODEL",
                   help="HF name (gpt2 ... gpt2-xl), HF model dir, run dir or checkpoint dir; repeat for "
                        "several models side by side. The API's model id is NAME, else MODEL as written")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the network)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, mps or auto (cuda > mps > cpu)")
    add_inference_dtype_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from gpt2lab.serve.api import create_app
    except ImportError as e:
        raise SystemExit(f"gpt2lab serve needs FastAPI and uvicorn ({e}); pip install 'gpt2lab[serve]'") from None
    names = model_names(args.model)  # a bad --model fails before any loading
    workers = load_workers(args.model, args.device, args.dtype)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"gpt2lab serve: {', '.join(names)} at http://{host}:{args.port}/ (API: /v1/completions, /v1/models)",
          file=sys.stderr, flush=True)
    try:
        uvicorn.run(create_app(workers), host=args.host, port=args.port, log_level="warning")
    finally:
        for w in workers.values():
            w.close()
    return 0
