"""The optimizers and the learning-rate schedule (a pure function of the step).

``--optimizer adamw`` (the GPT-2/3 recipe): one AdamW, weight decay on >=2-D tensors only.
``--optimizer muon``: Muon (torch.optim.Muon, its Newton-Schulz iteration in the dtype
``gpt2lab.system.runtime`` chooses for the machine) on the blocks' 2-D matrices and AdamW on
embeddings, the head, gains and biases, each group with its own peak rate; the schedule
(cosine or warmup-stable-decay) scales every group by the same factor. ``--muon-variant
normuon`` adds NorMuon's per-neuron normalisation after Muon's orthogonalisation; ``--muon-orth
polar_express`` orthogonalises with the Polar Express polynomials instead of Newton-Schulz's one;
``--cautious-wd`` decays only where the update and the weight have the same sign (AdamW and Muon).
"""

from __future__ import annotations

import inspect
import math
from typing import Optional

import torch
import torch.nn as nn

from gpt2lab.system.choices import LR_SCHEDULES, MUON_VARIANTS, NS_DTYPE_CHOICES, OPTIMIZERS  # noqa: F401
from gpt2lab.system.errors import ConfigError


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay every >=2-D tensor (matmul weights, embeddings); never biases or LayerNorm gains.

    Tied weights appear once (``named_parameters`` de-duplicates shared tensors).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def fused_available(device: torch.device) -> bool:
    """Fused AdamW kernels exist for CUDA (and CPU on recent torch)."""
    if "fused" not in inspect.signature(torch.optim.AdamW).parameters:
        return False
    return device.type in ("cuda", "cpu")


def cautious_mask(update: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Where cautious weight decay applies (Chen et al. 2025, "Cautious Weight Decay"): the
    coordinates whose update u (the step is p -= lr * u) and weight have the same sign, I(u * p >= 0),
    as 0/1 in p's dtype. There the decay and the update both pull the weight towards zero; elsewhere
    the update moves it away from zero, and the decay would work against it."""
    return (update * p >= 0).to(p.dtype)


class CautiousAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with cautious weight decay: p -= lr * wd * I(u * p >= 0) * p, u Adam's
    update m_hat / (sqrt(v_hat) + eps), in place of the decay p *= 1 - lr * wd on every coordinate.

    u has the sign of the new first moment m = lerp(m, grad, 1 - beta1), so the mask is computed
    from it before torch's step, which then runs (fused or not) with weight decay 0: the decay reads
    the weight before the update, as the paper's x_{t+1} = x_t - lr (u_t + wd I(u_t x_t >= 0) x_t).
    Each group keeps its own ``weight_decay`` (0 on gains and biases: no decay there either). A
    step skipped on the device (``found_inf``: fused only, as torch's) is skipped by the decay too."""

    @torch.no_grad()
    def step(self, closure=None):
        if getattr(self, "grad_scale", None) is not None:
            raise RuntimeError("CautiousAdamW: gradients scaled for fp16 must be unscaled first (GradScaler.unscale_)")
        found_inf = getattr(self, "found_inf", None)
        keep = None if found_inf is None else 1 - found_inf.float()
        decays = [group["weight_decay"] for group in self.param_groups]
        for group, wd in zip(self.param_groups, decays):
            if not wd:
                continue
            rate = float(group["lr"]) * wd
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].get("exp_avg")
                beta1 = group["betas"][0]
                new_m = p.grad * (1 - beta1) if m is None else m.lerp(p.grad, 1 - beta1)
                decay = cautious_mask(new_m, p) * rate
                p.sub_(p * (decay if keep is None else decay * keep.to(p.dtype)))
            group["weight_decay"] = 0.0
        try:
            return super().step(closure)
        finally:
            for group, wd in zip(self.param_groups, decays):
                group["weight_decay"] = wd


def make_optimizer(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    device: torch.device,
    fused: bool | None = None,
    cautious: bool = False,
) -> torch.optim.AdamW:
    """AdamW over ``param_groups``; fused when the device has the kernel (``fused=None``);
    ``cautious``: its weight decay cautious (``CautiousAdamW``)."""
    use_fused = fused_available(device) if fused is None else fused
    adamw = CautiousAdamW if cautious else torch.optim.AdamW
    return adamw(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, fused=use_fused or None)


