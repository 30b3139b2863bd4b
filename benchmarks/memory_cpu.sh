#!/usr/bin/env bash
# Peak memory per rank on CPU next to gpt2lab.train.memplan's prediction (docs/benchmarks.md):
# tiny and 124M, one process and 2 ranks (gloo) under DDP and FSDP, activation checkpointing
# off and on. Each configuration is a fresh process (peak RSS never goes down), 3 steps of
# --accum 2 micro-steps on random tokens; one JSON line per configuration.
#
#   benchmarks/memory_cpu.sh                 both sizes
#   benchmarks/memory_cpu.sh tiny            one size ("tiny 64 4": size, seq_len, micro-batch)
#
# Results go to $OUT (default benchmarks/results/memory_cpu.jsonl). fp32: what gpt2lab trains in
# on a CPU without native bf16; set DTYPE=bfloat16 on one that has it.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results/memory_cpu.jsonl}
DTYPE=${DTYPE:-float32}
declare -A SHAPE=([tiny]="64 4" [124M]="256 4")
[ $# -gt 0 ] || set -- tiny 124M
for size in "$@"; do
    [ -n "${SHAPE[$size]:-}" ] || { echo "unknown size $size; sizes: ${!SHAPE[*]}" >&2; exit 2; }
    read -r T B <<< "${SHAPE[$size]}"
    for launch in single ddp fsdp; do
        for ac in false true; do
            flags=(bench memory --size "$size" --seq-len "$T" --micro-batch "$B" --dtype "$DTYPE" --device cpu
                   --activation-checkpointing "$ac" --steps 3)
            if [ "$launch" = single ]; then
                timeout 900 "$PY" -m gpt2lab "${flags[@]}"
            else
                timeout 900 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m gpt2lab "${flags[@]}" --strategy "$launch"
            fi | tail -n 1 | tee -a "$OUT"
        done
    done
done
