"""The inference flags of every command that runs a trained model (sample, serve, eval, bench
sample/serve): one set, one set of defaults. Torch-free, so building the CLI stays cheap."""

from __future__ import annotations

from gpt2lab.system.choices import DTYPE_CHOICES, LINEAR_CHOICES, QUANTIZE_CHOICES


def add_inference_flags(p) -> None:
    """``--dtype``, ``--quantize`` and ``--cpu-linear`` (decided in inference/choice.py)."""
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="the dtype the weights are held and multiplied in; auto: the fastest measured for this model on this "
        "machine, the same for sample, serve and eval (cached; gpt2lab env lists it) (default: %(default)s)",
    )
    p.add_argument(
        "--quantize",
        default="none",
        choices=QUANTIZE_CHOICES,
        help="int8: weight-only int8 linears (per-row scales), activations in --dtype; quality in "
        "docs/benchmarks.md (default: %(default)s)",
    )
    p.add_argument(
        "--cpu-linear",
        default="auto",
        choices=LINEAR_CHOICES,
        help="on a CPU: packed (weights prepacked by oneDNN), plain (as stored or column-major) or auto "
        "(measured along with the dtypes) (default: %(default)s)",
    )


def inference_request(args, workload: str):
    """The InferenceRequest of a command's inference flags (one row)."""
    from gpt2lab.inference.choice import InferenceRequest

    return InferenceRequest(args.dtype, args.quantize, args.cpu_linear, workload)
