"""Tokenizers: GPT-2's BPE and a byte-level BPE trained by gpt2lab, both one class (``Tokenizer``, a tiktoken
Encoding) whose vocabulary, split pattern and special tokens are data.

GPT-2's is built from files shipped in the package (tiktoken's own ``get_encoding("gpt2")``
downloads encoder.json and vocab.bpe on first use; shipping them, and checking their sha256, makes
gpt2lab work with no network). A trained one (``gpt2lab tokenizer train``, data/bpe.py) is a
Hugging Face ``tokenizer.json``, the one file that holds it; its identity is that file's sha256.

Both answer what gpt2lab asks of a tokenizer: encode text as text
(``encode_ordinary``) or with special tokens (``encode``, tiktoken's rules), decode, each token's
bytes, the vocabulary size, ``<|endoftext|>``'s id and the chat template's two turn tokens.

A model names its tokenizer by identity (``GPTConfig.tokenizer``; None is GPT-2's). The files
travel with everything that holds a model (prepared data, a run, each checkpoint, an export); whoever
reads a model from one of them reads its ``tokenizer.json`` from the same place (``load_tokenizer``,
which checks the identity) and hands it on: there is no process-wide registry of tokenizers.
``for_config(config, own)`` is the one rule for a model's tokenizer given what was read; ``for_model``
reads it off a model.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from importlib import resources
from typing import Mapping, Optional

import numpy as np
import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

from gpt2lab.model.config import GPTConfig
from gpt2lab.system.errors import ConfigError, DataError
from gpt2lab.system.files import atomic_write, read_json_object, sha256_file

EOT_TOKEN = "<|endoftext|>"
EOT_ID = 50256
# A chat model's two turn tokens (data/chat.py: the ChatML template). In GPT-2's vocabulary they are
# the first two rows of the padding gpt2lab adds (50257 -> 50304), so no new embedding is needed.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
IM_START_ID, IM_END_ID = 50257, 50258
# Every trained tokenizer has these, in this order (data/bpe.py gives them ids 0, 1, 2).
SPECIAL_TOKENS = (EOT_TOKEN, IM_START, IM_END)
TOKENIZER_FILE = "tokenizer.json"  # a trained tokenizer, in Hugging Face's format
GPT2 = "gpt2"  # how a manifest names GPT-2's tokenizer

# The hashes tiktoken itself checks for the OpenAI GPT-2 files.
_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
# The GPT-2 pre-tokenisation regex (tiktoken's r50k/gpt2 pattern).
_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


class TokenizerError(DataError):
    """A tokenizer file that cannot be used (missing, damaged, not the one a model names)."""


def asset_path(name: str) -> str:
    """Filesystem path of a file shipped in ``gpt2lab/assets``."""
    return str(resources.files("gpt2lab") / "assets" / name)


def _checked(name: str) -> str:
    path = asset_path(name)
    digest = sha256_file(path)
    if digest != _SHA256[name]:
        raise RuntimeError(
            f"{path}: sha256 {digest} does not match the GPT-2 release ({_SHA256[name]}); "
            "the installed package is damaged, reinstall gpt2lab"
        )
    return path


# -- GPT-2's ---------------------------------------------------------------------------------------
class Tokenizer(tiktoken.Encoding):
    """A byte-level BPE, GPT-2's (``gpt2_tokenizer``) or a trained one (``TrainedBPE``): a tiktoken Encoding
    (every method tiktoken has: ``encode_ordinary``, ``encode`` with tiktoken's rules for special tokens,
    ``decode``, ``decode_single_token_bytes``, ``n_vocab``) with what gpt2lab asks of a tokenizer besides:
    ``identity`` (sha256 of tokenizer.json; None: GPT-2's), ``eot_id`` (<|endoftext|>: every document starts
    with it), ``im_start_id``/``im_end_id`` (the chat template's turn tokens; None: GPT-2's without them)."""

    identity: Optional[str] = None
    text: Optional[str] = None  # a trained one's tokenizer.json

    def __init__(self, name: str, pat_str: str, ranks: dict, specials: dict, n_vocab: Optional[int] = None) -> None:
        super().__init__(
            name=name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials, explicit_n_vocab=n_vocab
        )
        self.specials = specials
        self.eot_id, self.im_start_id, self.im_end_id = (specials.get(t) for t in SPECIAL_TOKENS)

    def __reduce__(self):  # worker processes (spawn) build it again: GPT-2's from the package, a trained one's text
        return (gpt2_tokenizer, (self.im_start_id is not None,)) if self.text is None else (TrainedBPE, (self.text,))


@functools.lru_cache(maxsize=2)
def gpt2_tokenizer(chat: bool = False) -> Tokenizer:
    """The GPT-2 BPE (50257 tokens, ``<|endoftext|>`` = 50256), offline; ``chat``: with the two
    turn tokens as special tokens too (50259: ``GPTConfig.template_vocab``), for a chat model's text.
    (Built once: it is immutable.)"""
    specials = {EOT_TOKEN: EOT_ID, **({IM_START: IM_START_ID, IM_END: IM_END_ID} if chat else {})}
    return Tokenizer("gpt2-chatml" if chat else "gpt2", _PAT_STR, _ranks(), specials)


@functools.lru_cache(maxsize=1)
def _ranks() -> dict:
    return data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=_checked("vocab.bpe"), encoder_json_file=_checked("encoder.json")
    )


def is_gpt2_vocabulary(path: str) -> bool:
    """Whether ``path`` (a Hugging Face tokenizer directory, or a tokenizer.json) holds GPT-2's own BPE:
    OpenAI's vocabulary and merges, as vocab.json + merges.txt (a GPT-2 export, the hub's gpt2) or in a
    tokenizer.json (which a directory's tokenizer.json decides where it has one, as for transformers'
    AutoTokenizer). Compared token by token and merge by merge with the files shipped here."""
    vocab, merges = _gpt2_vocab_and_merges()
    try:
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, TOKENIZER_FILE)):
            return (
                read_json_object(os.path.join(path, "vocab.json")) == vocab
                and _merges(os.path.join(path, "merges.txt")) == merges
            )
        model = read_json_object(os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path)["model"]
        got = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        return model.get("type") == "BPE" and model.get("vocab") == vocab and got == merges
    except (OSError, ValueError, TypeError, AttributeError, KeyError):  # missing, not JSON, another shape: not GPT-2's
        return False


@functools.lru_cache(maxsize=1)
def _gpt2_vocab_and_merges() -> tuple[dict, list[str]]:
    return read_json_object(_checked("encoder.json")), _merges(_checked("vocab.bpe"))


def _merges(path: str) -> list[str]:
    """The merges of a merges.txt / vocab.bpe: one "a b" per line, after the "#version" line."""
    with open(path, encoding="utf-8") as f:
        return [line for line in f.read().split("\n") if line and not line.startswith("#version")]


# -- a trained one -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's bytes_to_unicode, which Hugging Face's ByteLevel uses):
    the printable bytes but space stand for themselves, every other byte b for chr(256 + its rank among them)."""
    other = [b for b in range(256) if not chr(b).isprintable() or b == ord(" ")]
    return {**{chr(b): b for b in range(256) if b not in other}, **{chr(256 + k): b for k, b in enumerate(other)}}