def lr_at(
    step: int,
    *,
    max_lr: float,
    min_lr: float,
    warmup_steps: int,
    max_steps: int,
    schedule: str = "cosine",
    decay_frac: float = 0.2,
) -> float:
    """The learning rate of step ``step``: linear warmup to max_lr over ``warmup_steps``, then

    * ``cosine``: cosine decay to min_lr at ``max_steps``;
    * ``wsd`` (warmup-stable-decay): max_lr until the last ``decay_frac`` of ``max_steps``,
      then a straight line down to min_lr at ``max_steps`` (the decay never starts before
      the warmup ends).

    Step 0 gets max_lr / warmup_steps (never 0, which would waste a step); past max_steps
    the rate stays at min_lr. Every rate is linear in (max_lr, min_lr): groups whose two
    rates have the same ratio are scaled by the same factor at every step.
    """
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    if schedule == "wsd":
        start = max(warmup_steps, max_steps - round(decay_frac * max_steps))
        if step < start:
            return max_lr
        return max_lr + (min_lr - max_lr) * (step - start) / (max_steps - start)
    if schedule != "cosine":
        raise ValueError(f"lr schedule {schedule!r}: choose one of {', '.join(LR_SCHEDULES)}")
    ratio = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    return min_lr + coeff * (max_lr - min_lr)


# -- Muon ------------------------------------------------------------------------------------
# The quintic Newton-Schulz iteration's coefficients (Jordan et al., the Muon write-up; torch's defaults).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(
    g: torch.Tensor,
    dtype: torch.dtype,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
) -> torch.Tensor:
    """Muon's approximate orthogonalisation of the 2-D ``g`` (roughly U V^T of its SVD), run in ``dtype``.

    ``g`` is scaled to Frobenius norm 1 (so every singular value is <= 1), then each of
    ``steps`` iterations maps X to aX + (bXX^T + c(XX^T)^2)X on the short side (X X^T is the
    smaller Gram matrix). The result is in ``dtype``.
    """
    x = g.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = _quintic_steps(x / x.norm().clamp(min=eps), [coefficients] * steps)
    return x.T if tall else x


def _quintic_steps(x: torch.Tensor, coefficients) -> torch.Tensor:
    """X -> aX + (bXX^T + c(XX^T)^2)X, once per (a, b, c), X the wide (rows <= columns) matrix."""
    for a, b, c in coefficients:
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b*G + c*G@G
        x = torch.addmm(x, poly, x, beta=a)  # a*X + poly@X
    return x


# The Polar Express polynomials of degree 5 (Amsel, Persson, Musco and Gower 2025, "The Polar Express:
# Optimal Matrix Sign Methods and Their Application to the Muon Algorithm", algorithm 1): iteration t's
# (a, b, c) is the odd quintic closest to 1, in the worst case, on the interval the previous ones leave
# the singular values in (starting from [1e-3, 1]); from the eighth on, the last one repeats.
POLAR_EXPRESS_COEFFICIENTS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
# The paper's safety factor for low precision: every polynomial but the last is p(x / 1.01) (a / 1.01,
# b / 1.01^3, c / 1.01^5), and the input is divided by 1.01 times its Frobenius norm, so that rounding
# never carries a singular value past the interval a polynomial was fitted on.
POLAR_EXPRESS_SAFETY = 1.01


def polar_express_coefficients(steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) of each of ``steps`` Polar Express iterations, the safety factor applied."""
    s = POLAR_EXPRESS_SAFETY
    safe = [(a / s, b / s**3, c / s**5) for a, b, c in POLAR_EXPRESS_COEFFICIENTS[:-1]]
    safe.append(POLAR_EXPRESS_COEFFICIENTS[-1])
    return safe[:steps] + [safe[-1]] * max(0, steps - len(safe))


def polar_express(g: torch.Tensor, dtype: torch.dtype, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """``orthogonalize`` with the Polar Express polynomials (``--muon-orth polar_express``): ``g`` divided
    by 1.01 times its Frobenius norm, then iteration t maps X to a_t X + (b_t XX^T + c_t (XX^T)^2) X,
    in ``dtype``. The same matmuls as Newton-Schulz's; singular values closer to 1 at as many steps."""
    x = g.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = _quintic_steps(x / (x.norm() * POLAR_EXPRESS_SAFETY + eps), polar_express_coefficients(steps))
    return x.T if tall else x


