"""The models a server holds: ``--model [NAME=]MODEL`` specs -> one worker per model."""

from __future__ import annotations

from gpt2lab.serve.limits import Limits
from gpt2lab.system.errors import CheckpointError, UsageError


def model_names(specs: list[str]) -> dict[str, str]:
    """API model id -> model spec; ``NAME=MODEL`` names a model, else the spec is its id. A spec
    that names no model, or an id given twice, is a UsageError (exit 2) naming --model."""
    out: dict[str, str] = {}
    for spec in specs:
        name, _, path = spec.partition("=") if "=" in spec else (spec, "", spec)
        if not name or not path:
            raise UsageError(f"--model {spec}: expected MODEL or NAME=MODEL")
        if name in out:
            raise UsageError(f"--model {spec}: the id {name!r} is given twice; name them apart with NAME=MODEL")
        out[name] = path
    return out


def load_workers(
    specs: list[str], device_name: str, request=None, limits: Limits | None = None, deterministic: bool = False
) -> dict:
    """One worker per ``--model``, loaded and prepared before the server starts serving (errors come
    first): batching, or rows in turns with ``deterministic`` (serve/batch.py).

    ``request`` (an InferenceRequest: the --dtype, --quantize, --cpu-linear flags) is prepared for
    the batching worker's workload (inference/probe.py): ``sample``'s dtype, one per model and machine,
    with the kernel of that dtype best at one row and ``--max-batch`` rows; in turns each request runs
    exactly as ``gpt2lab sample`` runs it, so the model is prepared as ``sample`` prepares it (one row),
    and a seeded request gives ``sample``'s tokens."""
    import dataclasses

    from gpt2lab.distributed.dist import pick_device
    from gpt2lab.inference.choice import InferenceRequest
    from gpt2lab.inference.completion import check_request, load_for_inference
    from gpt2lab.serve.batch import Worker
    from gpt2lab.weights.load import WeightsError, model_source, named

    device = pick_device(device_name)
    limits = limits or Limits()
    workload = {"workload": "sample", "rows": 1} if deterministic else {"workload": "serve", "rows": limits.max_batch}
    request = dataclasses.replace(request or InferenceRequest(), **workload)
    check_request(request, device)  # a --dtype or --quantize this device cannot run fails before loading
    names = model_names(specs)
    for path in names.values():  # every source read (not its weights) before any is loaded and measured
        try:
            model_source(path)
        except CheckpointError:  # its own one line
            raise
        except (OSError, ValueError, KeyError, RuntimeError) as e:  # as load_model says it, naming --model
            raise WeightsError(named("--model", path, e)) from e
    workers = {}
    for name, path in names.items():
        model, decision = load_for_inference(path, device, request, f"gpt2lab serve: {name}")
        workers[name] = Worker(name, model, device, limits, decision=decision, turns=deterministic)
    return workers
