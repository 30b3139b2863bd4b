#!/usr/bin/env bash
# Each lever alone on a preset, at several seeds, JOBS runs at a time of one thread each:
#   benchmarks/recipe_ablation.sh DATA OUT [SEED ...]
# DATA: shards whose val split was never tuned on; OUT: where the run directories go (made by gpt2lab;
# nothing else is written). PRESET (wiki-cpu-long-fast) is the baseline row; LEVERS="name:flags ..."
# the others (a lever's flags separated by commas); EVAL (88) the eval interval (the final loss is the
# row's figure). Then one `gpt2lab compare` of every run of a seed against its baseline.
set -euo pipefail
data=$1; out=$2; shift 2
seeds=("${@:-1337}")
preset=${PRESET:-wiki-cpu-long-fast}
levers=(base: ${LEVERS:-mtp:--mtp-heads=1 ramp:--seq-len-ramp-steps=64,--seq-len-start=32 polar:--muon-orth=polar_express cautious:--cautious-wd=true})
gpt2lab=${GPT2LAB:-gpt2lab}
jobs=${JOBS:-2}
mkdir -p "$out"
runs=()
for seed in "${seeds[@]}"; do
    for l in "${levers[@]}"; do runs+=("${l%%:*} $seed ${l#*:}"); done
done
n=0
for r in "${runs[@]}"; do
    read -r name seed flags <<< "$r"
    dir="$out/$name-s$seed"
    if [ ! -e "$dir/metrics.jsonl" ]; then
        OMP_NUM_THREADS=1 $gpt2lab train --preset "$preset" --data "$data" --seed "$seed" --out "$dir" \
            --eval-interval "${EVAL:-88}" --progress false ${flags//,/ } > "$out/$name-s$seed.log" 2>&1 &
        n=$((n + 1))
        if (( n % jobs == 0 )); then wait; fi
    fi
done
wait
for seed in "${seeds[@]}"; do
    others=()
    for l in "${levers[@]:1}"; do others+=("$out/${l%%:*}-s$seed"); done
    $gpt2lab compare "$out/base-s$seed" "${others[@]}"
done
