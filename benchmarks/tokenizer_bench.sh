#!/usr/bin/env bash
# "Your own tokenizer" (docs/benchmarks.md), one step after another, single-threaded:
#   benchmarks/tokenizer_bench.sh WORK RESULTS [SEED ...]
# WORK: where the data, tokenizers, shards and runs go (made here); RESULTS: where the figures go
# (bytes per token as JSON, `gpt2lab compare` of each pair, each run's evaluations in summary.json,
# the final models on the whole held-out text in heldout.jsonl). Per corpus (the standard
# library's code, the German Debian Reference: benchmarks/tokenizer_data.py): a byte-level BPE of
# VOCAB tokens trained on the training files, bytes per token on the held-out files against GPT-2's,
# the data prepared with each tokenizer (the held-out files are the val split, exactly), and per
# seed two models of the same shape but the embedding/head, trained for the same steps of the same
# tokens, compared in bits per byte on the held-out text (during training, and the final models on
# all of it with `gpt2lab eval loss`).
set -euo pipefail
work=$1; results=$2; shift 2
seeds=("${@:-1337}")
vocab=${VOCAB:-8192}
steps=${STEPS:-300}
gpt2lab=${GPT2LAB:-gpt2lab}
python=${PYTHON:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$results"
[ -d "$work/data" ] || $python "$here/tokenizer_data.py" "$work/data" > "$results/data.json"
for corpus in code german; do
    tok="$work/tok/$corpus-$vocab"
    [ -d "$tok" ] || /usr/bin/time -f "tokenizer train $corpus: wall %e s, max RSS %M KB" \
        $gpt2lab tokenizer train --source "$work/data/$corpus/1_train.jsonl" --vocab-size "$vocab" --out "$tok" --quiet
    $gpt2lab tokenizer eval --tokenizer "$tok" --source "$work/data/$corpus/0_heldout.jsonl" --json \
        > "$results/$corpus-bytes-per-token.json"
    for v in ${SWEEP:-4096 8192 16384}; do  # bytes per token on the held-out files against the vocabulary size
        [ -d "$work/tok/$corpus-$v" ] || $gpt2lab tokenizer train --source "$work/data/$corpus/1_train.jsonl" \
            --vocab-size "$v" --out "$work/tok/$corpus-$v" --quiet > /dev/null
        $gpt2lab tokenizer eval --tokenizer "$work/tok/$corpus-$v" --source "$work/data/$corpus/0_heldout.jsonl" --json \
            | $python -c "import json,sys; r=json.load(sys.stdin)['sources'][0]; print(json.dumps({'corpus': sys.argv[1], 'vocab': int(sys.argv[2]), **r}))" \
            "$corpus" "$v"
    done > "$results/$corpus-vocab-sweep.jsonl"
    for which in gpt2 own; do
        key=$([ $which = gpt2 ] && echo gpt2 || echo ours)
        # the held-out files come first: val is exactly their tokens and one <|endoftext|> each
        val=$($python -c "import json,sys; r=json.load(open(sys.argv[1]))['sources'][0]; print(r['tokenizers']['$key']['tokens'] + r['documents'])" \
              "$results/$corpus-bytes-per-token.json")
        [ -d "$work/prep/$corpus-$which" ] || $gpt2lab prepare --source "$work/data/$corpus/*.jsonl" \
            --out "$work/prep/$corpus-$which" --val-tokens "$val" --quiet $([ $which = own ] && echo --tokenizer "$tok")
    done
    for seed in "${seeds[@]}"; do
        runs=()
        for which in gpt2 own; do
            run="$work/runs/$corpus-$which-s$seed"
            # wiki-cpu's recipe and shape (4 layers, 4 heads, 192 wide, T=128), 1,024 tokens a step; every
            # evaluation takes the whole held-out text (in whole micro-batches)
            [ -e "$run/metrics.jsonl" ] || /usr/bin/time -f "$corpus $which seed $seed: wall %e s" \
                $gpt2lab train --preset wiki-cpu --data "$work/prep/$corpus-$which" --out "$run" --seed "$seed" \
                --micro-batch-size 8 --total-batch-tokens 1024 --max-steps "$steps" --eval-interval $((steps / 2)) \
                --eval-tokens 100000000 --ckpt-interval 0 --dtype float32 --compile false --progress false \
                --log-interval 50
            runs+=("$run")
        done
        $gpt2lab compare "${runs[@]}" --metric val_bpb > "$results/$corpus-s$seed-compare.md"
    done
done
# The final models on the whole held-out text (one sequence of 128 at a time: all of it but the last
# <128 tokens), as `gpt2lab eval loss` reports it: loss per token and bits per byte
: > "$results/heldout.jsonl"
for run in "$work"/runs/*; do
    name=$(basename "$run"); corpus=${name%%-*}; which=$(echo "$name" | cut -d- -f2)
    data="$work/prep/$corpus-$which"
    val=$($python -c "import json,sys; print(json.load(open(sys.argv[1]))['splits']['val']['tokens'])" "$data/manifest.json")
    $gpt2lab eval loss --model "$run" --data "$data" --tokens $(( (val - 1) / 128 * 128 )) --batch-size 1 --seq-len 128 \
        --dtype float32 --device cpu 2>/dev/null | tail -1 | \
        $python -c "import json,sys; r=json.load(sys.stdin); r.pop('inference'); print(json.dumps({'run': sys.argv[1], **r}))" \
        "$name" >> "$results/heldout.jsonl"
done
$python - "$work/runs" "$results/summary.json" <<'EOF'
import json, os, sys
runs, out = sys.argv[1], sys.argv[2]
summary = {}
for name in sorted(os.listdir(runs)):
    recs = [json.loads(l) for l in open(os.path.join(runs, name, "metrics.jsonl")) if l.strip()]
    info = json.load(open(os.path.join(runs, name, "run_info.json")))
    model = json.load(open(os.path.join(runs, name, "config.json")))["model"]
    val = [r for r in recs if "val_bpb" in r]
    train = [r for r in recs if "train_loss" in r]
    summary[name] = {"params": info["params"], "vocab_size": model["vocab_size"], "tokenizer": model["tokenizer"],
                     "val": [{k: r[k] for k in ("step", "val_loss", "val_bpb")} for r in val],
                     "tokens": train[-1]["tokens"], "train_seconds": round(sum(r["dt_ms"] for r in train) / 1000, 1),
                     "flops_per_token": info["flops_per_token"]}
json.dump(summary, open(out, "w"), indent=1)
print(json.dumps({k: (v["val"][-1], v["train_seconds"]) for k, v in summary.items()}, indent=1))
EOF
