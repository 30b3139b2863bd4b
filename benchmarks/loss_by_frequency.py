"""A run's validation loss split by how often each target token was among the run's training tokens:

    PYTHONPATH=src python benchmarks/loss_by_frequency.py RUN DATA TOKENS [--val-tokens 65536]

RUN: a run directory (its last checkpoint's model); DATA: the shards it trained on (made by
``gpt2lab prepare``); TOKENS: how many training tokens it read (steps x tokens a step: the run read
the train split from its start, one process). Prints the loss and the share of the mean of each
frequency band, the probability mass the model puts on tokens it never trained on, and the mean
loss after mixing a uniform prior into its output, p' = (1 - e) p + e / V: how much a better
guess at unseen tokens alone could gain. Reads only; writes nothing.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F

from gpt2lab.data.shards import list_shards, open_shard, read_manifest
from gpt2lab.weights.load import from_pretrained

BANDS = ((0, 0), (1, 2), (3, 10), (11, 100), (101, None))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run")
    p.add_argument("data")
    p.add_argument("tokens", type=int)
    p.add_argument("--val-tokens", type=int, default=65536)
    p.add_argument("--seq-len", type=int, default=128)
    a = p.parse_args()
    train = np.concatenate([open_shard(path) for path in list_shards(a.data, "train")])
    val = open_shard(list_shards(a.data, "val")[0])
    model = from_pretrained(a.run).float().eval()
    vocab = read_manifest(a.data)["vocab_size"]
    seen = np.bincount(train[: a.tokens].astype(np.int64), minlength=vocab)
    tokens = torch.tensor(val[: a.val_tokens + 1].astype(np.int64))
    x, y = tokens[:-1].view(-1, a.seq_len), tokens[1:].view(-1, a.seq_len)
    unseen = torch.tensor(seen == 0)
    losses, mass = [], []
    with torch.no_grad():
        for i in range(0, x.size(0), 16):
            logp = F.log_softmax(model(x[i : i + 16])[0].float()[..., :vocab], -1)
            losses.append(-logp.gather(-1, y[i : i + 16, :, None])[..., 0].flatten())
            mass.append(logp[..., unseen].exp().sum(-1).flatten())
    loss, counts = torch.cat(losses).double(), seen[y.flatten().numpy()]
    print(f"{a.run}: mean loss {loss.mean():.4f}; mass on never-trained tokens {torch.cat(mass).mean():.4f}")
    for lo, hi in BANDS:
        band = (counts >= lo) & (counts <= (hi if hi is not None else counts.max()))
        mean, share = loss[torch.tensor(band)].mean(), float(loss[torch.tensor(band)].sum() / len(loss))
        name = f"{lo}-{hi}" if hi is not None else f">={lo}"
        print(
            f"  trained on {name:>6} times: {band.mean():6.1%} of val tokens, loss {mean:.3f}, {share:.3f} of the mean"
        )
    for e in (0.003, 0.01, 0.03, 0.1):
        mixed = -torch.log((1 - e) * torch.exp(-loss) + e / vocab)
        print(f"  uniform prior mixed in at {e}: mean {mixed.mean():.4f}")


if __name__ == "__main__":
    main()
