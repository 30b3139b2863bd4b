"""The peers a user would pick instead, timed in the same run on the same weights: transformers'
``GPT2LMHeadModel.generate`` and CTranslate2's ``Generator`` (optional extras: ``pip install
transformers ctranslate2``), in this process; and llama.cpp, whose ``llama-bench`` the user builds and
names (``--llama-cpp PATH``), in its own. Each is handed the very weights gpt2lab runs, through
``gpt2lab export``'s HF directory (and each peer's own converter from it: ``ct2-transformers-converter``'s
code; llama.cpp's ``convert_hf_to_gguf.py``, found in the llama.cpp tree ``llama-bench`` was built in)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from gpt2lab.benchmarks import timed
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


def transformers_greedy(hf_dir: str, device: torch.device, dtype: str, prompt: torch.Tensor, n: int):
    """A function giving transformers' greedy ``n`` new tokens after ``prompt`` (1, n), from the export in
    ``hf_dir`` loaded in ``dtype`` on ``device``."""
    try:
        import transformers
    except ImportError as e:
        raise UsageError(f"--peer transformers needs transformers ({e}); pip install transformers") from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # the class the export's config.json names
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).to(device=device, dtype=getattr(torch, dtype)).eval()
    exactly_n = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=hf.config.eos_token_id)

    @torch.inference_mode()
    def greedy() -> torch.Tensor:
        return hf.generate(prompt, attention_mask=torch.ones_like(prompt), use_cache=True, **exactly_n)[:, -n:]

    return greedy


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
        self.vocab = json.loads(Path(self.path, "vocabulary.json").read_text())
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
            best, got = min(timed(lambda: self.greedy(ct, prompt, rows, n)) for _ in range(repeats))
            out[ct] = sum(len(g) for g in got) / best
        return out


# llama.cpp's GGUF types timed beside gpt2lab: its float types and q8_0 (8-bit weights in blocks of 32
# with a scale each), the one the int8 paths are compared with.
LLAMA_TYPES = ("f32", "f16", "bf16", "q8_0")


class LlamaCpp:
    """gpt2lab's export converted by llama.cpp's own converter to each of ``LLAMA_TYPES``, timed by
    ``llama-bench`` in a process of its own (a type the converter or the CPU cannot do: its error)."""

    def __init__(self, bench: str, hf_dir: str, directory: str, threads: int, convert: "str | None" = None) -> None:
        if not (os.path.isfile(bench) and os.access(bench, os.X_OK)):
            raise UsageError(f"--llama-cpp {bench}: not an executable file (the llama-bench of a llama.cpp build)")
        self.bench, self.threads = bench, threads
        if convert and not os.path.isfile(convert):
            raise UsageError(f"--llama-cpp-convert {convert}: no such file (llama.cpp's convert_hf_to_gguf.py)")
        # else llama.cpp's converter in the source tree above ``bench`` (build/bin/llama-bench: three levels)
        found = [p / "convert_hf_to_gguf.py" for p in list(Path(bench).resolve().parents)[:4]]
        converter = convert or next((str(c) for c in found if c.is_file()), None)
        if converter is None:
            raise UsageError(
                f"--llama-cpp {bench}: no convert_hf_to_gguf.py in the llama.cpp tree above it; "
                "give its path with --llama-cpp-convert"
            )
        self.models, self.errors = {}, {}
        for kind in LLAMA_TYPES:
            path = os.path.join(directory, f"model-{kind}.gguf")
            cmd = [sys.executable, converter, hf_dir, "--outfile", path, "--outtype", kind]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode == 0 and os.path.isfile(path):
                self.models[kind] = path
            else:
                self.errors[kind] = f"conversion failed: {_last_line(done.stderr)}"

    def tok_per_s(self, prompt_tokens: int, n: int, repeats: int) -> dict:
        """Each type's decode tok/s: ``llama-bench`` generating ``n`` tokens after a context of
        ``prompt_tokens`` (``-d``), ``repeats`` times, the best run's (its samples are in its JSON)."""
        out: dict = {kind: f"not run: {e}" for kind, e in self.errors.items()}
        for kind, path in self.models.items():
            cmd = [self.bench, "-m", path, "-p", "0", "-n", str(n), "-d", str(prompt_tokens)]
            cmd += ["-r", str(repeats), "-t", str(self.threads), "-o", "json"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            try:
                rows = json.loads(done.stdout)
                out[kind] = max(rows[0]["samples_ts"])
            except (ValueError, LookupError, TypeError):
                out[kind] = f"not run: llama-bench exit {done.returncode}: {_last_line(done.stderr)}"
        return out


def best_rounds(rounds: list[dict]) -> dict:
    """Each type's best tok/s over ``rounds`` (``LlamaCpp.tok_per_s`` results: each names every type); a
    type no round ran keeps its first round's error."""
    return {k: max((r[k] for r in rounds if isinstance(r[k], float)), default=v) for k, v in rounds[0].items()}


def ratios(ours: float, theirs: dict) -> dict:
    """``ours`` over each figure of ``theirs`` that was measured (not an error's text)."""
    return {k: ours / v for k, v in theirs.items() if isinstance(v, float)}


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"
