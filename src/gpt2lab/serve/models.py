"""The models a server holds: ``--model [NAME=]MODEL`` specs -> one worker per model."""
from __future__ import annotations

from gpt2lab.serve.limits import Limits


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


def add_cpu_linear_flag(p) -> None:
    """``--cpu-linear`` for ``serve`` and ``bench serve``."""
    from gpt2lab.inference.packed import LINEAR_CHOICES

    p.add_argument("--cpu-linear", choices=LINEAR_CHOICES, default="auto",
                   help="batching on a CPU in fp32: multiply by weights prepacked by oneDNN (packed) or as "
                        "stored (plain); auto measures both on the model's largest weights at start and keeps "
                        "packed where it is faster at a full batch and not slower for one row (default auto)")


def load_workers(specs: list[str], device_name: str, dtype: str, limits: Limits | None = None,
                 deterministic: bool = False, linear: str = "auto") -> dict:
    """One worker per ``--model``, loaded before the server starts serving (errors come first): batching
    (serve/batch.py), or requests in turns with ``deterministic`` (serve/engine.py).

    ``linear`` (``--cpu-linear``): the batching worker's kernel for the model's linears,
    ``packed`` (oneDNN's prepacked weights, inference/packed.py), ``plain`` or ``auto`` (measured
    per model); turns keep the plain kernel, whose numbers equal ``gpt2lab sample``'s."""
    import sys

    from gpt2lab.inference.completion import load_for_inference
    from gpt2lab.inference.packed import decide, pack_linears
    from gpt2lab.distributed.dist import pick_device
    from gpt2lab.system.errors import UsageError
    from gpt2lab.system.runtime import inference_dtype
    from gpt2lab.serve.batch import BatchWorker
    from gpt2lab.serve.engine import TurnsWorker

    device = pick_device(device_name)
    models = {name: load_for_inference(path, device) for name, path in model_names(specs).items()}
    dtype = inference_dtype(device, dtype, "gpt2lab serve")
    if deterministic:
        return {name: TurnsWorker(name, model, device, dtype, limits) for name, model in models.items()}
    rows = (limits or Limits()).max_batch
    workers = {}
    for name, model in models.items():
        try:
            choice = decide(model, linear, device, dtype, rows)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if choice.value == "packed":
            pack_linears(model, rows)
        print(f"gpt2lab serve: {name}: linears {choice.value} ({choice.reason})", file=sys.stderr, flush=True)
        workers[name] = BatchWorker(name, model, device, dtype, limits, choice)
    return workers
