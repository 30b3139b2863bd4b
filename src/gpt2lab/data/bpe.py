"""Your own tokenizer: train a byte-level BPE (``gpt2lab tokenizer train``) and measure it (``... eval``).

The training is Hugging Face ``tokenizers``' BpeTrainer over the documents data/sources.py reads (so
``--source`` takes what ``gpt2lab prepare --source`` takes), streamed: memory grows with the distinct
pre-tokens seen, not with the text. Same files in, byte-identical files out.

Pre-tokenisation, before any merge, splits text with ``SPLIT_PATTERN``, GPT-4's (cl100k) regex: a
merge never crosses a piece's edge. Against GPT-2's it (1) puts digits in groups of one to three, so
numbers get a few uniform tokens instead of whatever merges a corpus happened to favour; (2) keeps a
run of spaces, tabs or newlines as a piece of its own (the last space goes to the next word), so code's
indentation becomes a few tokens, where GPT-2's pattern leaves many single spaces; (3) takes
contractions in either case and glues a leading punctuation mark to the word after it. Byte-level:
every byte is in the alphabet, so any text encodes and decodes back exactly.

A tokenizer directory holds ``tokenizer.json`` (Hugging Face's format: the tokenizer itself and the
one source of truth) and ``gpt2lab_tokenizer.json``, the marker (system/rundir.py): format, version,
identity (the sha256 of tokenizer.json), vocabulary size, special token ids, the split pattern and
the sources with their bytes. ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>`` are ids 0, 1, 2.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Iterable, Iterator, Optional

from gpt2lab.data import chat
from gpt2lab.data.sources import JsonLine, TextSource, as_text, resolve_source
from gpt2lab.data.tokenizer import (
    SPECIAL_TOKENS,
    TOKENIZER_FILE,
    Tokenizer,
    TokenizerError,
    TrainedBPE,
    gpt2_tokenizer,
    is_gpt2_vocabulary,
    load_tokenizer,
)
from gpt2lab.system import rundir
from gpt2lab.system.errors import UsageError
from gpt2lab.system.files import atomic_dir, read_json_object, write_json

SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)
MARKER, FORMAT, MARKER_VERSION = rundir.TOKENIZER_MARKER, rundir.TOKENIZER_FORMAT, 1
MIN_VOCAB = 256 + len(SPECIAL_TOKENS) + 1  # the byte alphabet, the special tokens and one merge
MAX_VOCAB = 1 << 20


def _bpe(vocab_size: int):
    """An untrained byte-level BPE with gpt2lab's split, and its trainer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    split = pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    return tok, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False, initial_alphabet=alphabet
    )


def read_texts(sources: list[tuple[str, TextSource]], text_field: str, counts: list[dict], bar=None) -> Iterator[str]:
    """The documents' texts of every source (each ``--source`` string and what it resolved to) in
    turn; ``counts`` gets each source's bytes and documents."""
    for spec, src in sources:
        entry = {"source": spec, "bytes": 0, "documents": 0}
        counts.append(entry)
        for doc in src.documents(0, None):
            # a conversation (a JSON line in the messages format without ``text_field``): its messages' contents,
            # one per line, so a tokenizer can be trained on chat data too
            row = doc.row() if isinstance(doc, JsonLine) else {}
            in_chat = text_field not in row and chat.is_conversation(row)
            text = "\n".join(content for _, content in doc.turns()) if in_chat else as_text(doc)
            n = len(text.encode("utf-8", "surrogatepass"))
            entry["bytes"] += n
            entry["documents"] += 1
            if bar is not None:
                bar.update(n)
            yield text


def train_tokenizer(
    sources: list[str], vocab_size: int, out: str, text_field: str = "text", progress: bool = True
) -> dict:
    """Train a tokenizer of ``vocab_size`` tokens on ``sources`` into the directory ``out``; returns its marker.

    ``out`` follows system/rundir's rule: missing, empty or an earlier tokenizer directory (holding
    nothing else), which the new one replaces whole (written beside it, then renamed)."""
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise UsageError(
            f"--vocab-size {vocab_size}: must be {MIN_VOCAB} to {MAX_VOCAB:,} (256 bytes, "
            f"{len(SPECIAL_TOKENS)} special tokens and at least one merge)"
        )
    if not sources:
        raise UsageError("--source: give at least one text source")
    rundir.check(out, rundir.TOKENIZER, "--out", "choose a new or empty --out", replaces=(TOKENIZER_FILE, MARKER))
    # every source resolves (a bad path, no text files) before the long part, once (a warning says it once)
    resolved = [(spec, resolve_source(spec, text_field)) for spec in sources]
    tok, trainer = _bpe(vocab_size)
    counts: list[dict] = []
    from tqdm import tqdm

    sizes = [src.size_bytes for _, src in resolved]
    total = sum(sizes) if None not in sizes else None  # compressed files: an estimate
    bar = tqdm(disable=not progress, total=total, unit="B", unit_scale=True, desc="tokenizer", dynamic_ncols=True)
    with bar:
        tok.train_from_iterator(read_texts(resolved, text_field, counts, bar), trainer)
    if not sum(c["bytes"] for c in counts):  # nothing to learn from: 259 tokens, below MIN_VOCAB
        docs = sum(c["documents"] for c in counts)
        raise UsageError(
            f"--source {' '.join(sources)}: no text to train on ({docs} document(s), 0 bytes); "
            "nothing was written; point --source at files with text"
        )
    text = tok.to_str()
    trained = TrainedBPE(text)  # the checks any reader makes, before anything is written
    if trained.n_vocab < vocab_size:
        warnings.warn(
            f"the sources gave {trained.n_vocab:,} tokens, fewer than the {vocab_size:,} asked for "
            "(no pair left to merge); train on more text for more",
            stacklevel=2,
        )
    marker = {
        "format": FORMAT,
        "version": MARKER_VERSION,
        "identity": trained.identity,
        "vocab_size": trained.n_vocab,
        "special_tokens": dict(trained.specials),
        "split_pattern": SPLIT_PATTERN,
        "sources": counts,
    }
    with atomic_dir(os.path.abspath(out), what_next="free some space and train again") as tmp:
        Path(tmp, TOKENIZER_FILE).write_text(text, encoding="utf-8")
        write_json(os.path.join(tmp, MARKER), marker)
    return marker


