"""gpt2lab serve: an OpenAI-compatible completions API and a playground page for one or more models."""
from __future__ import annotations

import argparse
import sys

from gpt2lab.commands import add_inference_dtype_flag


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


def model_names(specs: list[str]) -> dict[str, str]:
    """API model id -> model spec; ``NAME=MODEL`` names a model, else the spec is its id."""
    out: dict[str, str] = {}
    for spec in specs:
        name, _, path = spec.partition("=") if "=" in spec else (spec, "", spec)
        if not name or not path:
            raise SystemExit(f"--model {spec}: expected MODEL or NAME=MODEL")
        if name in out:
            raise SystemExit(f"--model {spec}: the id {name!r} is given twice; name them apart with NAME=MODEL")
        out[name] = path
    return out


def load_workers(specs: list[str], device_name: str, dtype: str) -> dict:
    """One ModelWorker per ``--model``, loaded before the server binds (errors come first)."""
    from gpt2lab.completion import load_for_inference
    from gpt2lab.dist import pick_device
    from gpt2lab.serve.engine import ModelWorker

    from gpt2lab.runtime import inference_dtype

    device = pick_device(device_name)
    models = {name: load_for_inference(path, device) for name, path in model_names(specs).items()}
    dtype = inference_dtype(device, dtype, "gpt2lab serve")
    return {name: ModelWorker(name, model, device, dtype) for name, model in models.items()}


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