class TrainedBPE(Tokenizer):
    """A byte-level BPE from a Hugging Face ``tokenizer.json`` as ``gpt2lab tokenizer train`` writes it
    (data/bpe.py): a BPE model whose merges make tokens in the order of their ids, split by one regex
    before the byte-level alphabet, no normalizer. Its merges by rank are then Hugging Face's merges
    by priority: tiktoken encodes it as tokenizers does. Text is text: special tokens are parsed only
    where ``encode`` allows them (tiktoken's rule), never by ``encode_ordinary``."""

    def __init__(self, text: str, where: str = TOKENIZER_FILE) -> None:
        redo = "train it again with gpt2lab tokenizer train"
        try:
            spec = json.loads(text)
            model, (split, byte_level) = spec["model"], spec["pre_tokenizer"]["pretokenizers"]
            pattern, vocab, merges = split["pattern"]["Regex"], model["vocab"], model["merges"]
            specials = {t["content"]: t["id"] for t in spec["added_tokens"]}
            made = [vocab.get("".join(m) if isinstance(m, list) else m.replace(" ", "", 1)) for m in merges]
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise TokenizerError(f"{where}: not a Hugging Face tokenizer.json ({e!r}); {redo}") from e
        if (
            model.get("type") != "BPE"
            or spec.get("normalizer") is not None
            or (split.get("type"), byte_level.get("type"), byte_level.get("use_regex")) != ("Split", "ByteLevel", False)
            or any(b is None or a is not None and b <= a for a, b in zip([None, *made], made))
        ):
            raise TokenizerError(f"{where}: not gpt2lab's byte-level BPE (its model, split or merges differ); {redo}")
        missing = [t for t in SPECIAL_TOKENS if t not in specials]
        if missing:
            raise TokenizerError(
                f"{where}: has no {', '.join(missing)} token; gpt2lab needs "
                f"{', '.join(SPECIAL_TOKENS)} (gpt2lab tokenizer train adds them)"
            )
        table, ranks = _byte_of_char(), {}
        for piece, i in vocab.items():
            if piece not in specials:
                try:
                    ranks[bytes(table[c] for c in piece)] = i
                except KeyError:
                    raise TokenizerError(f"{where}: token {piece!r} (id {i}) is not byte-level BPE; {redo}") from None
        try:
            super().__init__("gpt2lab-bpe", pattern, ranks, specials, len(ranks) + len(specials))
        except (AssertionError, ValueError) as e:  # tiktoken checks the ids are 0..n-1 and compiles the split
            raise TokenizerError(f"{where}: ids not 0..n-1 without gaps, or a split that fails; {redo}") from e
        self.text, self.identity = text, hashlib.sha256(text.encode("utf-8")).hexdigest()


