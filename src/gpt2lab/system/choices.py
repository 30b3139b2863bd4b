"""The names a run's settings accept, defined once (torch-free, so building the CLI stays cheap), and
``finite_float`` and ``positive_int``, the types of number flags.

"auto" is decided by gpt2lab.system.runtime (dtype, compile) and
gpt2lab.distributed.parallel.choose_strategy (strategy).
"""

# Autocast dtypes by torch name (torch.<name>).
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ("auto", *DTYPES)
COMPILE_CHOICES = ("auto", "true", "false")
# How several processes share the model.
STRATEGIES = ("ddp", "fsdp")
STRATEGY_CHOICES = ("auto", *STRATEGIES)
# Optimizers, LR schedules and Muon's Newton-Schulz dtypes (gpt2lab.train.optim; "auto": system.runtime).
OPTIMIZERS = ("adamw", "muon")
# The update --optimizer muon applies to the blocks' matrices: torch's Muon, or NorMuon's per-neuron normalisation.
MUON_VARIANTS = ("muon", "normuon")
LR_SCHEDULES = ("cosine", "wsd")
NS_DTYPE_CHOICES = ("auto", "float32", "bfloat16")
# Inference (gpt2lab.inference.choice): weight-only quantization, and the CPU linear kernels
# ("plain": F.linear on the weight as stored or column-major; "auto": measured).
QUANTIZE_CHOICES = ("none", "int8")
LINEAR_CHOICES = ("auto", "packed", "plain")
# How HellaSwag's rows share a forward pass (gpt2lab.evals.hellaswag.resolve_strategy).
HELLASWAG_STRATEGIES = ("auto", "padded", "shared")


def finite_float(text: str) -> float:
    """argparse's type for a number flag: a float that is neither infinite nor NaN ("inf", "nan" and
    "1e999" parse as floats, and no setting means them)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse's type for a count flag (``--limit``, ``--batch-size``): a whole number, at least 1."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value
