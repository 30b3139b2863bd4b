"""Run settings: ``TrainConfig``, one dataclass of sections, and its one nested layout.

``TrainConfig`` has three top-level fields (data, out, seed) and one section per concern, each a
dataclass of its own: ``model`` (a ``GPTConfig``, gpt2lab/model/config.py, the only definition
of the model's fields), ``batch``, ``optim``, ``system``, ``eval``, ``checkpoint``, ``logging``,
``spike``, ``finetune`` and ``parallel`` (``cfg.optim.max_lr``). Every default and every check of
a field lives with the field. A field keeps one flat name in every section (``max_lr``), so
flags and TOML keys stay flat; ``FIELDS`` and ``SECTION_OF``, derived from the dataclasses, say what
each flat name is and where it lives: the flags (train/settings.py), the type checks, the defaults
and the settings a resume must keep (train/plan.py) all read them. config.json is written nested,
with its format version (``save_config``; its readers refuse a file of another version:
system/formats.py); ``nest_config`` is the one place that turns the flat form of flags, TOML keys
and Python overrides, and mixed ones, into the nested one, and ``merge_config`` lays one nested
dict over another field by field. Where settings come from (presets, ``--config`` files, flags):
train/settings.py.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union, get_type_hints

from gpt2lab.model.config import (
    ABOVE_0,
    AT_LEAST_0,
    AT_LEAST_1,
    CHAT_VOCAB_SIZES,
    FRACTION,
    GPT2_VOCAB_SIZE,
    PADDED_VOCAB_SIZE,
    GPTConfig,
    check_fields,
    check_types,
    config_value,
    gpt_config,
)
from gpt2lab.system import formats
from gpt2lab.system.choices import (
    COMPILE_CHOICES,
    DTYPE_CHOICES,
    LR_SCHEDULES,
    MUON_VARIANTS,
    NS_DTYPE_CHOICES,
    OPTIMIZERS,
    STRATEGY_CHOICES,
)
from gpt2lab.system.errors import ConfigError

# Muon's orthogonalisation (--muon-orth; train/optim.py): the quintic Newton-Schulz iteration or Polar Express.
MUON_ORTHS = ("newton_schulz", "polar_express")
# Layers --lora-targets may name (peft matches a module whose name ends with ".TARGET").
LORA_TARGETS = ("c_attn", "c_proj", "c_fc", "attn.c_proj", "mlp.c_proj")


def _f(default: Any, help: str, within: Optional[str] = None, choices: tuple = (), keep: Union[bool, str] = False):
    # within: a number's range, an interval ("[0, 1)"); choices: a text field's values (also its flag's);
    # keep: the field changes what the run trains, so a resume must keep the value its checkpoint trained
    # with (train.plan.check_resume_settings); "NAME" or "NAME=VALUE": only where that field is set (to VALUE)
    return field(default=default, metadata={"help": help, "within": within, "choices": choices, "keep": keep})


MUON, LORA = "optimizer=muon", "lora_rank"  # the fields a resume keeps only with Muon, only with LoRA


class _Section:
    """One concern's fields (a section of TrainConfig): each checked against its own
    ``within`` and ``choices`` (check_fields); a subclass adds the checks among its fields."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass
