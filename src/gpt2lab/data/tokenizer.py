"""The GPT-2 BPE as a tiktoken ``Encoding``, built from files shipped in the package.

tiktoken's own ``get_encoding("gpt2")`` downloads encoder.json and vocab.bpe on first
use; shipping them (and checking their sha256) makes gpt2lab work with no network.
"""
from __future__ import annotations

import functools
import hashlib
from importlib import resources

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

from gpt2lab.model.config import CHAT_VOCAB_SIZES, GPT2_VOCAB_SIZE

EOT_TOKEN = "<|endoftext|>"
EOT_ID = 50256
# A chat model's two turn tokens (data/chat.py: the ChatML template): the first two rows of the
# padding gpt2lab adds to GPT-2's vocabulary (50257 -> 50304), so no new embedding is needed.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
IM_START_ID, IM_END_ID = 50257, 50258
CHAT_VOCAB_SIZE = CHAT_VOCAB_SIZES["chatml"]

# The hashes tiktoken itself checks for the OpenAI GPT-2 files.
_SHA256 = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
# The GPT-2 pre-tokenisation regex (tiktoken's r50k/gpt2 pattern).
_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


def asset_path(name: str) -> str:
    """Filesystem path of a file shipped in ``gpt2lab/assets``."""
    return str(resources.files("gpt2lab") / "assets" / name)


def _checked(name: str) -> str:
    path = asset_path(name)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != _SHA256[name]:
        raise RuntimeError(
            f"{path}: sha256 {digest} does not match the GPT-2 release ({_SHA256[name]}); "
            "the installed package is damaged, reinstall gpt2lab"
        )
    return path


@functools.lru_cache(maxsize=2)
def get_tokenizer(chat: bool = False) -> tiktoken.Encoding:
    """The GPT-2 BPE (50257 tokens, ``<|endoftext|>`` = 50256), offline; ``chat``: with the two
    turn tokens as special tokens too (50259), for a chat model's text."""
    specials = {EOT_TOKEN: EOT_ID, **({IM_START: IM_START_ID, IM_END: IM_END_ID} if chat else {})}
    return tiktoken.Encoding(
        name="gpt2-chatml" if chat else "gpt2",
        pat_str=_PAT_STR,
        mergeable_ranks=_ranks(),
        special_tokens=specials,
        explicit_n_vocab=CHAT_VOCAB_SIZE if chat else GPT2_VOCAB_SIZE,
    )


@functools.lru_cache(maxsize=1)
def _ranks() -> dict:
    return data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=_checked("vocab.bpe"),
                                           encoder_json_file=_checked("encoder.json"))
