"""The optimizers (their learning rates move with train.schedule).

``--optimizer adamw`` (the GPT-2/3 recipe): one AdamW, weight decay on >=2-D tensors only.
``--optimizer muon``: Muon (torch.optim.Muon, its Newton-Schulz iteration in the dtype
``gpt2lab.system.runtime`` chooses for the machine) on the blocks' 2-D matrices and AdamW on
embeddings, the head, gains and biases, each group with its own peak rate; the schedule
(cosine or warmup-stable-decay) scales every group by the same factor. ``--muon-variant
normuon`` adds NorMuon's per-neuron normalisation after Muon's orthogonalisation; ``--muon-orth
polar_express`` orthogonalises with the Polar Express polynomials instead of Newton-Schulz's one;
``--cautious-wd`` decays only where the update and the weight have the same sign (AdamW and Muon).

Every optimizer's ``step`` takes the step's skip decision as a value (train/spikes.py): a bool
read back on the host (True: no step at all), or a 0-d tensor left on the device (1: skip), which
the optimizers whose ``skips_on_device`` is true turn into a step that changes no weight and no
state, with no host sync.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn
from torch.optim._muon import _adjust_lr  # torch.optim.Muon's per-matrix rate (sqrt(max(1, rows/cols)) by default)

from gpt2lab.distributed import parallel
from gpt2lab.system.errors import ConfigError
from gpt2lab.train.schedule import peak_lr

Skip = Union[bool, torch.Tensor, None]  # the step's skip decision (None, False: step)


def _keep(skip: Skip) -> Optional[torch.Tensor]:
    """A device verdict as the share of the update to keep (1 - skip, fp32); None: a plain step."""
    return 1 - skip.float() if isinstance(skip, torch.Tensor) else None


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay every >=2-D tensor (matmul weights, embeddings); never biases or LayerNorm gains.

    Tied weights appear once (``named_parameters`` de-duplicates shared tensors).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def cautious_decay_(p: torch.Tensor, update: torch.Tensor, rate: float, keep: Optional[torch.Tensor]) -> None:
    """Cautious weight decay (Chen et al. 2025, "Cautious Weight Decay"): p -= rate * I(u * p >= 0) * p,
    only on the coordinates whose update u (the step is p -= lr * u) and weight have the same sign.
    There the decay and the update both pull the weight towards zero; elsewhere the update moves it
    away from zero, and the decay would work against it. ``keep``: the device verdict (0: skipped)."""
    decay = (update * p >= 0).to(p.dtype) * rate
    p.sub_(p * (decay if keep is None else decay * keep.to(p.dtype)))


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``step`` takes the skip decision; with ``cautious``, cautious weight
    decay: p -= lr * wd * I(u * p >= 0) * p, u Adam's update m_hat / (sqrt(v_hat) + eps), in place of the
    decay p *= 1 - lr * wd on every coordinate.

    u has the sign of the new first moment m = lerp(m, grad, 1 - beta1), so the mask is computed
    from it before torch's step, which then runs (fused or not) with weight decay 0: the decay reads
    the weight before the update, as the paper's x_{t+1} = x_t - lr (u_t + wd I(u_t x_t >= 0) x_t).
    Each group keeps its own ``weight_decay`` (0 on gains and biases: no decay there either). A
    step skipped on the device (fused only: torch's kernel takes the verdict) is skipped by the decay too."""

    def __init__(self, params, *, cautious: bool = False, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.cautious, self.skips_on_device = cautious, bool(self.defaults.get("fused"))

    @torch.no_grad()
    def step(self, closure=None, skip: Skip = None):
        if skip is True:
            return None
        keep = _keep(skip)
        decays = [group["weight_decay"] for group in self.param_groups] if self.cautious else []
        for group, wd in zip(self.param_groups, decays):
            for p in [p for p in group["params"] if p.grad is not None and wd]:
                m, beta1 = self.state[p].get("exp_avg"), group["betas"][0]
                new_m = p.grad * (1 - beta1) if m is None else m.lerp(p.grad, 1 - beta1)
                cautious_decay_(p, new_m, float(group["lr"]) * wd, keep)
            group["weight_decay"] = 0.0
        if keep is not None:
            self.found_inf = skip.float()  # how torch's fused kernel takes a verdict (GradScaler hands it so too)
        try:
            return super().step(closure)
        finally:
            self.__dict__.pop("found_inf", None)
            for group, wd in zip(self.param_groups, decays):
                group["weight_decay"] = wd


# -- Muon ------------------------------------------------------------------------------------
# The quintic Newton-Schulz iteration's coefficients (Jordan et al., the Muon write-up; torch's defaults).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(
    g: torch.Tensor,
    dtype: torch.dtype,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    orth: str = "newton_schulz",
) -> torch.Tensor:
    """Muon's approximate orthogonalisation of the 2-D ``g`` (roughly U V^T of its SVD), run in ``dtype``.

    ``g`` is scaled to Frobenius norm 1 (so every singular value is <= 1), then each of
    ``steps`` iterations maps X to aX + (bXX^T + c(XX^T)^2)X on the short side (X X^T is the
    smaller Gram matrix). The result is in ``dtype``. ``orth`` "polar_express" (``--muon-orth``):
    the Polar Express polynomials, iteration t's (a_t, b_t, c_t), ``g`` divided by 1.01 times its
    Frobenius norm; the same matmuls as Newton-Schulz's, singular values closer to 1 at as many steps.
    """
    x = g.to(dtype)
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    if orth == "polar_express":
        s = POLAR_EXPRESS_SAFETY
        safe = [(a / s, b / s**3, c / s**5) for a, b, c in POLAR_EXPRESS_COEFFICIENTS[:-1]]
        polys = (safe + [POLAR_EXPRESS_COEFFICIENTS[-1]] * max(1, steps - len(safe)))[:steps]
        x = x / (x.norm() * s + eps)
    else:
        polys, x = [coefficients] * steps, x / x.norm().clamp(min=eps)
    for a, b, c in polys:
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b*G + c*G@G
        x = torch.addmm(x, poly, x, beta=a)  # a*X + poly@X
    return x.T if tall else x


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