# -- reading one back ---------------------------------------------------------------------------
def open_dir(path: str, flag: Optional[str] = "--tokenizer") -> Tokenizer:
    """The tokenizer in a directory ``gpt2lab tokenizer train`` wrote (or any holding a tokenizer.json
    with gpt2lab's special tokens; ``path`` may be that tokenizer.json itself) as ``tokenizer_in`` reads it;
    GPT-2's BPE (``gpt2_tokenizer``) for GPT-2's own vocabulary. ``flag``: how the user named ``path``
    (None: the path alone, as gpt2lab.get_tokenizer names it)."""
    said = f"{flag} {path}" if flag else path
    if not os.path.exists(path):
        make = f"make one with `gpt2lab tokenizer train --source SRC --vocab-size N --out {path}`"
        raise UsageError(f"{said}: no such directory or file; {make}")
    file = path if os.path.isfile(path) else os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(file) and not is_gpt2_vocabulary(path):
        raise UsageError(
            f"{said}: holds no {TOKENIZER_FILE} (nor GPT-2's vocab.json and merges.txt); give a "
            f"directory from `gpt2lab tokenizer train` or its {TOKENIZER_FILE}"
        )
    try:
        own = tokenizer_in(path, f"train the tokenizer in {os.path.dirname(file) or '.'} again")
    except TokenizerError as e:
        if not flag:
            raise
        raise TokenizerError(f"{flag} {e}") from None
    return own if own is not None else gpt2_tokenizer()


def tokenizer_in(path: str, fix: str, vocab: Optional[int] = None) -> Optional[TrainedBPE]:
    """The trained tokenizer of a directory (its tokenizer.json, as transformers' AutoTokenizer reads it
    too) or of a tokenizer.json, checked against the identity its marker names (``tokenizer train``'s or an
    export's, where there is one); None: GPT-2's own BPE, or no tokenizer.json. A tokenizer.json that is
    neither, or has more than ``vocab`` tokens (a model's), is refused naming it, with ``fix``: what to do."""
    file = path if os.path.isfile(path) else os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(file) or is_gpt2_vocabulary(file):
        return None
    named = None
    if os.path.basename(file) == TOKENIZER_FILE:  # the marker beside it: a `tokenizer train` directory's, an export's
        markers = {MARKER: "identity", rundir.EXPORT_MARKER: "tokenizer"}
        found = [(read_json_object(os.path.join(os.path.dirname(file), m)) or {}).get(k) for m, k in markers.items()]
        named = next((n for n in found if isinstance(n, str)), None)
    try:
        tok = load_tokenizer(file, named, what_next=fix)
    except TokenizerError as e:
        if named:
            raise
        why = str(e).removeprefix(f"{file}: ")
        raise TokenizerError(f"{file}: neither GPT-2's BPE nor a tokenizer gpt2lab reads ({why}); {fix}") from e
    if vocab is not None and tok.n_vocab > vocab:
        raise TokenizerError(f"{file}: has {tok.n_vocab:,} tokens, more than the model's {vocab:,}; {fix}")
    return tok


# -- bytes per token ------------------------------------------------------------------------------
def evaluate_tokenizer(tokenizer_dir: str, sources: Iterable[str], text_field: str = "text") -> list[dict]:
    """Per source: its UTF-8 bytes, documents, and the tokens and bytes per token of ``tokenizer_dir``'s
    tokenizer ("ours") and GPT-2's (the documents encoded as text, as ``prepare`` encodes them, without
    the <|endoftext|> before each)."""
    tokenizers, rows = {"ours": open_dir(tokenizer_dir), "gpt2": gpt2_tokenizer()}, []
    for spec in sources:
        counts: list[dict] = []
        tokens = dict.fromkeys(tokenizers, 0)
        for text in read_texts([(spec, resolve_source(spec, text_field))], text_field, counts):
            for name, tok in tokenizers.items():
                tokens[name] += len(tok.encode_ordinary(text))
        n = counts[0]["bytes"]
        per = {name: {"tokens": t, "bytes_per_token": n / t if t else None} for name, t in tokens.items()}
        rows.append({**counts[0], "tokenizers": per})
    return rows
