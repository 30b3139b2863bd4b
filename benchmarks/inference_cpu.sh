#!/usr/bin/env bash
# Inference on this CPU: gpt2lab's defaults against every explicit setting and the peers,
# one run after another on a quiet machine. Usage: benchmarks/inference_cpu.sh OUT_DIR [THREADS]
# Each run writes its JSON line to OUT_DIR/<name>.json; benchmarks/inference_table.py OUT_DIR prints
# the tables of docs/benchmarks.md. ISA=avx2 (or avx512) caps oneDNN's and ATen's instruction sets for
# the whole script, to feel a CPU without AVX512_BF16 on this one. PARTS (default "sample int8 serve")
# picks the parts; TOKENS and REPEATS (default 256 and 5) set bench sample's lengths.
set -euo pipefail
out=$1; threads=${2:-2}; rounds=${ROUNDS:-3}
mkdir -p "$out"
# (the emulation caps the kernels' instruction sets, not the machine: memory bandwidth, caches and the
# cores' clocks stay this machine's; /proc/cpuinfo still lists AVX512_BF16, the probes measure the cap)
gpt2lab=${GPT2LAB:-gpt2lab}
case "${ISA:-}" in
    avx2) export ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ;;
    avx512) export ONEDNN_MAX_CPU_ISA=AVX512_CORE MKL_ENABLE_INSTRUCTIONS=AVX512 ;;  # no VNNI/BF16: Skylake-like
esac
export GPT2LAB_PROBE=fresh   # the defaults measure their candidates now, on this machine
run() { name=$1; shift; echo "== $name: $*" >&2; "$gpt2lab" bench "$@" --threads "$threads" > "$out/$name.json"; }
S=(--new-tokens "${TOKENS:-256}" --repeats "${REPEATS:-5}" --no-cache-repeats 0)
parts=" ${PARTS:-sample int8 serve} "
# sample: the default beside the peers and the unprepared (autocast) path; then the default against
# every explicit setting, interleaved in one process; then int8 the same way, beside CTranslate2's int8
if [[ $parts == *" sample "* ]]; then
    run sample-auto sample "${S[@]}" --peer transformers,ctranslate2
    run sample-settings sample "${S[@]}" --peer none --ways sample --all-settings
fi
[[ $parts == *" int8 "* ]] && run sample-int8 sample "${S[@]}" --quantize int8 --peer ctranslate2 --ways sample,generate --all-settings
[[ $parts == *" serve "* ]] || exit 0
# serve: each setting in turn, $rounds rounds (one server at a time; a round alternates them all)
V=(--streams 1,8 --seconds 15)
for r in $(seq "$rounds"); do
    run "serve-auto-r$r" serve "${V[@]}" $([ "$r" = 1 ] && echo --peer ctranslate2)
    run "serve-int8-r$r" serve "${V[@]}" --quantize int8
    for dt in float32 bfloat16; do for k in packed plain; do
        run "serve-$dt-$k-r$r" serve "${V[@]}" --dtype "$dt" --cpu-linear "$k"
    done; done
done