def normalize_neurons(
    update: torch.Tensor, second_moment: torch.Tensor, beta2: float, keep: Optional[torch.Tensor] = None
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
    eps = 1e-8
    n = o / (second_moment.sqrt() + eps)[:, None]
    return n * (o.norm() / n.norm().clamp(min=eps))


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` whose Newton-Schulz iteration runs in ``ns_dtype``; ``variant``
    "normuon" adds NorMuon's per-neuron normalisation (``normalize_neurons``) after it.

    torch runs the iteration in bf16, hard-coded. On a CPU without native bf16 that is many
    times slower than fp32 (its bf16 matmuls are emulated; docs/benchmarks.md), so the
    dtype follows the machine (``gpt2lab.system.runtime.choose_ns_dtype``). torch's constructor
    (checks, hyper-parameters, param groups) and its state (one ``momentum_buffer`` per
    matrix) are used as they are; only ``step`` is ours, because torch offers no hook for
    the dtype. It is torch's update, written out: Nesterov momentum, orthogonalise, decoupled
    weight decay ``p *= 1 - lr*wd``, ``p -= lr * scale * O`` (torch's per-matrix scale). NorMuon's second moment is
    one more state entry per matrix, ``second_moment`` (fp32, one value per row). ``orth``
    "polar_express" orthogonalises with the Polar Express polynomials (``ns_steps`` iterations) in place of
    Newton-Schulz; ``cautious`` decays only where the update O and the weight agree in sign (``cautious_decay_``):
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

    skips_on_device = True

    @torch.no_grad()
    def step(self, skip: Skip = None) -> None:
        if skip is True:
            return
        # keep = 0 turns the step into a no-op on the device (no host sync): momentum, second
        # moment, decay and update are all scaled by it; without a device verdict the step is torch's
        keep = _keep(skip)
        for group in self.param_groups:
            lr, wd, momentum = float(group["lr"]), group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf, scale = state["momentum_buffer"], _adjust_lr(lr, group["adjust_lr_fn"], p.shape)
                # a step skipped on the device leaves the buffer as it was (weight 0)
                buf.lerp_(p.grad, 1 - momentum if keep is None else (keep * (1 - momentum)).to(buf.dtype))
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalize(
                    update, self.ns_dtype, group["ns_coefficients"], group["ns_steps"], group["eps"], self.orth
                )
                if self.variant == "normuon":
                    if "second_moment" not in state:
                        state["second_moment"] = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
                    update = normalize_neurons(update, state["second_moment"], self.beta2, keep=keep)
                if self.cautious and wd:  # the decay where the update and the weight agree in sign
                    cautious_decay_(p, update, lr * wd, keep)
                else:
                    p.mul_(1 - lr * wd if keep is None else (1 - lr * wd * keep).to(p.dtype))
                if keep is None:
                    p.add_(update, alpha=-scale)
                else:
                    p.sub_(update.to(p.dtype) * (scale * keep))


class Optimizers:
    """Several torch optimizers stepped as one (Muon for the hidden matrices, AdamW for the rest).

    It is the checkpoint's "optimizer" part: ``state_dict`` holds each one's under its name.
    """

    def __init__(self, **named: torch.optim.Optimizer) -> None:
        self.named = named

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.named.values() for g in opt.param_groups]

    @property
    def skips_on_device(self) -> bool:
        return all(getattr(opt, "skips_on_device", False) for opt in self.named.values())

    def step(self, skip: Skip = None) -> None:
        for opt in self.named.values():
            opt.step(skip=skip)

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
    roles = {id(p): "hidden" for p in model.transformer.h.parameters() if p.dim() == 2}
    roles.update({id(p): "head" for p in model.lm_head.parameters()})  # a tied head: the embedding's, below
    roles.update({id(p): "embed" for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()})
    out: dict[str, list[nn.Parameter]] = {"hidden": [], "embed": [], "head": [], "other": []}
    for p in model.parameters():  # de-duplicated: a tied head appears once, as the embedding
        if p.requires_grad:
            out[roles.get(id(p), "other")].append(p)
    return out


def make_muon(model: nn.Module, opt, device: torch.device, ns_dtype: torch.dtype = torch.float32) -> Optimizers:
    """Muon on the blocks' 2-D matrices, AdamW (fused where available) on the rest, as the optim section
    ``opt`` sets them (its variant, orthogonalisation and cautious weight decay, for both).

    Every group carries ``lr_name``, the TrainConfig field its peak rate comes from
    (``set_lrs``): muon_lr, embed_lr, head_lr or max_lr (gains, biases, other matrices).
    """
    if parallel.is_sharded(model):
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
        lr=opt.muon_lr,
        momentum=opt.muon_momentum,
        weight_decay=opt.muon_weight_decay,
        nesterov=True,
        ns_dtype=ns_dtype,
        variant=opt.muon_variant,
        beta2=opt.muon_beta2,
        orth=opt.muon_orth,
        cautious=opt.cautious_wd,
    )
    other, wd = split["other"], opt.weight_decay
    groups = [
        {"params": split["embed"], "lr": peak_lr(opt, "embed_lr"), "weight_decay": wd, "lr_name": "embed_lr"},
        {"params": split["head"], "lr": peak_lr(opt, "head_lr"), "weight_decay": wd, "lr_name": "head_lr"},
        {"params": [p for p in other if p.dim() >= 2], "lr": opt.max_lr, "weight_decay": wd, "lr_name": "max_lr"},
        {"params": [p for p in other if p.dim() < 2], "lr": opt.max_lr, "weight_decay": 0.0, "lr_name": "max_lr"},
    ]
    return Optimizers(adamw=AdamW([g for g in groups if g["params"]], **_adamw_settings(opt, device)), muon=muon)


def _adamw_settings(opt, device: torch.device) -> dict:
    """AdamW's settings from the optim section ``opt``: fused where the device has the kernel (CUDA, CPU)."""
    fused = device.type in ("cuda", "cpu") or None
    return dict(lr=opt.max_lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, fused=fused, cautious=opt.cautious_wd)


def build_optimizer(model: nn.Module, opt, device: torch.device, ns_dtype: Optional[str] = None, tokenizer=None):
    """The optimizer a TrainConfig's ``optim`` section (``opt``) asks for: AdamW over ``param_groups``
    or Muon + AdamW; with ``token_features``, the feature share of the
    token tables (train.token_features; ``tokenizer``: the run's, None for GPT-2's) stepped after them."""
    if opt.optimizer == "adamw":
        optimizer = AdamW(param_groups(model, opt.weight_decay), **_adamw_settings(opt, device))
    else:
        optimizer = make_muon(model, opt, device, getattr(torch, ns_dtype or "float32"))
    if not opt.token_features:
        return optimizer
    from gpt2lab.data.tokenizer import gpt2_tokenizer
    from gpt2lab.train.token_features import make_feature_share

    share = make_feature_share(
        model, tokenizer or gpt2_tokenizer(), optimizer, betas=(opt.beta1, opt.beta2), eps=opt.eps
    )
    named = optimizer.named if isinstance(optimizer, Optimizers) else {"adamw": optimizer}
    return Optimizers(**named, token_features=share)


def unscale(optimizer, scaler) -> None:
    """fp16: unscale the gradients before they are clipped (GradScaler's unscale_, which also finds
    inf ones for its scale), every part's but the feature share's, whose tables' gradients belong to
    (and are unscaled with) the part that owns the tables."""
    from gpt2lab.train.token_features import FeatureShare

    for one in parts(optimizer) if scaler is not None else []:
        if not isinstance(one, FeatureShare):
            scaler.unscale_(one)
