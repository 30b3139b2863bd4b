"""The names a run's settings accept, defined once (torch-free, so building the CLI stays cheap).

"auto" is decided by gpt2lab.system.runtime (dtype, compile) and
gpt2lab.distributed.parallel.choose_strategy (strategy).
"""

# Autocast dtypes by torch name; gpt2lab.distributed.dist.DTYPES maps them to torch dtypes.
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