def normalize_neurons(
    update: torch.Tensor,
    second_moment: torch.Tensor,
    beta2: float,
    eps: float = 1e-8,
    keep: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """NorMuon's step after the orthogonalisation (Li et al. 2025, "NorMuon"), in fp32.

    Each output neuron (row i of the (out, in) ``update`` O) keeps a running mean of its
    squares, ``second_moment[i] = beta2 * v[i] + (1 - beta2) * mean_j O[i, j]^2`` (updated in
    place); row i is divided by ``sqrt(v[i]) + eps``; the result is rescaled to O's Frobenius
    norm, so the step's size, and muon_lr's meaning, stay Muon's (as the modded-nanogpt speedrun
    does; the paper rescales to 0.2 sqrt(rows * cols) instead). Neurons whose rows ran large move
    less and quiet ones more, where Muon gives every direction the same size.
    """
    o = update.float()
    # keep (a 0-d tensor, 0 on a step skipped on the device) leaves the running mean unchanged
    second_moment.lerp_(o.square().mean(dim=1), 1 - beta2 if keep is None else keep * (1 - beta2))
    n = o / (second_moment.sqrt() + eps)[:, None]
    return n * (o.norm() / n.norm().clamp(min=eps))


def muon_lr_scale(shape: torch.Size, adjust_lr_fn: Optional[str]) -> float:
    """The per-matrix LR factor torch.optim.Muon applies: sqrt(max(1, rows/cols)) ("original",
    the default), or 0.2 sqrt(max(rows, cols)) ("match_rms_adamw")."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` whose Newton-Schulz iteration runs in ``ns_dtype``; ``variant``
    "normuon" adds NorMuon's per-neuron normalisation (``normalize_neurons``) after it.

    torch runs the iteration in bf16, hard-coded. On a CPU without native bf16 that is many
    times slower than fp32 (its bf16 matmuls are emulated; docs/benchmarks.md), so the
    dtype follows the machine (``gpt2lab.system.runtime.choose_ns_dtype``). torch's constructor
    (checks, hyper-parameters, param groups) and its state (one ``momentum_buffer`` per
    matrix) are used as they are; only ``step`` is ours, because torch offers no hook for
    the dtype. It is torch's update, written out: Nesterov momentum, orthogonalise, decoupled
    weight decay ``p *= 1 - lr*wd``, ``p -= lr * muon_lr_scale * O``. NorMuon's second moment is
    one more state entry per matrix, ``second_moment`` (fp32, one value per row). ``orth``
    "polar_express" orthogonalises with ``polar_express`` (``ns_steps`` iterations) in place of
    Newton-Schulz; ``cautious`` decays only where ``cautious_mask`` of the update O is 1:
    ``p *= 1 - lr*wd*I(O*p >= 0)``. The variant, beta2, orth and cautious are attributes, not group
    entries, so a resume uses the run's own, not the checkpoint's.
    """

    def __init__(
        self,
        params,
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
        variant: str = "muon",
        beta2: float = 0.95,
        orth: str = "newton_schulz",
        cautious: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype, self.variant, self.beta2 = ns_dtype, variant, beta2
        self.orth, self.cautious = orth, cautious

    # torch.amp.GradScaler and apply_update's device-side skip set ``found_inf`` (a 0-d tensor, 1: skip)
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if getattr(self, "grad_scale", None) is not None:
            raise RuntimeError("Muon: gradients scaled for fp16 must be unscaled first (GradScaler.unscale_)")
        found_inf = getattr(self, "found_inf", None)
        # keep = 0 turns the step into a no-op on the device (no host sync): momentum, second
        # moment, decay and update are all scaled by it; without found_inf the step is as before
        keep = None if found_inf is None else 1 - found_inf.float()
        for group in self.param_groups:
            lr, wd, momentum = float(group["lr"]), group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf, scale = state["momentum_buffer"], lr * muon_lr_scale(p.shape, group["adjust_lr_fn"])
                if keep is None:
                    buf.lerp_(p.grad, 1 - momentum)
                else:  # a skipped step leaves the buffer as it was (weight 0); a kept one moves it as above
                    buf.lerp_(p.grad, (keep * (1 - momentum)).to(buf.dtype))
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                if self.orth == "polar_express":
                    update = polar_express(update, self.ns_dtype, group["ns_steps"], group["eps"])
                else:
                    update = orthogonalize(
                        update, self.ns_dtype, group["ns_coefficients"], group["ns_steps"], group["eps"]
                    )
                if self.variant == "normuon":
                    if "second_moment" not in state:
                        state["second_moment"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
                    update = normalize_neurons(update, state["second_moment"], self.beta2, keep=keep)
                if self.cautious and wd:  # the decay where the update and the weight agree in sign
                    decay = cautious_mask(update, p) * (lr * wd)
                    p.sub_(p * (decay if keep is None else decay * keep.to(p.dtype)))
                elif keep is None:
                    p.mul_(1 - lr * wd)
                else:
                    p.mul_((1 - lr * wd * keep).to(p.dtype))
                if keep is None:
                    p.add_(update, alpha=-scale)
                else:
                    p.sub_(update.to(p.dtype) * (scale * keep))
        return loss


class Optimizers:
    """Several torch optimizers stepped as one (Muon for the hidden matrices, AdamW for the rest).

    It is the checkpoint's "optimizer" part: ``state_dict`` holds each one's under its name.
    """

    def __init__(self, **named: torch.optim.Optimizer) -> None:
        self.named = named

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.named.values() for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.named.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.named.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self.named.items()}

    def load_state_dict(self, state: dict) -> None:
        if sorted(state) != sorted(self.named):
            have = "+".join(sorted(state)) if "state" not in state else "one optimizer (adamw)"
            raise ValueError(
                f"the checkpoint holds {have}, this run uses {'+'.join(sorted(self.named))}; "
                "resume with the checkpoint's --optimizer"
            )
        for name, opt in self.named.items():
            opt.load_state_dict(state[name])


def parts(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside ``optimizer`` (itself, unless it is an ``Optimizers``)."""
    return list(optimizer.named.values()) if isinstance(optimizer, Optimizers) else [optimizer]


def muon_split(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """The trainable parameters by role: "hidden" (the 2-D matrices inside the blocks, for Muon),
    "embed" (embedding tables), "head" (an output projection not tied to the embedding) and
    "other" (gains, biases and anything else; AdamW without weight decay unless 2-D)."""
    embed_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    head = getattr(model, "lm_head", None)
    head_ids = {id(p) for p in head.parameters()} - embed_ids if head is not None else set()
    blocks = getattr(getattr(model, "transformer", None), "h", None)
    hidden_ids = {id(p) for p in blocks.parameters() if p.dim() == 2} if blocks is not None else set()
    out: dict[str, list[nn.Parameter]] = {"hidden": [], "embed": [], "head": [], "other": []}
    for p in model.parameters():  # de-duplicated: a tied head appears once, as the embedding
        if not p.requires_grad:
            continue
        role = (
            "embed"
            if id(p) in embed_ids
            else "head"
            if id(p) in head_ids
            else "hidden"
            if id(p) in hidden_ids
            else "other"
        )
        out[role].append(p)
    return out


def make_muon(
    model: nn.Module,
    *,
    muon_lr: float,
    muon_momentum: float,
    muon_weight_decay: float,
    ns_dtype: torch.dtype,
    lr: float,
    embed_lr: float,
    head_lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    device: torch.device,
    variant: str = "muon",
    muon_beta2: float = 0.95,
    orth: str = "newton_schulz",
    cautious: bool = False,
) -> Optimizers:
    """Muon on the blocks' 2-D matrices, AdamW (fused where available) on the rest.

    Every group carries ``lr_name``, the TrainConfig field its peak rate comes from
    (``set_lrs``): muon_lr, embed_lr, head_lr or max_lr (gains, biases, other matrices).
    ``orth`` and ``cautious``: Muon's orthogonalisation and cautious weight decay for both (``Muon``,
    ``CautiousAdamW``).
    """
    if any(_is_dtensor(p) for p in model.parameters()):
        raise ConfigError(
            "--optimizer muon: the model is sharded (FSDP), and Muon orthogonalises whole "
            "matrices; use --strategy ddp, or --optimizer adamw with FSDP"
        )
    split = muon_split(model)
    if not split["hidden"]:
        raise ConfigError(
            "--optimizer muon: the model has no 2-D matrices inside its blocks to give Muon; use --optimizer adamw"
        )
    muon = Muon(
        [{"params": split["hidden"], "lr_name": "muon_lr"}],
        lr=muon_lr,
        momentum=muon_momentum,
        weight_decay=muon_weight_decay,
        nesterov=True,
        ns_dtype=ns_dtype,
        variant=variant,
        beta2=muon_beta2,
        orth=orth,
        cautious=cautious,
    )
    other = split["other"]
    groups = [
        {"params": split["embed"], "lr": embed_lr, "weight_decay": weight_decay, "lr_name": "embed_lr"},
        {"params": split["head"], "lr": head_lr, "weight_decay": weight_decay, "lr_name": "head_lr"},
        {"params": [p for p in other if p.dim() >= 2], "lr": lr, "weight_decay": weight_decay, "lr_name": "max_lr"},
        {"params": [p for p in other if p.dim() < 2], "lr": lr, "weight_decay": 0.0, "lr_name": "max_lr"},
    ]
    use_fused = fused_available(device)
    adamw = (CautiousAdamW if cautious else torch.optim.AdamW)(
        [g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps, fused=use_fused or None
    )
    return Optimizers(adamw=adamw, muon=muon)


def _is_dtensor(p: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(p, DTensor)


def build_optimizer(model: nn.Module, opt, device: torch.device, ns_dtype: Optional[str] = None, tokenizer=None):
    """The optimizer a TrainConfig's ``optim`` section (``opt``) asks for: today's AdamW
    (``make_optimizer``) or Muon + AdamW; with ``token_features``, the feature share of the
    token tables (train.token_features; ``tokenizer``: the run's, None for GPT-2's) stepped after them."""
    optimizer = _build_optimizer(model, opt, device, ns_dtype)
    if not opt.token_features:
        return optimizer
    from gpt2lab.data.tokenizer import gpt2_tokenizer
    from gpt2lab.train.token_features import make_feature_share

    share = make_feature_share(
        model, tokenizer or gpt2_tokenizer(), optimizer, betas=(opt.beta1, opt.beta2), eps=opt.eps
    )
    named = optimizer.named if isinstance(optimizer, Optimizers) else {"adamw": optimizer}
    return Optimizers(**named, token_features=share)


def _build_optimizer(model: nn.Module, opt, device: torch.device, ns_dtype: Optional[str] = None):
    if opt.optimizer == "adamw":
        return make_optimizer(
            model,
            lr=opt.max_lr,
            weight_decay=opt.weight_decay,
            betas=(opt.beta1, opt.beta2),
            eps=opt.eps,
            device=device,
            cautious=opt.cautious_wd,
        )
    return make_muon(
        model,
        muon_lr=opt.muon_lr,
        muon_momentum=opt.muon_momentum,
        muon_weight_decay=opt.muon_weight_decay,
        ns_dtype=getattr(torch, ns_dtype or "float32"),
        lr=opt.max_lr,
        embed_lr=peak_lr(opt, "embed_lr"),
        head_lr=peak_lr(opt, "head_lr"),
        weight_decay=opt.weight_decay,
        betas=(opt.beta1, opt.beta2),
        eps=opt.eps,
        device=device,
        variant=opt.muon_variant,
        muon_beta2=opt.muon_beta2,
        orth=opt.muon_orth,
        cautious=opt.cautious_wd,
    )


def peak_lr(opt, name: str) -> float:
    """The peak rate of a group's ``lr_name``; embed_lr and head_lr default to max_lr."""
    value = getattr(opt, name)
    return opt.max_lr if value is None else value


def scheduled_lr(step: int, opt, name: str = "max_lr") -> float:
    """Group ``name``'s rate at ``step``: the schedule with its own peak, its floor min_lr scaled
    by the same ratio (min_lr / max_lr), so every group moves by the same factor."""
    peak = peak_lr(opt, name)
    floor = opt.min_lr if peak == opt.max_lr else peak * (opt.min_lr / opt.max_lr)
    return lr_at(
        step,
        max_lr=peak,
        min_lr=floor,
        warmup_steps=opt.warmup_steps,
        max_steps=opt.max_steps,
        schedule=opt.lr_schedule,
        decay_frac=opt.decay_frac,
    )


def set_lrs(optimizer, step: int, opt) -> None:
    """Give every param group its scheduled rate (groups without ``lr_name`` follow max_lr).

    The peaks come from ``opt`` (the optim section) on every step, never from the checkpoint:
    a resumed run with another --muon-lr uses the new one, as --max-lr always has."""
    for group in optimizer.param_groups:
        group["lr"] = scheduled_lr(step, opt, group.get("lr_name", "max_lr"))


def _scaled(optimizer) -> list[torch.optim.Optimizer]:
    """The parts fp16's GradScaler unscales and steps: all but the feature share, whose tables'
    gradients belong to (and are unscaled with) the part that owns the tables."""
    from gpt2lab.train.token_features import FeatureShare

    return [one for one in parts(optimizer) if not isinstance(one, FeatureShare)]


def unscaled_grad_norm(model: nn.Module, optimizer, scaler, grad_clip: float) -> torch.Tensor:
    """The whole gradient's norm (sharded or not), after fp16's scaler has unscaled it and the
    gradient has been clipped to ``grad_clip`` (0: not clipped)."""
    from gpt2lab.distributed import parallel

    if scaler is not None:
        for opt in _scaled(optimizer):
            scaler.unscale_(opt)
    return parallel.clip_grad_norm(model, grad_clip if grad_clip > 0 else float("inf"))


def skips_on_device(optimizer) -> bool:
    """Whether every part of ``optimizer`` can skip a step on the device (``apply_update``'s
    ``skip``): fused AdamW (torch's kernel takes ``found_inf``, as GradScaler uses it), our Muon and
    the token features' share."""
    from gpt2lab.train.token_features import FeatureShare

    return all(
        isinstance(one, (Muon, FeatureShare)) or (isinstance(one, torch.optim.AdamW) and one.defaults.get("fused"))
        for one in parts(optimizer)
    )


def apply_update(optimizer, scaler, step: int, opt, take: bool, skip: Optional[torch.Tensor] = None) -> None:
    """Step with the scheduled rates when ``take``, else drop the gradients; either way they are
    cleared. Under fp16 the scaler steps (it skips steps with inf gradients itself while it
    finds its scale), and ``update`` always follows ``unscale_``, which also backs the scale off.
    ``skip`` (a 0-d float tensor on the device, 1: skip; optimizers where ``skips_on_device``)
    decides on the device instead, with no host sync: the kernels leave weights and state as they were."""
    if skip is not None:
        set_lrs(optimizer, step, opt)
        for one in parts(optimizer):
            one.found_inf = skip
            try:
                one.step()
            finally:
                del one.found_inf
        optimizer.zero_grad(set_to_none=True)
        return
    if take:
        set_lrs(optimizer, step, opt)
        if scaler is not None:
            scaled = _scaled(optimizer)
            for one in parts(optimizer):
                if any(one is each for each in scaled):
                    scaler.step(one)
                else:  # the feature share: its tables' gradients are unscaled already; it skips inf itself
                    one.step()
        else:
            optimizer.step()
    if scaler is not None:
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
