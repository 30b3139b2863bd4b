"""The peers a user would pick instead, timed in the same process on the same weights: transformers'
``GPT2LMHeadModel.generate`` and CTranslate2's ``Generator`` (optional extras: ``pip install
transformers ctranslate2``). Each is handed the very weights gpt2lab runs, through ``gpt2lab export``'s
HF directory (and, for CTranslate2, its own converter, ``ct2-transformers-converter``'s code)."""

from __future__ import annotations

import json
import os
import time

import torch

from gpt2lab.system.errors import UsageError

PEERS = ("transformers", "ctranslate2")
# CTranslate2's compute types timed beside gpt2lab: its fp32 and its int8 (int8 weights, activations
# quantized per row on the fly), the two docs/benchmarks.md compares against; bfloat16 where it runs.
CT2_COMPUTE_TYPES = ("float32", "int8", "bfloat16")


def parse_peers(text: str) -> list[str]:
    peers = [p.strip() for p in text.split(",") if p.strip() and p.strip() != "none"]
    for p in peers:
        if p not in PEERS:
            raise UsageError(f"--peer {p}: choose from {', '.join(PEERS)} or none (comma-separated)")
    return peers


def export(model, directory: str) -> str:
    """``model`` as an HF directory (GPT-2 or NanoChat, weights/targets.py; the tokenizer files
    included) under ``directory``."""
    from gpt2lab.weights.export import save_pretrained

    path = os.path.join(directory, "hf")
    save_pretrained(model, path)
    return path


def transformers_model(hf_dir: str, device: torch.device, dtype: str):
    try:
        import transformers
    except ImportError as e:
        raise UsageError(f"--peer transformers needs transformers ({e}); pip install transformers") from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)  # the class the export's config.json names
    return model.to(device=device, dtype=getattr(torch, dtype)).eval()


def transformers_greedy(hf, prompt: torch.Tensor, n: int) -> torch.Tensor:
    with torch.inference_mode():
        out = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            use_cache=True,
            pad_token_id=hf.config.eos_token_id,
        )
    return out[:, -n:]


class CT2:
    """One converted copy of the weights, loaded once per compute type that runs here."""

    def __init__(self, hf_dir: str, directory: str, threads: int) -> None:
        try:
            import ctranslate2
            from ctranslate2.converters import TransformersConverter
        except ImportError as e:
            raise UsageError(f"--peer ctranslate2 needs ctranslate2 ({e}); pip install ctranslate2") from None
        self.path = os.path.join(directory, "ct2")
        TransformersConverter(hf_dir).convert(self.path, force=True)  # float32 weights; quantized at load
        with open(os.path.join(self.path, "vocabulary.json")) as fh:
            self.vocab = json.load(fh)
        self.generators, self.errors = {}, {}
        for ct in CT2_COMPUTE_TYPES:
            try:
                self.generators[ct] = ctranslate2.Generator(
                    self.path, device="cpu", compute_type=ct, intra_threads=threads, inter_threads=1
                )
            except (ValueError, RuntimeError) as e:  # e.g. bfloat16 on a CPU it judges too slow for it
                self.errors[ct] = str(e).splitlines()[0]

    def greedy(self, compute_type: str, prompt: list[int], rows: int, n: int) -> list[list[int]]:
        """Exactly ``n`` new tokens for each of ``rows`` copies of ``prompt``, greedy, as token ids."""
        tokens = [self.vocab[i] for i in prompt]
        res = self.generators[compute_type].generate_batch(
            [tokens] * rows, max_length=n, min_length=n, sampling_topk=1, include_prompt_in_result=False
        )
        return [r.sequences_ids[0] for r in res]

    def tok_per_s(self, prompt: list[int], rows: int, n: int, repeats: int) -> dict:
        """Best-of-``repeats`` tokens/s of each compute type that runs (its error where it does not)."""
        out: dict = {ct: f"not run: {e}" for ct, e in self.errors.items()}
        for ct in self.generators:
            self.greedy(ct, prompt, rows, 4)  # warm-up
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                got = self.greedy(ct, prompt, rows, n)
                best = min(best, time.perf_counter() - t0)
            out[ct] = sum(len(g) for g in got) / best
        return out
