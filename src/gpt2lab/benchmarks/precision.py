"""gpt2lab bench precision: what each inference precision costs in quality, against fp32 F.linear.

One trained model (``--model``: a run, checkpoint or HF directory) is held every way the
inference path can hold it (inference/form.py: bf16 weights, int8 weights with fp32 or bf16
activations, each with the kernel ``--cpu-linear`` names, and where gpt2lab's compiled kernels run,
bf16 ``gemv`` and ``int8-gemv``, and on a CPU with native bf16, where ``gemv`` rounds its inputs to bf16,
also ``gemv`` with fp32 inputs; the reference: fp32 weights, ``F.linear``), and each is compared with
the reference on held-out text (greedy decoding of all prompts at once: a batch, which the compiled
kernels' fused step runs too):

* validation loss on the first ``--tokens`` tokens of ``--data``'s val split (and its difference);
* teacher-forced top-1 agreement: on those tokens, how often the next-token argmax equals fp32's;
* greedy agreement: ``--prompts`` prompts of ``--prompt-tokens`` val tokens, each continued
  greedily for ``--new-tokens``; the share of continuations identical to fp32's, and the mean share
  of each continuation before its first differing token;
* HellaSwag accuracy on ``--hellaswag-limit`` examples of ``--hellaswag`` (0 skips it).
"""

from __future__ import annotations

import argparse

import torch

from gpt2lab.distributed.dist import pick_device
from gpt2lab.inference.choice import Candidate, gemv_bf16_inputs
from gpt2lab.inference.form import detect_facts, hold
from gpt2lab.inference.kernels import cannot_run, gemv_error
from gpt2lab.model.sampling import generate
from gpt2lab.system.choices import LINEAR_CHOICES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a trained model: run dir, checkpoint or HF directory")
    p.add_argument("--data", required=True, help="token shards (gpt2lab prepare) whose val split is held out")
    p.add_argument("--tokens", type=int, default=65536, help="val tokens for the loss and top-1 agreement")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's block)")
    p.add_argument("--prompts", type=int, default=32, help="greedy continuations compared")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--hellaswag", help="HellaSwag jsonl (default: the official validation set)")
    p.add_argument("--hellaswag-limit", type=int, default=0, help="examples scored (0: skip HellaSwag)")
    kernels = [c for c in LINEAR_CHOICES if c != "auto"]
    p.add_argument("--cpu-linear", default="packed", choices=kernels, help="the float ways' kernel")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int)


def _ways(linear: str, device: torch.device) -> dict[str, Candidate]:
    """The ways compared; gpt2lab's compiled kernels (the fused step with them) where they run."""
    kernel = "plain" if linear == "plain" else "packed"
    # where oneDNN packs no bf16 (a CPU without AVX-512 or AVX-NE-CONVERT), bf16 weights as auto holds them
    half = "upcast" if kernel == "packed" and device.type == "cpu" and cannot_run("packed", torch.bfloat16) else kernel
    ways = {
        "float32": Candidate("float32", "plain"),
        "float32_" + kernel: Candidate("float32", kernel),
        "bfloat16": Candidate("bfloat16", half),
        "int8_fp32_act": Candidate("float32", "int8"),
        "int8_bf16_act": Candidate("bfloat16", "int8"),
    }
    if gemv_error(device) is None:
        ways.update(bfloat16_gemv=Candidate("bfloat16", "gemv"), int8_gemv=Candidate("float32", "int8-gemv"))
        if gemv_bf16_inputs(detect_facts(device)):  # the default rounds its inputs here: also the fp32 ones
            ways[FP32_INPUTS] = Candidate("bfloat16", "gemv")
    return ways


# bf16 weights by the compiled GEMV with the inputs kept fp32, where a hold would round them (native bf16)
FP32_INPUTS = "bfloat16_gemv_fp32_inputs"


@torch.inference_mode()
def run(args: argparse.Namespace) -> dict:
    from gpt2lab.data import TokenLoader
    from gpt2lab.weights.load import load_model

    device = pick_device(args.device)
    model = load_model(args.model, device)
    seq = args.seq_len or model.config.block_size
    loader = TokenLoader(args.data, "val", 1, seq, shuffle=False)
    rows = max(1, args.tokens // seq)
    x, y = zip(*(loader.next_batch() for _ in range(rows)))
    x, y = torch.cat(x).to(device), torch.cat(y).to(device)
    prompts = x.reshape(-1)[: args.prompts * args.prompt_tokens].reshape(args.prompts, args.prompt_tokens)
    out: dict = {
        "model": args.model,
        "device": str(device),
        "torch": torch.__version__,
        "val_tokens": int(y.numel()),
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "ways": {},
    }
    ref_argmax = ref_greedy = None
    for name, cand in _ways(args.cpu_linear, device).items():
        m = hold(model, cand, rows=1, **({"bf16_inputs": False} if name == FP32_INPUTS else {}))
        losses, argmax = [], []
        for xs, ys in zip(x.split(1), y.split(1)):
            logits, loss = m(xs, ys)
            losses.append(float(loss))
            argmax.append(logits[..., : model.config.real_vocab_size].argmax(-1))
        argmax = torch.cat(argmax)
        greedy = generate(m, prompts, args.new_tokens, temperature=0.0)[:, args.prompt_tokens :]
        rounded = any(getattr(lin, "bf16_inputs", False) for lin in m.modules())
        way = {"kernel": cand.name, "bf16_inputs": rounded, "val_loss": sum(losses) / len(losses)}
        if ref_argmax is None:
            ref_argmax, ref_greedy, ref_loss = argmax, greedy, way["val_loss"]
        way["val_loss_minus_fp32"] = way["val_loss"] - ref_loss
        way["top1_agreement"] = float((argmax == ref_argmax).float().mean())
        same = greedy == ref_greedy
        prefix = torch.where(same.all(1), args.new_tokens, (~same).float().argmax(1)).float()
        way["greedy_identical"] = float(same.all(1).float().mean())
        way["greedy_prefix_share"] = float((prefix / args.new_tokens).mean())
        if args.hellaswag_limit:
            from gpt2lab.evals.hellaswag import evaluate_hellaswag

            hs = evaluate_hellaswag(m, args.hellaswag, device=device, limit=args.hellaswag_limit)
            way.update(hellaswag_acc=hs["acc"], hellaswag_acc_norm=hs["acc_norm"], hellaswag_n=hs["n"])
        out["ways"][name] = way
    return out
