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


def load_workers(specs: list[str], device_name: str, dtype: str, limits: Limits | None = None,
                 deterministic: bool = False) -> dict:
    """One worker per ``--model``, loaded before the server binds (errors come first): batching
    (serve/batch.py), or requests in turns with ``deterministic`` (serve/engine.py)."""
    from gpt2lab.inference.completion import load_for_inference
    from gpt2lab.distributed.dist import pick_device
    from gpt2lab.system.runtime import inference_dtype
    from gpt2lab.serve.batch import BatchWorker
    from gpt2lab.serve.engine import TurnsWorker

    device = pick_device(device_name)
    models = {name: load_for_inference(path, device) for name, path in model_names(specs).items()}
    dtype = inference_dtype(device, dtype, "gpt2lab serve")
    kind = TurnsWorker if deterministic else BatchWorker
    return {name: kind(name, model, device, dtype, limits) for name, model in models.items()}
