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
from typing import Any, Optional, get_type_hints

from gpt2lab.model.config import (
    ABOVE_0,
    AT_LEAST_0,
    AT_LEAST_1,
    FRACTION,
    PADDED_VOCAB_SIZE,
    GPTConfig,
    check_fields,
    check_types,
    config_value,
    model_from_config,
    setting,
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
# A field marked ``keep`` changes what the run trains, so a resume must keep the value its checkpoint trained with
# (train.plan.check_resume_settings); "NAME" or "NAME=VALUE": only where that field is set (to VALUE).
MUON, LORA = "optimizer=muon", "lora_rank"  # the fields a resume keeps only with Muon, only with LoRA


class _Section:
    """One concern's fields (a section of TrainConfig): each checked against its own
    ``within`` and ``choices`` (check_fields); a subclass adds the checks among its fields."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass
class BatchConfig(_Section):
    micro_batch_size: int = setting(64, "sequences per forward/backward on each process", AT_LEAST_1)
    seq_len: int = setting(1024, "tokens per sequence (at most block_size)", AT_LEAST_1, keep=True)
    total_batch_tokens: int = setting(524288, "tokens per optimizer step over all processes", AT_LEAST_1, keep=True)
    # The ramps (speedrun levers; docs/recipes.md) are pure functions of the step (train.schedule.accum_at,
    # seq_len_at), so a resumed run, whose loader continues from its saved position, takes the same batches.
    batch_ramp_steps: int = setting(
        0, "over the first N steps, ramp tokens per step up from batch_ramp_start (0 = off)", AT_LEAST_0, keep=True
    )
    batch_ramp_start: Optional[int] = setting(
        None, "batch ramp: tokens in step 0 (divides total_batch_tokens)", AT_LEAST_1, keep="batch_ramp_steps"
    )
    seq_len_ramp_steps: int = setting(
        0, "train the first N steps on shorter sequences, as many tokens a step (0 = off)", AT_LEAST_0, keep=True
    )
    seq_len_start: Optional[int] = setting(
        None, "sequence-length ramp: the length at step 0 (seq_len / 2^k)", AT_LEAST_1, keep="seq_len_ramp_steps"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for steps, start, ramp in (
            ("seq_len_ramp_steps", "seq_len_start", "the sequence-length ramp"),
            ("batch_ramp_steps", "batch_ramp_start", "the ramp"),
        ):
            if bool(getattr(self, steps)) != (getattr(self, start) is not None):
                raise ConfigError(
                    f"{steps} {getattr(self, steps)} and {start} {getattr(self, start)}: {ramp} needs both "
                    "(or neither: 0 and none)"
                )
        start, n = self.seq_len_start, self.seq_len
        if start is not None and (start >= n or n % start or (n // start).bit_count() > 1):  # n / start: 2^k, k > 0
            raise ConfigError(
                f"seq_len_start {start} must be seq_len {self.seq_len} divided by a power of two "
                f"(the ramp doubles it up to seq_len), e.g. {max(1, self.seq_len // 4)}"
            )
        if self.batch_ramp_start is not None and self.total_batch_tokens % self.batch_ramp_start:
            raise ConfigError(
                f"total_batch_tokens {self.total_batch_tokens} is not a multiple of batch_ramp_start "
                f"{self.batch_ramp_start}; the ramp goes from it up to total_batch_tokens in multiples of it"
            )


@dataclass
class OptimConfig(_Section):
    max_steps: int = setting(19073, "optimizer steps in the run", AT_LEAST_1)
    max_lr: float = setting(6e-4, "learning rate after warmup", ABOVE_0, keep=True)
    min_lr: float = setting(6e-5, "learning rate at the end of the decay", AT_LEAST_0, keep=True)
    warmup_steps: int = setting(715, "steps of linear warmup up to max_lr", AT_LEAST_0, keep=True)
    weight_decay: float = setting(0.1, "AdamW weight decay, applied to >=2-D weights only", AT_LEAST_0, keep=True)
    beta1: float = setting(0.9, "AdamW beta1", FRACTION, keep=True)
    beta2: float = setting(0.95, "AdamW beta2", FRACTION, keep=True)
    eps: float = setting(1e-8, "AdamW epsilon", ABOVE_0, keep=True)
    grad_clip: float = setting(1.0, "clip the global gradient norm to this (0 = no clipping)", AT_LEAST_0, keep=True)
    lr_schedule: str = setting("cosine", "cosine to min_lr, or wsd: flat, then linear", choices=LR_SCHEDULES, keep=True)
    decay_frac: float = setting(0.2, "wsd: fraction of max_steps in the final decay", "[0, 1]", keep="lr_schedule=wsd")
    optimizer: str = setting("adamw", "adamw (GPT-2's) or muon (Muon on the matrices)", choices=OPTIMIZERS, keep=True)
    muon_lr: float = setting(0.02, "muon: Muon's peak learning rate", ABOVE_0, keep=MUON)
    muon_momentum: float = setting(0.95, "muon: Muon's Nesterov momentum", FRACTION, keep=MUON)
    muon_weight_decay: float = setting(0.0, "muon: Muon's decoupled weight decay", AT_LEAST_0, keep=MUON)
    # auto: bf16 where a bf16 matmul measures fast (GPUs with bf16, CPUs with native bf16), else fp32
    muon_ns_dtype: str = setting("auto", "muon: dtype of the Newton-Schulz iteration", choices=NS_DTYPE_CHOICES)
    embed_lr: Optional[float] = setting(None, "muon: AdamW rate of the embeddings (default max_lr)", ABOVE_0, keep=MUON)
    head_lr: Optional[float] = setting(None, "muon: AdamW rate of an untied head (default max_lr)", ABOVE_0, keep=MUON)
    muon_variant: str = setting("muon", "muon: muon, or normuon (docs/recipes.md)", choices=MUON_VARIANTS, keep=MUON)
    muon_beta2: float = setting(0.95, "normuon: per-neuron mean-square decay", FRACTION, keep="muon_variant=normuon")
    muon_orth: str = setting("newton_schulz", "muon: the orthogonalising polynomial", choices=MUON_ORTHS, keep=MUON)
    cautious_wd: bool = setting(False, "decay a weight only where its update has its sign (docs/recipes.md)", keep=True)
    token_features: bool = setting(
        False, "share what the token tables learn between tokens with a feature in common (docs/recipes.md)", keep=True
    )
    ema_decay: float = setting(
        0.0, "keep avg = d avg + (1 - d) weights each step; evals and checkpoints use it (0 = off)", FRACTION, keep=True
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_lr > self.max_lr:
            raise ConfigError(f"need min_lr <= max_lr, got min_lr {self.min_lr}, max_lr {self.max_lr}")
        for f in dataclasses.fields(self):  # Muon's own (kept with Muon; under adamw all follow max_lr)
            value = getattr(self, f.name)
            if f.metadata.get("keep") == MUON and self.optimizer == "adamw" and value != f.default:
                raise ConfigError(f"{f.name} {value}: applies to --optimizer muon (drop it, or add --optimizer muon)")


@dataclass
class SystemConfig(_Section):
    device: str = setting("auto", "cpu, cuda, cuda:N, mps or auto (cuda > mps > cpu)")
    # auto: bf16 on GPUs that have it (else fp16), on CPUs only where bf16 measures faster than fp32, else fp32
    dtype: str = setting("auto", "autocast dtype (float16 adds a grad scaler; docs/speed.md)", choices=DTYPE_CHOICES)
    compile: str = setting("auto", "torch.compile the model (auto: on for CUDA only)", choices=COMPILE_CHOICES)
    peak_flops: Optional[float] = setting(None, "peak FLOP/s for MFU; default by GPU name (A100, H100, H200)", ABOVE_0)
    max_bad_steps: int = setting(5, "stop after this many NaN/inf steps in a row", AT_LEAST_1)
    # The device reaches the NaN/spike verdicts and acts on them every step; the host reads them back (each read-back
    # waits for a GPU to drain) every check_interval steps.
    check_interval: int = setting(0, "steps between host read-backs of losses (0: 1 on CPU, 16 on GPU)", AT_LEAST_0)
    # glibc mallopt: fresh pages for the large logit buffers cost about half of a small model's step
    keep_cpu_memory: bool = setting(True, "on CPU, keep freed memory in the process instead of returning it to the OS")

    def __post_init__(self) -> None:
        if isinstance(self.compile, bool):  # compile=False from Python (load_preset, from_dict) or TOML
            self.compile = "true" if self.compile else "false"
        super().__post_init__()


@dataclass
class EvalConfig(_Section):
    """Evaluations and samples (an interval of 0 means never)."""

    eval_interval: int = setting(250, "steps between validation losses", AT_LEAST_0)
    eval_tokens: int = setting(10485760, "validation tokens per evaluation (over all processes)", AT_LEAST_0)
    hellaswag_interval: int = setting(250, "steps between HellaSwag evaluations", AT_LEAST_0)
    hellaswag_data: Optional[str] = setting(None, "HellaSwag jsonl (default: the official validation set)")
    hellaswag_limit: Optional[int] = setting(None, "evaluate only the first N HellaSwag examples", AT_LEAST_1)
    sample_interval: int = setting(250, "steps between text samples", AT_LEAST_0)
    sample_prompt: str = setting("Hello, I'm a language model,", "prompt of the logged samples")
    sample_tokens: int = setting(32, "tokens generated per sample", AT_LEAST_1)


@dataclass
class CheckpointConfig(_Section):
    ckpt_interval: int = setting(5000, "steps between checkpoints (one is always saved at the end)", AT_LEAST_0)
    keep_checkpoints: int = setting(3, "newest checkpoints to keep (0 = keep all)", AT_LEAST_0)


@dataclass
class LoggingConfig(_Section):
    log_interval: int = setting(1, "steps between console lines (metrics.jsonl gets every step)", AT_LEAST_1)
    tensorboard: bool = setting(False, "also write TensorBoard events to OUT/tensorboard")
    progress: bool = setting(True, "show a progress bar on rank 0 where stderr is a terminal")
    wandb_project: Optional[str] = setting(None, "also log to this W&B project (pip install 'gpt2lab[wandb]')")
    wandb_run_name: Optional[str] = setting(None, "W&B run name (default: the run directory's name)")


@dataclass
class SpikeConfig(_Section):
    """The loss-spike guard (gpt2lab/train/spikes.py)."""

    spike_window: int = setting(100, "healthy steps a loss and grad norm are compared with (0 = guard off)", AT_LEAST_0)
    spike_loss_z: float = setting(6.0, "skip a step with a loss this many std devs over the mean (0 = off)", AT_LEAST_0)
    spike_norm_z: float = setting(20.0, "the same for the log of the gradient norm (0 = off)", AT_LEAST_0)
    spike_rollback: int = setting(3, "roll back after this many spikes in spike_window steps (0 = never)", AT_LEAST_0)


@dataclass
class FinetuneConfig(_Section):
    """Fine-tuning (gpt2lab/train/init_from.py, gpt2lab/model/lora.py; dropout is in the model).
    What --init-from resolved to is no setting: the run plan records it (RunPlan.init_record)."""

    init_from: Optional[str] = setting(
        None, "weights to start from (step 0, new optimizer): gpt2..gpt2-xl, an HF, run or checkpoint directory"
    )
    lora_rank: int = setting(0, "train LoRA adapters of this rank, not all weights (0 = off)", AT_LEAST_0, keep=True)
    lora_alpha: float = setting(16.0, "LoRA scale: the update is (alpha / rank) B @ A", ABOVE_0, keep=LORA)
    lora_targets: str = setting("c_attn", f"comma-separated layers for LoRA: {', '.join(LORA_TARGETS)}", keep=LORA)

    def __post_init__(self) -> None:
        super().__post_init__()
        if any(t.strip() not in LORA_TARGETS for t in self.lora_targets.split(",")):
            raise ConfigError(f"lora_targets {self.lora_targets!r}: choose from {', '.join(LORA_TARGETS)}")


@dataclass
class ParallelConfig(_Section):
    """Sharding and activation memory (gpt2lab/distributed/parallel.py)."""

    strategy: str = setting("auto", "ddp, fsdp (sharded) or auto (ddp where it fits)", choices=STRATEGY_CHOICES)
    activation_checkpointing: bool = setting(False, "recompute blocks in backward: a third more compute, less memory")


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
    data: str = setting("data/fineweb-edu-10b", "directory of token shards made by `gpt2lab prepare`")
    out: str = setting("runs/gpt2-124m", "run directory: config.json, metrics.jsonl, checkpoints/")
    seed: int = setting(1337, "seed for initialisation and data order", "[0, 4294967295]", keep=True)  # numpy: < 2^32
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
        tokens = m.template_vocab
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
        return cls(**top, **parts, model=model_from_config(nested, source))

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
