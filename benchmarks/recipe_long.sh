#!/usr/bin/env bash
# The longer-horizon recipe comparison, one run after another on a quiet machine:
#   benchmarks/recipe_long.sh DATA OUT [SEED ...]
# DATA: shards with held-out articles as val (gpt2lab prepare --val-split documents); OUT: where the
# run directories go (made by gpt2lab; nothing else is written). Per seed: the faithful preset at
# its 720 steps, then the modern one; then `gpt2lab compare` of the pair (tokens and training
# seconds to the faithful run's final val loss). RECIPES="preset:extra flags ..." overrides the
# pair, e.g. RECIPES="wiki-cpu-long-fast:--value-embeds=1 wiki-cpu-long-fast:--unet-skips=true" for an
# ablation (a recipe's flags separated by commas: "wiki-cpu-long-fast:--value-embeds=1,--eval-interval=20").
set -euo pipefail
data=$1; out=$2; shift 2
seeds=("${@:-1337}")
base=${BASE:-wiki-cpu-long}
recipes=(${RECIPES:-wiki-cpu-long-fast:})
gpt2lab=${GPT2LAB:-gpt2lab}
for seed in "${seeds[@]}"; do
    if [ ! -e "$out/$base-s$seed/metrics.jsonl" ] || [ -n "${RERUN_BASE:-}" ]; then
        /usr/bin/time -f "wall %e s" $gpt2lab train --preset "$base" --data "$data" --seed "$seed" \
            --out "$out/$base-s$seed" --progress false
    fi
    runs=()
    for r in "${recipes[@]}"; do
        preset=${r%%:*}; flags=${r#*:}; flags=${flags//,/ }; tag=$(echo "$flags" | tr -c 'A-Za-z0-9.=\n' '_' | sed 's/^_*//')
        dir="$out/$preset${tag:+-$tag}-s$seed"
        /usr/bin/time -f "wall %e s" $gpt2lab train --preset "$preset" --data "$data" --seed "$seed" \
            --out "$dir" --progress false $flags
        runs+=("$dir")
    done
    $gpt2lab compare "$out/$base-s$seed" "${runs[@]}"
done