class BatchConfig(_Section):
    micro_batch_size: int = _f(64, "sequences per forward/backward on each process", AT_LEAST_1)
    seq_len: int = _f(1024, "tokens per sequence (at most block_size)", AT_LEAST_1, keep=True)
    total_batch_tokens: int = _f(
        524288,
        "tokens per optimizer step over all processes; accumulation = this / (micro_batch_size * seq_len * world size)",
        AT_LEAST_1,
        keep=True,
    )
    # The batch-size ramp (a speedrun lever): a pure function of the step (train.schedule.accum_at), so a
    # resumed run, whose loader continues from its saved position, takes the same batches.
    batch_ramp_steps: int = _f(
        0,
        "ramp the tokens per step over the first N steps, linearly from batch_ramp_start up to total_batch_tokens "
        "in whole multiples of batch_ramp_start (0 = off)",
        AT_LEAST_0,
        keep=True,
    )
    batch_ramp_start: Optional[int] = _f(
        None,
        "batch ramp: tokens in step 0 (a multiple of micro_batch_size x seq_len x world size that divides "
        "total_batch_tokens)",
        AT_LEAST_1,
        keep="batch_ramp_steps",
    )
    # The sequence-length ramp: short sequences first, as many tokens a step (train.schedule.seq_len_at).
    seq_len_ramp_steps: int = _f(
        0,
        "train the first N steps on shorter sequences: seq_len_start, doubling at even intervals up to seq_len at "
        "step N; each micro-batch keeps its tokens (rows x length), so the loader cuts each sequence into pieces "
        "(0 = off)",
        AT_LEAST_0,
        keep=True,
    )
    seq_len_start: Optional[int] = _f(
        None,
        "sequence-length ramp: the length of step 0 (seq_len divided by a power of two)",
        AT_LEAST_1,
        keep="seq_len_ramp_steps",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if bool(self.seq_len_ramp_steps) != (self.seq_len_start is not None):
            raise ConfigError(
                f"seq_len_ramp_steps {self.seq_len_ramp_steps} and seq_len_start {self.seq_len_start}: "
                "the sequence-length ramp needs both (or neither: 0 and none)"
            )
        start = self.seq_len_start
        if start is not None and (
            start >= self.seq_len or self.seq_len % start or (self.seq_len // start) & (self.seq_len // start - 1)
        ):
            raise ConfigError(
                f"seq_len_start {start} must be seq_len {self.seq_len} divided by a power of two "
                f"(the ramp doubles it up to seq_len), e.g. {max(1, self.seq_len // 4)}"
            )
        if bool(self.batch_ramp_steps) != (self.batch_ramp_start is not None):
            raise ConfigError(
                f"batch_ramp_steps {self.batch_ramp_steps} and batch_ramp_start "
                f"{self.batch_ramp_start}: the ramp needs both (or neither: 0 and none)"
            )
        if self.batch_ramp_start is not None and self.total_batch_tokens % self.batch_ramp_start:
            raise ConfigError(
                f"total_batch_tokens {self.total_batch_tokens} is not a multiple of batch_ramp_start "
                f"{self.batch_ramp_start}; the ramp goes from it up to total_batch_tokens in multiples of it"
            )


@dataclass
class OptimConfig(_Section):
    max_steps: int = _f(19073, "optimizer steps in the run", AT_LEAST_1)
    max_lr: float = _f(6e-4, "learning rate after warmup", ABOVE_0, keep=True)
    min_lr: float = _f(6e-5, "learning rate at the end of the cosine decay", AT_LEAST_0, keep=True)
    warmup_steps: int = _f(715, "steps of linear warmup from max_lr/warmup_steps to max_lr", AT_LEAST_0, keep=True)
    weight_decay: float = _f(0.1, "AdamW weight decay, applied to >=2-D weights only", AT_LEAST_0, keep=True)
    beta1: float = _f(0.9, "AdamW beta1", FRACTION, keep=True)
    beta2: float = _f(0.95, "AdamW beta2", FRACTION, keep=True)
    eps: float = _f(1e-8, "AdamW epsilon", ABOVE_0, keep=True)
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0 = no clipping)", AT_LEAST_0, keep=True)
    lr_schedule: str = _f(
        "cosine",
        "the LR schedule after warmup: cosine (decay to min_lr at max_steps) or wsd (warmup-stable-decay: max_lr, "
        "then a linear decay to min_lr over the last decay_frac of the steps)",
        choices=LR_SCHEDULES,
        keep=True,
    )
    decay_frac: float = _f(
        0.2, "wsd: fraction of max_steps in the final linear decay", "[0, 1]", keep="lr_schedule=wsd"
    )
    optimizer: str = _f(
        "adamw",
        "adamw (one AdamW, the GPT-2 recipe) or muon (Muon on the blocks' 2-D matrices, AdamW with "
        "max_lr/embed_lr/head_lr on the rest; the schedule scales every group)",
        choices=OPTIMIZERS,
        keep=True,
    )
    muon_lr: float = _f(
        0.02, "muon: Muon's peak learning rate (scaled by sqrt(max(1, rows/cols)) per matrix)", ABOVE_0, keep=MUON
    )
    muon_momentum: float = _f(0.95, "muon: Muon's Nesterov momentum", FRACTION, keep=MUON)
    muon_weight_decay: float = _f(
        0.0, "muon: Muon's decoupled weight decay (p *= 1 - lr * this)", AT_LEAST_0, keep=MUON
    )
    muon_ns_dtype: str = _f(
        "auto",
        "muon: dtype of the Newton-Schulz iteration: auto, float32 or bfloat16; auto = bf16 where a bf16 matmul "
        "measures fast (GPUs with bf16, CPUs with native bf16), else fp32",
        choices=NS_DTYPE_CHOICES,
    )
    embed_lr: Optional[float] = _f(
        None, "muon: AdamW peak rate of the embedding tables (default max_lr)", ABOVE_0, keep=MUON
    )
    head_lr: Optional[float] = _f(
        None, "muon: AdamW peak rate of an untied output head (default max_lr)", ABOVE_0, keep=MUON
    )
    muon_variant: str = _f(
        "muon",
        "muon: the update of the blocks' matrices: muon (orthogonalised momentum, torch.optim.Muon's) or normuon "
        "(NorMuon: then each output neuron's row divided by the root of its running mean square, rescaled to the "
        "same norm)",
        choices=MUON_VARIANTS,
        keep=MUON,
    )
    muon_beta2: float = _f(
        0.95, "normuon: decay of the per-neuron running mean square", FRACTION, keep="muon_variant=normuon"
    )
    muon_orth: str = _f(
        "newton_schulz",
        "muon: how the update is orthogonalised: newton_schulz (the quintic iteration, one polynomial 5 times) or "
        "polar_express (Amsel et al. 2025: a polynomial of its own each iteration, singular values closer to 1 in "
        "as many matmuls)",
        choices=MUON_ORTHS,
        keep=MUON,
    )
    cautious_wd: bool = _f(
        False,
        "cautious weight decay (Chen et al. 2025): decay a weight only where the optimizer's update and the weight "
        "have the same sign, p -= lr * wd * I(update * p >= 0) * p; for AdamW's weight_decay and Muon's "
        "muon_weight_decay alike",
        keep=True,
    )
    token_features: bool = _f(
        False,
        "share what the token embedding and an untied head learn between tokens with a feature in common (the word "
        "in another case or without its leading space, the shape, the last 2-3 letters, the block of the "
        "tokenizer's merge order): a learned vector per feature, trained with Adam at the table's rate and added to "
        "its tokens' rows; training only, the model stays a plain GPT (docs/recipes.md)",
        keep=True,
    )
    ema_decay: float = _f(
        0.0,
        "average the weights as they train: after each step avg = d * avg + (1 - d) * weights "
        "(torch.optim.swa_utils.AveragedModel); evaluations, samples and the checkpoints' model.safetensors are "
        "the average (0 = off)",
        FRACTION,
        keep=True,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_lr > self.max_lr:
            raise ConfigError(f"need min_lr <= max_lr, got min_lr {self.min_lr}, max_lr {self.max_lr}")
        for name in ("embed_lr", "head_lr", "muon_orth", "muon_variant"):  # Muon's own (adamw: all follow max_lr)
            value = getattr(self, name)
            if self.optimizer == "adamw" and value != self.__dataclass_fields__[name].default:
                raise ConfigError(f"{name} {value}: applies to --optimizer muon (drop it, or add --optimizer muon)")


@dataclass
class SystemConfig(_Section):
    device: str = _f("auto", "cpu, cuda, cuda:N, mps or auto (cuda > mps > cpu)")
    dtype: str = _f(
        "auto",
        "autocast dtype: auto, float32, bfloat16 or float16 (fp16 uses a grad scaler); auto = bf16 on GPUs that "
        "have it (else fp16), on CPUs only where bf16 measures faster than fp32, else fp32",
        choices=DTYPE_CHOICES,
    )
    compile: str = _f(
        "auto",
        "torch.compile the model: auto, true or false; auto = on for CUDA, off where it does not pay (CPU, MPS)",
        choices=COMPILE_CHOICES,
    )
    peak_flops: Optional[float] = _f(None, "peak FLOP/s for MFU; default from the GPU name (A100, H100, H200)", ABOVE_0)
    max_bad_steps: int = _f(5, "stop after this many NaN/inf steps in a row", AT_LEAST_1)
    check_interval: int = _f(
        0,
        "steps between the host reading back losses, gradient norms and the NaN/spike verdicts, which the device "
        "reaches and acts on at every step; 0 = auto: every step on a CPU (reading back costs nothing there), "
        "every 16 on a GPU (each read-back waits for the GPU to drain)",
        AT_LEAST_0,
    )
    keep_cpu_memory: bool = _f(
        True,
        "on CPU, keep freed memory in the process (glibc mallopt) instead of returning it to the OS: fresh pages "
        "for the large logit buffers cost about half of a small model's step",
    )

    def __post_init__(self) -> None:
        if isinstance(self.compile, bool):  # compile=False from Python (load_preset, from_dict) or TOML
            self.compile = "true" if self.compile else "false"
        super().__post_init__()


@dataclass
class EvalConfig(_Section):
    """Evaluations and samples (an interval of 0 means never)."""

    eval_interval: int = _f(250, "steps between validation losses", AT_LEAST_0)
    eval_tokens: int = _f(10485760, "validation tokens per evaluation (over all processes)", AT_LEAST_0)
    hellaswag_interval: int = _f(250, "steps between HellaSwag evaluations", AT_LEAST_0)
    hellaswag_data: Optional[str] = _f(None, "HellaSwag jsonl (default: the official validation set)")
    hellaswag_limit: Optional[int] = _f(None, "evaluate only the first N HellaSwag examples", AT_LEAST_1)
    sample_interval: int = _f(250, "steps between text samples", AT_LEAST_0)
    sample_prompt: str = _f("Hello, I'm a language model,", "prompt of the logged samples")
    sample_tokens: int = _f(32, "tokens generated per sample", AT_LEAST_1)


@dataclass
class CheckpointConfig(_Section):
    ckpt_interval: int = _f(5000, "steps between checkpoints (one is always saved at the end)", AT_LEAST_0)
    keep_checkpoints: int = _f(3, "newest checkpoints to keep (0 = keep all)", AT_LEAST_0)


@dataclass
class LoggingConfig(_Section):
    log_interval: int = _f(1, "steps between console lines (metrics.jsonl gets every step)", AT_LEAST_1)
    tensorboard: bool = _f(False, "also write TensorBoard events to OUT/tensorboard")
    progress: bool = _f(True, "show a progress bar on rank 0 where stderr is a terminal (never in a redirected log)")
    wandb_project: Optional[str] = _f(
        None,
        "also log to this Weights & Biases project (rank 0; needs pip install 'gpt2lab[wandb]'); a resumed run "
        "continues its W&B run",
    )
    wandb_run_name: Optional[str] = _f(None, "W&B run name (default: the run directory's name)")


@dataclass
class SpikeConfig(_Section):
    """The loss-spike guard (gpt2lab/train/spikes.py)."""

    spike_window: int = _f(
        100,
        "recent healthy steps a step's loss and grad norm are compared with; the guard starts once it has seen "
        "that many (0 = guard off)",
        AT_LEAST_0,
    )
    spike_loss_z: float = _f(
        6.0,
        "a loss this many standard deviations above the window's mean is a spike: the step's update is skipped "
        "(0 = do not check the loss)",
        AT_LEAST_0,
    )
    spike_norm_z: float = _f(20.0, "the same for the log of the gradient norm (0 = do not check it)", AT_LEAST_0)
    spike_rollback: int = _f(
        3,
        "this many spikes within spike_window steps roll back to the last checkpoint before them and skip the data "
        "of the spiking steps (0 = never roll back)",
        AT_LEAST_0,
    )


@dataclass
class FinetuneConfig(_Section):
    """Fine-tuning (gpt2lab/train/init_from.py, gpt2lab/model/lora.py; dropout is in the model).
    What --init-from resolved to is no setting: the run plan records it (RunPlan.init_record)."""

    init_from: Optional[str] = _f(
        None,
        "start from these weights (new optimizer, step 0): gpt2, gpt2-medium, gpt2-large, gpt2-xl, a local HF GPT-2 "
        "directory, a gpt2lab run directory (its newest checkpoint) or a checkpoint directory; the architecture "
        "comes from it",
    )
    lora_rank: int = _f(
        0, "train LoRA adapters of this rank (through peft) instead of all weights; 0 = off", AT_LEAST_0, keep=True
    )
    lora_alpha: float = _f(16.0, "LoRA scale numerator: the update is (alpha / rank) * B @ A", ABOVE_0, keep=LORA)
    lora_targets: str = _f(
        "c_attn",
        "comma-separated layers that get LoRA adapters: c_attn, c_proj, c_fc (attn.c_proj or mlp.c_proj for one of "
        "the two c_proj)",
        keep=LORA,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if any(t.strip() not in LORA_TARGETS for t in self.lora_targets.split(",")):
            raise ConfigError(f"lora_targets {self.lora_targets!r}: choose from {', '.join(LORA_TARGETS)}")


@dataclass
class ParallelConfig(_Section):
    """Sharding and activation memory (gpt2lab/distributed/parallel.py)."""

    strategy: str = _f(
        "auto",
        "how the processes of a torchrun share the model: ddp (each holds all weights, gradients and AdamW state), "
        "fsdp (FSDP2: all three sharded over the processes) or auto = ddp for one process or a model that fits, "
        "else fsdp",
        choices=STRATEGY_CHOICES,
    )
    activation_checkpointing: bool = _f(
        False,
        "keep only each block's input in the forward and recompute the rest in the backward: about a third more "
        "compute for a fraction of the activation memory",
    )


# Settings that cannot train together ("ONE with OTHER: why and what to do"), each refused in one line.
CLASHES = (
    "--optimizer muon with --strategy fsdp: Muon orthogonalises whole matrices, FSDP shards them; use --strategy "
    "ddp, or --optimizer adamw with FSDP",
    "--optimizer muon with --lora-rank: LoRA trains small adapters; use --optimizer adamw",
    "--strategy fsdp with --lora-rank: LoRA trains only the adapters, so DDP keeps no gradients or AdamW state for "
    "the frozen weights; use --strategy ddp",
    "--token-features with --strategy fsdp: the features mix rows that FSDP shards apart; use --strategy ddp, or "
    "--token-features false",
    "--token-features with --lora-rank: LoRA freezes the token tables the features train; use full fine-tuning, or "
    "--token-features false",
    "--ema-decay with --strategy fsdp: the weight average keeps a whole copy of a model trained whole; use "
    "--strategy ddp, or --ema-decay 0",
    "--ema-decay with --lora-rank: the weight average keeps a whole copy of a model trained whole; use full "
    "fine-tuning, or --ema-decay 0",
)


@dataclass
class TrainConfig:
    """A run's settings: three top-level fields and one section per concern (``cfg.optim.max_lr``)."""

    model: GPTConfig = field(default_factory=lambda: GPTConfig(vocab_size=PADDED_VOCAB_SIZE))  # the architecture
    data: str = _f("data/fineweb-edu-10b", "directory of token shards made by `gpt2lab prepare`")
    out: str = _f("runs/gpt2-124m", "run directory: config.json, metrics.jsonl, checkpoints/")
    seed: int = _f(1337, "seed for initialisation and data order", "[0, 4294967295]", keep=True)  # numpy: < 2^32
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)  # optimizer, learning-rate schedule and run length
    system: SystemConfig = field(default_factory=SystemConfig)  # device, precision, compilation
    eval: EvalConfig = field(default_factory=EvalConfig)  # validation loss, HellaSwag, samples
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # console, TensorBoard, W&B
    spike: SpikeConfig = field(default_factory=SpikeConfig)  # the loss-spike guard
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)  # starting weights and LoRA
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # sharding and activation checkpointing

    def __post_init__(self) -> None:
        """The checks across sections (each section checks its own fields)."""
        check_fields(self)
        self._derive_token_vocab()
        if self.batch.seq_len > self.model.block_size:
            raise ConfigError(
                f"seq_len {self.batch.seq_len} exceeds block_size {self.model.block_size}; "
                f"lower --seq-len or raise --block-size"
            )
        on = {
            "--optimizer muon": self.optim.optimizer == "muon",
            "--strategy fsdp": self.parallel.strategy == "fsdp",
            "--lora-rank": bool(self.finetune.lora_rank),
            "--token-features": self.optim.token_features,
            "--ema-decay": bool(self.optim.ema_decay),
        }
        for clash in CLASHES:
            if all(on[setting] for setting in clash.split(":")[0].split(" with ")):
                raise ConfigError(clash)

    def _derive_token_vocab(self) -> None:
        """token_vocab_size is the tokenizer's (GPT-2's; with a chat template, its turn tokens too; a
        trained tokenizer's, which the run plan reads from the data), never a setting of its own."""
        m = self.model
        if m.tokenizer is not None:
            if m.token_vocab_size is None:
                raise ConfigError(
                    f"tokenizer {m.tokenizer[:12]}: its vocabulary size is not known; a run takes both "
                    "from its data (gpt2lab prepare --tokenizer DIR), so drop tokenizer"
                )
            return  # GPTConfig checks vocab_size >= token_vocab_size
        tokens = CHAT_VOCAB_SIZES[m.chat_template] if m.chat_template else GPT2_VOCAB_SIZE
        if m.vocab_size < tokens:
            raise ConfigError(
                f"vocab_size {m.vocab_size} is smaller than the tokenizer's {tokens} tokens"
                + (f" (GPT-2's and the {m.chat_template} turn tokens)" if m.chat_template else "")
                + f"; use {PADDED_VOCAB_SIZE}"
            )
        if m.token_vocab_size not in (None, tokens):
            raise ConfigError(
                f"token_vocab_size {m.token_vocab_size}: it is not a setting (a run uses its "
                f"tokenizer's {tokens}); drop it"
            )
        if m.token_vocab_size is None:
            self.model = dataclasses.replace(m, token_vocab_size=tokens)

    def grad_accum_steps(self, world_size: int, name: str = "total_batch_tokens") -> int:
        """Micro-steps of a step of ``name``'s tokens (total_batch_tokens: a step after any batch ramp;
        batch_ramp_start: the ramp's first); raises unless they divide evenly."""
        b = self.batch
        tokens, per_micro = getattr(b, name), b.micro_batch_size * b.seq_len * world_size
        if tokens % per_micro:
            raise ConfigError(
                f"{name} {tokens} is not divisible by micro_batch_size "
                f"{b.micro_batch_size} x seq_len {b.seq_len} x world size {world_size} = {per_micro}; "
                f"set --{name.replace('_', '-')} to a multiple of {per_micro} or change --micro-batch-size"
            )
        return tokens // per_micro

    def to_dict(self) -> dict:
        """The nested form (config.json): each section a dict under its name."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "config") -> "TrainConfig":
        """From the nested form (``to_dict``'s), the flat one of flags and TOML keys (``max_lr``) or
        a mix (``nest_config``'s rules). A saved config.json's format version is its reader's to
        check (``system.formats.unstamp``)."""
        nested = nest_config(values, source)
        check_nested_types(nested, source)
        top = {k: v for k, v in nested.items() if k not in SECTIONS}
        parts = {name: section(**nested.get(name, {})) for name, section in SECTIONS.items() if name != "model"}
        return cls(**top, **parts, model=gpt_config(nested.get("model", {}), source))

    def with_values(self, **changes: Any) -> "TrainConfig":
        """This config with some fields changed, by flat name or by section (``model={...}``), validated
        like any other."""
        return TrainConfig.from_dict(merge_config(self.to_dict(), changes))


# -- the fields by flat name: the one table flags, type checks, defaults and resumes read -----------
SECTIONS: dict[str, type] = {k: v for k, v in get_type_hints(TrainConfig).items() if dataclasses.is_dataclass(v)}
FIELDS = {  # every field by its flat name, in config.json's order: data, out, seed and each section's
    g.name: g
    for f in dataclasses.fields(TrainConfig)
    for g in (dataclasses.fields(SECTIONS[f.name]) if f.name in SECTIONS else [f])
}
HINTS = {k: v for c in (TrainConfig, *SECTIONS.values()) for k, v in get_type_hints(c).items() if k in FIELDS}
SECTION_OF = {f.name: name for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}  # "max_lr": "optim"
DEFAULTS = TrainConfig().to_dict()


def default_value(name: str) -> Any:
    """A field's default by its flat name (``"dtype"`` -> ``"auto"``)."""
    return config_value(DEFAULTS, name)


def nest_config(values: Mapping[str, Any], source: str = "config") -> dict:
    """A run config in the nested form, from the nested, the flat or a mixed form: the one place
    that nests. Each flat key moves into its section (SECTION_OF); sections appear where given
    or set. One ConfigError, naming ``source`` and the key, for an unknown key, a key in the
    wrong section, a key set both flat and in its section, or a section that is no table."""
    unknown = sorted(set(values) - set(SECTIONS) - set(FIELDS))
    if unknown:
        near = [m for k in unknown for m in difflib.get_close_matches(k, sorted(FIELDS), n=1)]
        raise ConfigError(
            f"{source}: unknown field(s) {', '.join(unknown)}"
            + (f" (did you mean {', '.join(near)}?)" if near else "")
            + f"; known fields: {', '.join(sorted(FIELDS))} (or their sections: {', '.join(SECTIONS)})"
        )
    nested: dict = {}
    for key, value in values.items():
        if key in SECTIONS:  # a section given as a table: its own keys only
            names = ", ".join(k for k, home in SECTION_OF.items() if home == key)
            if not isinstance(value, dict):
                raise ConfigError(f'{source}: "{key}" must be a table of {key} fields ({names}), got {value!r}')
            strange = sorted(set(value) - set(FIELDS))
            if strange:
                raise ConfigError(f"{source}: unknown {key} field(s) {', '.join(strange)}; known {key} fields: {names}")
            nested.setdefault(key, {})
        for name, v in value.items() if key in SECTIONS else [(key, value)]:
            home = SECTION_OF.get(name)
            if key in SECTIONS and home != key:
                raise ConfigError(
                    f"{source}: {name} is in [{key}] but belongs " + (f"in [{home}]" if home else "at the top level")
                )
            table = nested.setdefault(home, {}) if home else nested
            if name in table:
                raise ConfigError(f"{source}: {name} set both as a key and in [{home}]; keep one")
            table[name] = v
    return nested


def merge_config(*layers: Mapping[str, Any], source: str = "config") -> dict:
    """Run configs of any form, nested and merged field by field, a later layer's value winning
    (a preset over its base, flags over the preset)."""
    out: dict = {}
    for layer in layers:
        for name, value in nest_config(layer, source).items():
            out[name] = {**out.get(name, {}), **value} if name in SECTIONS else value
    return out


def check_nested_types(nested: Mapping[str, Any], source: str) -> None:
    """Each value of its field's type (check_types), section by section. compile: also true/false (Python's
    compile=False, TOML's compile = false): SystemConfig makes it text."""
    for table in (nested, *(v for k, v in nested.items() if k in SECTIONS)):
        check_types(table, HINTS, source, also={"compile": bool})


def save_config(cfg: TrainConfig, path: str) -> None:
    """A run directory's config.json: the nested form with its format version (system/formats.py)."""
    from gpt2lab.system.files import write_json

    write_json(path, formats.stamp(cfg.to_dict(), formats.RUN))