# -- which tokenizer -------------------------------------------------------------------------------
def load_tokenizer(file: str, identity: Optional[str] = None, what_next: str = "") -> TrainedBPE:
    """The trained tokenizer in ``file`` (a tokenizer.json), checked to be ``identity`` when given."""
    fix = f"; {what_next}" if what_next else ""
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise TokenizerError(f"{file}: cannot be read ({e.strerror or e}){fix}") from e
    digest = hashlib.sha256(raw).hexdigest()
    if identity is not None and digest != identity:
        raise TokenizerError(f"{file}: is tokenizer {short(digest)}, not {short(identity)} as expected{fix}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{file}: not UTF-8 text ({e}); not a tokenizer.json{fix}") from e
    return TrainedBPE(text, file)


def save_tokenizer(tok: TrainedBPE, folder: str, what_next: str = "") -> str:
    """``tok``'s tokenizer.json in ``folder``, written atomically (kept where that very file is there
    already); its path."""
    path = os.path.join(folder, TOKENIZER_FILE)
    if os.path.isfile(path) and sha256_file(path) == tok.identity:
        return path
    with atomic_write(path, "w", what_next=what_next or None) as f:
        f.write(tok.text)
    return path


def for_data(data_dir: str) -> Tokenizer:
    """The tokenizer a prepared directory's shards were made with: GPT-2's (its chat variant for
    conversations), or the trained one its manifest names, read from the tokenizer.json beside them."""
    from gpt2lab.data.shards import read_manifest

    manifest = read_manifest(data_dir)
    name = data_tokenizer(manifest)
    if name is None:
        return gpt2_tokenizer(chat="chat_template" in manifest)
    fix = f"prepare {data_dir} again (gpt2lab prepare --tokenizer DIR)"
    return load_tokenizer(os.path.join(data_dir, TOKENIZER_FILE), name, what_next=fix)


