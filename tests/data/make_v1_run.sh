#!/usr/bin/env bash
# Makes tests/data/v1_run: a run directory in the format gpt2lab wrote before the model config
# was nested (flat n_layer/n_embd/... keys in config.json). Run at commit 929f8b8; kept so the
# fixture can be remade by checking out that commit and running this script from the repo root:
#   git checkout 929f8b8 && PYTHONPATH=src PY=.venv/bin/python tests/data/make_v1_run.sh
# The run is tiny (2 layers, n_embd 4, 3 steps) so that the weights and AdamW moments of the
# 50304-row embedding stay under 3 MB. The tests re-create its data with the same
# prepare("tinyshakespeare") (deterministic), so the shards are not committed.
set -euo pipefail
PY=${PY:-python}
repo=$(pwd)
work=$(mktemp -d)
cd "$work"
OMP_NUM_THREADS=1 $PY -m gpt2lab prepare --source tinyshakespeare --out data/tinyshakespeare --quiet
OMP_NUM_THREADS=1 $PY -m gpt2lab train --preset shakespeare-cpu --data data/tinyshakespeare --out v1_run \
  --n-layer 2 --n-head 2 --n-embd 4 --block-size 16 --vocab-size 50304 --seq-len 16 --micro-batch-size 2 \
  --total-batch-tokens 64 --max-steps 3 --warmup-steps 1 --max-lr 1e-2 --min-lr 1e-3 --seed 7 \
  --dtype float32 --compile false --device cpu --eval-interval 0 --hellaswag-interval 0 \
  --sample-interval 0 --ckpt-interval 0 --log-interval 1 --progress false --keep-cpu-memory false
rm -f v1_run/plot.png  # optional (needs matplotlib); not part of the format
rm -rf "$repo/tests/data/v1_run"
cp -r v1_run "$repo/tests/data/v1_run"
sha256sum data/tinyshakespeare/* > "$repo/tests/data/v1_run.data.sha256"
cd "$repo" && rm -rf "$work"
