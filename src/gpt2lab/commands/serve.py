"""gpt2lab serve: an OpenAI-compatible completions API and a playground page for one or more models."""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import sys

from gpt2lab.inference.flags import inference_request
from gpt2lab.serve.limits import Connections, Limits, add_flags, from_flags
from gpt2lab.serve.models import load_workers
from gpt2lab.system.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED


def add_parser(sub) -> None:
    from gpt2lab.commands import DefaultsHelp, add_model_flags

    p = sub.add_parser(
        "serve",
        help="serve models over an OpenAI-compatible API, with a playground page at /",
        formatter_class=DefaultsHelp,
    )
    add_model_flags(
        p,
        action="append",
        required=True,
        metavar="[NAME=]MODEL",
        help="HF name (gpt2 ... gpt2-xl), HF model dir, run dir or checkpoint dir; repeat for "
        "several models side by side. The API's model id is NAME, else MODEL as written",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind: 127.0.0.1 is this machine only; 0.0.0.0 opens it to the network",
    )
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: the system picks a free one)")
    add_flags(p, Limits)
    add_flags(p, Connections)
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="no batching: requests take turns token by token, each exactly as `gpt2lab sample` "
        "runs it (seeded requests reproduce `sample` bit for bit; the aggregate is one stream's)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn  # noqa: F401  (the serve extra: a missing one is this one line)

        from gpt2lab.serve.connections import with_cap
        from gpt2lab.serve.server import bind, serve_here
    except ImportError as e:
        raise SystemExit(f"gpt2lab serve needs FastAPI and uvicorn ({e}); pip install 'gpt2lab[serve]'") from None
    limits = from_flags(Limits, args)
    connections = with_cap(from_flags(Connections, args))  # the connection cap resolved against the open-file limit
    sock = bind(args.host, args.port)  # a port in use fails before the models load
    try:
        workers = load_workers(args.model, args.device, inference_request(args, "serve"), limits, args.deterministic)
    except BaseException:
        sock.close()
        raise
    host = f"[{args.host}]" if ":" in args.host else args.host
    mode = "requests in turns (--deterministic)" if args.deterministic else f"batches of up to {limits.max_batch} rows"
    cap = connections.max_connections
    say = functools.partial(print, file=sys.stderr, flush=True)
    say(
        f"gpt2lab serve: {', '.join(workers)} at http://{host}:{sock.getsockname()[1]}/ "
        f"(API: /v1/completions, /v1/chat/completions, /v1/models, /metrics); {mode}, queue {limits.max_queue}"
        + (f", up to {cap} connections" if cap is not None else "")
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    # one line per request on stderr, and the connection guard's warnings (a few at most)
    for name, level in (("gpt2lab.serve.access", logging.INFO), ("gpt2lab.serve.connections", logging.WARNING)):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(level)
    said, terminated = [], []

    def stopping(ended: int) -> None:  # at Ctrl-C, the one line (cli.main's "interrupted" would come late)
        plural = "" if ended == 1 else "s"
        why = "SIGTERM" if terminated else "interrupted"
        say(
            f"gpt2lab serve: {why}; stopping"
            + (f" ({ended} open request{plural} ended with a 'server shutting down' error)" if ended else "")
        )
        said.append(ended)

    def on_sigterm(signum, frame) -> None:  # a service manager's stop: the same orderly end as Ctrl-C
        terminated.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        # the models run in this (the main) thread
        serve_here(workers, sock, stopping=stopping, connections=connections)
    except KeyboardInterrupt:
        if not said:  # not while serving: cli.main says it
            raise
        return EXIT_PREEMPTED if terminated else EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