def data_tokenizer(manifest: Mapping) -> Optional[str]:
    """The tokenizer a prepared directory's ``manifest`` names, as a model's config names it: a trained
    one's identity, None for GPT-2's BPE."""
    found = manifest.get("tokenizer", GPT2)
    return None if found == GPT2 else str(found)


def check_data_tokenizer(data: str, manifest: Mapping, model: Optional[str], whose: str, instead: str) -> None:
    """Refuse ``--data data`` (its ``manifest``) prepared with another tokenizer than ``model``, the
    tokenizer of the model of ``whose`` (a flag and its value, or a checkpoint): its losses would mean
    nothing. One line naming the data, both tokenizers and what to do: prepare it again, or ``instead``."""
    ours = data_tokenizer(manifest)
    if ours != model:
        fix = (
            "prepare it with that model's tokenizer (gpt2lab prepare --tokenizer DIR, DIR holding its "
            "tokenizer.json: the run, checkpoint or export)"
            if model
            else "prepare it without --tokenizer"
        )
        raise ConfigError(
            f"--data {data} was prepared with {short(ours)}, but the model of {whose} uses {short(model)}; "
            f"{fix}, or {instead}"
        )


def short(identity: Optional[str]) -> str:
    """A tokenizer's name in a message: GPT-2's, or the start of its sha256."""
    return "GPT-2's BPE" if identity is None else f"sha256:{identity[:12]}"


def for_config(config: GPTConfig, own: Optional[Tokenizer] = None) -> Tokenizer:
    """A model's tokenizer: ``own``, the trained one read from where the model was read (it must be
    the one ``config.tokenizer`` names), or, for a model of GPT-2's vocabulary, GPT-2's BPE with the
    turn tokens where the model is a chat model."""
    if config.tokenizer is None:
        return gpt2_tokenizer(chat=config.chat_template is not None)
    if own is None or own.identity != config.tokenizer:
        what = "none was given" if own is None else f"{short(own.identity)} was given"
        raise TokenizerError(
            f"the model has its own tokenizer {short(config.tokenizer)} and {what}; read it "
            "from where the model came from (gpt2lab.get_tokenizer(SOURCE), or "
            "gpt2lab.from_pretrained, whose model carries it)"
        )
    return own


def for_model(model) -> Tokenizer:
    """The tokenizer of ``model`` (``for_config`` of its config and the tokenizer it holds), through a
    DDP wrapper (``.module``); GPT-2's BPE for a model that is not gpt2lab's (transformers')."""
    inner = model if hasattr(model, "config") else getattr(model, "module", None)
    config = getattr(inner, "config", None)
    return for_config(config, getattr(inner, "tokenizer", None)) if isinstance(config, GPTConfig) else gpt2_tokenizer()


def for_chat(tok: Tokenizer) -> Tokenizer:
    """``tok`` with the chat template's turn tokens: GPT-2's chat variant where ``tok`` is GPT-2's
    without them (a base model is scored and talked to in the template all the same)."""
    return tok if tok.im_start_id is not None else gpt2_tokenizer(chat=True)


def token_dtype(n_vocab: int) -> np.dtype:
    """The narrowest shard dtype that holds every id: uint16 up to 65,536 tokens, else uint32."""
    return np.dtype(np.uint16) if n_vocab <= 1 << 16 else np.dtype(np.uint32)


def byte_lengths(tok: Tokenizer) -> np.ndarray:
    """int64 table: the UTF-8 bytes each token id decodes to, special tokens 0 (bits per byte counts
    the text's bytes; the template's markers are not text)."""
    key = (tok.identity, tok.n_vocab)
    if key not in _BYTE_LENGTHS:
        specials = {tok.eot_id, tok.im_start_id, tok.im_end_id} - {None}
        _BYTE_LENGTHS[key] = np.array(
            [0 if i in specials else len(tok.decode_single_token_bytes(i)) for i in range(tok.n_vocab)], dtype=np.int64
        )
    return _BYTE_LENGTHS[key]


_BYTE_LENGTHS: dict[tuple, np.ndarray] = {}
