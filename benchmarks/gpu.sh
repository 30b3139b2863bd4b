#!/usr/bin/env bash
# The GPU proof, in stages that each fit one device call (10 minutes):
#
#   benchmarks/gpu.sh tests       GPU-marked tests (bf16 vs fp32, compiled vs eager, KV cache)
#   benchmarks/gpu.sh ladder16    the recipe's speed ladder + gpt2lab + transformers at B=16, T=1024
#   benchmarks/gpu.sh ladder64    the same at B=64
#   benchmarks/gpu.sh memory      largest micro-batch at T=1024 next to the planner's prediction: 124M and
#                                 350M with and without activation checkpointing; 774M and 1558M
#   benchmarks/gpu.sh big         gpt2-350m and gpt2-774m at their presets' micro-batch: tok/s, peak memory
#   benchmarks/gpu.sh train       gpt2-124m settings for 160 steps on Tiny Shakespeare + WikiText-2,
#                                 killed (-9) after the step-80 checkpoint and resumed; samples
#   benchmarks/gpu.sh eval        HellaSwag (full validation set) on that run, with examples/s; plot
#   benchmarks/gpu.sh finetune    --init-from that run: 60 steps of the finetune-shakespeare preset
#                                 (dropout 0.1), then the same with --lora-rank 8; val loss before/after
#   benchmarks/gpu.sh profile     torch.profiler over gpt2lab's step at B=64 (where the time goes)
#   (and speed, fastvs, infer, sft, ac, decode, chat: docs/benchmarks.md's table "gpu.sh stages")
#
# No install: it runs from the tree (PYTHONPATH=src) on the machine's own torch, transformers,
# tiktoken and numpy. Results (JSON, logs, the plot) go to $OUT (the device tool's folder) or
# ./gpu-results. The run dir lives in $RUN (default /tmp/gpt2lab-gpu) so `eval` finds `train`'s
# run when both stages run in one call (a fresh machine keeps nothing between calls).
# HellaSwag: copy shared/data/hellaswag/hellaswag_val_preprocessed.jsonl into .gpu/ (git-ignored
# through .git/info/exclude) and carry .gpu with the call; or set HELLASWAG=FILE.
# GPU_SH_SMOKE=1 runs every stage tiny, on the CPU, to check the script itself (tests do).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-gpu-results}
RUN=${RUN:-/tmp/gpt2lab-gpu}
HELLASWAG=${HELLASWAG:-.gpu/hellaswag_val_preprocessed.jsonl}
SMOKE=${GPU_SH_SMOKE:-0}
mkdir -p "$OUT"
# $RUN is this script's scratch space: stages replace its run directories (run, ft_*, big_*), so
# it must be a folder gpu.sh made (marked), never one of the user's
if [ -d "$RUN" ] && [ -n "$(ls -A "$RUN")" ] && [ ! -f "$RUN/.gpu-sh-scratch" ]; then
    echo "gpu.sh: RUN=$RUN exists and was not made by gpu.sh; point RUN at a new folder" >&2
    exit 2
fi
mkdir -p "$RUN" && touch "$RUN/.gpu-sh-scratch"

g() { "$PY" -m gpt2lab "$@"; }

data() {  # Tiny Shakespeare + WikiText-2 test as one prepared directory (built once per machine)
    if [ ! -f "$RUN/data/manifest.json" ] || ! grep -q '"complete": true' "$RUN/data/manifest.json"; then
        mkdir -p "$RUN/text"
        cp src/gpt2lab/assets/tinyshakespeare.txt "$RUN/text/tinyshakespeare.txt"
        cp benchmarks/data/wiki.test.raw "$RUN/text/wikitext2_test.txt"
        g prepare --source "$RUN/text" --out "$RUN/data" --val-tokens 131072 --shard-tokens 1000000
    fi
}

train_flags() {
    if [ "$SMOKE" = 1 ]; then
        echo --device cpu --n-layer 2 --n-head 2 --n-embd 64 --block-size 64 --seq-len 64 \
            --micro-batch-size 2 --total-batch-tokens 256 --compile false --dtype float32 \
            --max-steps 6 --warmup-steps 2 --ckpt-interval 2 --eval-interval 3 --eval-tokens 256 \
            --sample-interval 3 --sample-tokens 8 --hellaswag-interval 0 --progress false
    else  # gpt2-124m settings, 2^19-token steps (B=64 x 8 micro-steps), a short schedule
        echo --max-steps 160 --warmup-steps 16 --ckpt-interval 80 --eval-interval 40 \
            --eval-tokens 65536 --sample-interval 100 --hellaswag-interval 0 --progress false
    fi
}

stage_tests() {
    "$PY" -m pytest -q -m gpu tests/e2e/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
}

stage_ladder() {  # $1 = micro-batch
    data
    local flags=(--batch-size "$1" --seq-len 1024 --steps 10 --warmup 3)
    # at B=64 also the two diagnostic rungs: gpt2lab's model without the trainer, chunked loss vs F.cross_entropy
    [ "$1" = 64 ] && flags+=(--rungs fp32,tf32,bf16,compile,flash,vocab50304,fused_adamw,gpt2lab,hf,model_chunked,model_ce)
    [ "$SMOKE" = 1 ] && flags=(--size tiny --batch-size 2 --seq-len 32 --steps 1 --warmup 1 --device cpu
                               --rungs fp32,bf16,flash,hf,gpt2lab)
    g bench ladder "${flags[@]}" --data "$RUN/data" | tee "$OUT/ladder_b$1.log"
    tail -n 1 "$OUT/ladder_b$1.log" > "$OUT/ladder_b$1.json"
}

stage_memory() {  # the search, next to the planner's prediction; 124M and 350M with activation checkpointing too
    # MEMORY_CASES="SIZE:AC:MAX ..." searches those cases alone (e.g. "1558M:false:64 774M:true:256")
    local sizes=(124M 124M 350M 350M 774M 1558M) ac=(false true false true false false) max=(512 1024 256 512 64 32) c
    if [ -n "${MEMORY_CASES:-}" ]; then
        sizes=() ac=() max=()
        for c in $MEMORY_CASES; do IFS=: read -r s a m <<< "$c"; sizes+=("$s") ac+=("$a") max+=("$m"); done
    fi
    local flags=(--seq-len 1024)
    [ "$SMOKE" = 1 ] && sizes=(124M) ac=(false) max=(1) flags=(--seq-len 32 --device cpu)
    : > "$OUT/memory.jsonl"
    for i in "${!sizes[@]}"; do
        g bench memory --size "${sizes[$i]}" --max-batch "${max[$i]}" --activation-checkpointing "${ac[$i]}" \
            "${flags[@]}" | tail -n 1 >> "$OUT/memory.jsonl"
    done
    cat "$OUT/memory.jsonl"
}

stage_big() {  # gpt2-350m and gpt2-774m at their presets' (80 GB plan) micro-batch: tok/s and peak memory
    data
    : > "$OUT/big.jsonl"
    local size mb flags
    for size in 350m 774m; do
        mb=$("$PY" -c "from gpt2lab.train.settings import load_preset; print(load_preset('gpt2-$size').batch.micro_batch_size)")
        flags=(--max-steps 8 --warmup-steps 2 --total-batch-tokens $((mb * 1024 * 2)))
        [ "$SMOKE" = 1 ] && mb=1 flags=(--device cpu --max-steps 3 --warmup-steps 1 --micro-batch-size 1 --seq-len 32
                                        --total-batch-tokens 64 --n-layer 2 --n-embd 64 --n-head 2)
        rm -rf "$RUN/big_$size"
        g train --preset "gpt2-$size" --data "$RUN/data" --out "$RUN/big_$size" "${flags[@]}" --eval-interval 0 \
            --hellaswag-interval 0 --sample-interval 0 --ckpt-interval 0 --keep-checkpoints 1 --progress false \
            > "$OUT/big_$size.log" 2>&1
        "$PY" -c '
import json, statistics, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if "train_loss" in r][1:]  # the first step compiles
print(json.dumps({"preset": "gpt2-" + sys.argv[2], "micro_batch": int(sys.argv[3]), "steps": len(steps),
                  "tok_per_s_median": round(statistics.median(r["tok_per_s"] for r in steps)),
                  "peak_mem_gib": max((r.get("peak_mem_gib") or 0) for r in steps) or None}))
' "$RUN/big_$size/metrics.jsonl" "$size" "$mb" >> "$OUT/big.jsonl"
    done
    cat "$OUT/big.jsonl"
}

stage_train() {
    data
    rm -rf "$RUN/run"
    local t0 pid flags
    flags=$(train_flags)
    t0=$(date +%s)
    # shellcheck disable=SC2086
    # python itself in the background, not through g(): $! of a backgrounded shell function is a
    # subshell, and kill -9 of it left the trainer running beside the resumed one (both on the GPU,
    # both writing the run directory: the first GPU call measured the resumed run at half speed)
    "$PY" -m gpt2lab train --preset gpt2-124m --data "$RUN/data" --out "$RUN/run" $flags > "$OUT/train_first.log" 2>&1 &
    pid=$!
    local ckpt=step_000080
    [ "$SMOKE" = 1 ] && ckpt=step_000002
    while [ ! -d "$RUN/run/checkpoints/$ckpt" ] && kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    echo "killed with -9 after $ckpt ($(($(date +%s) - t0)) s)" | tee "$OUT/train_resume.log"
    # shellcheck disable=SC2086
    g train --preset gpt2-124m --data "$RUN/data" --out "$RUN/run" $flags --resume auto 2>&1 | tee -a "$OUT/train_resume.log"
    cp "$RUN/run/metrics.jsonl" "$OUT/train_metrics.jsonl"
    local dev=() n=3 tokens=64
    [ "$SMOKE" = 1 ] && dev=(--device cpu) n=1 tokens=8
    g sample --model "$RUN/run" --prompt "ROMEO:" --num-samples "$n" --max-new-tokens "$tokens" --seed 0 \
        "${dev[@]}" | tee "$OUT/samples.txt"
}

stage_eval() {
    local flags=(--data "$HELLASWAG" --batch-size 64 --dtype auto --compile)
    [ "$SMOKE" = 1 ] && flags=(--data "$HELLASWAG" --limit 8 --device cpu)
    local t0 t1
    t0=$(date +%s.%N)
    g eval hellaswag --model "$RUN/run" "${flags[@]}" | tee "$OUT/hellaswag.log"
    t1=$(date +%s.%N)
    "$PY" - "$OUT/hellaswag.log" "$t0" "$t1" > "$OUT/hellaswag.json" <<'EOF'
import json, sys
res = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
secs = float(sys.argv[3]) - float(sys.argv[2])
print(json.dumps({**res, "seconds_incl_load_and_compile": round(secs, 1), "examples_per_s": round(res["n"] / secs, 1)}))
EOF
    cat "$OUT/hellaswag.json"
    g plot "$RUN/run" --out "$OUT/curves.png" --summary | tee "$OUT/summary.md"
}

stage_finetune() {  # fine-tune the train stage's run (weights only): full, then LoRA
    data
    local flags=(--data "$RUN/data" --max-steps 60 --eval-interval 20 --eval-tokens 65536 --sample-interval 0
                 --ckpt-interval 0 --progress false)
    [ "$SMOKE" = 1 ] && flags=(--data "$RUN/data" --max-steps 2 --eval-interval 1 --eval-tokens 256 --sample-interval 0
                               --ckpt-interval 0 --progress false --device cpu --seq-len 32 --micro-batch-size 2
                               --total-batch-tokens 64)
    rm -rf "$RUN/ft_full" "$RUN/ft_lora"
    g train --preset finetune-shakespeare --init-from "$RUN/run" --out "$RUN/ft_full" "${flags[@]}" \
        2>&1 | tee "$OUT/finetune_full.log"
    g train --preset finetune-shakespeare --init-from "$RUN/run" --out "$RUN/ft_lora" "${flags[@]}" \
        --lora-rank 8 --max-lr 1e-3 --min-lr 1e-3 2>&1 | tee "$OUT/finetune_lora.log"
    cp "$RUN/ft_full/metrics.jsonl" "$OUT/finetune_full_metrics.jsonl"
    cp "$RUN/ft_lora/metrics.jsonl" "$OUT/finetune_lora_metrics.jsonl"
}

stage_profile() {
    data
    local flags=(--batch-size 64)
    [ "$SMOKE" = 1 ] && flags=(--size tiny --batch-size 2 --seq-len 32 --warmup 1 --steps 1 --device cpu)
    g bench ladder --rungs gpt2lab --steps 3 --data "$RUN/data" --profile "$OUT" "${flags[@]}" > "$OUT/profile.json"
}

short_run() {  # no evals, samples or checkpoints but the last, no progress bar
    echo --hellaswag-interval 0 --sample-interval 0 --ckpt-interval 0 --keep-checkpoints 1 --progress false
}

tiny_flags() {  # the smoke mode's model and batch (CPU)
    echo --device cpu --n-layer 2 --n-head 2 --n-embd 64 --block-size 64 --vocab-size 50304 --seq-len 64 --micro-batch-size 2 \
        --total-batch-tokens 256 --compile false --dtype float32
}

throughput() {  # metrics.jsonl [from_step]: tokens / seconds over the train lines from from_step on, as JSON
    "$PY" - "$@" <<'EOF2'
import json, sys
recs = [json.loads(x) for x in open(sys.argv[1])]
steps = [r for r in recs if "train_loss" in r and r["step"] >= int(sys.argv[2] if len(sys.argv) > 2 else 1)]
secs = sum(r["dt_ms"] for r in steps) / 1000
print(json.dumps({"steps": len(steps), "tok_per_s": round(sum(r["tokens"] - p["tokens"] for p, r in zip(steps, steps[1:]))
                  / max(secs - steps[0]["dt_ms"] / 1000, 1e-9)) if len(steps) > 1 else None,
                  "mfu": round(sum(r["mfu"] or 0 for r in steps) / len(steps), 4) if steps else None,
                  "peak_mem_gib": max((r.get("peak_mem_gib") or 0) for r in steps) if steps else None,
                  "last_train_loss": steps[-1]["train_loss"] if steps else None}))
EOF2
}

stage_speed() {  # gpt2-124m at 2^19 tokens a step: checks read back every 16 steps (auto) against every step
    data
    : > "$OUT/speed.jsonl"
    local ci flags
    for ci in 0 1; do
        flags=(--max-steps "${SPEED_STEPS:-40}" --warmup-steps 16 --eval-interval 0 $(short_run) --check-interval "$ci")
        [ "$SMOKE" = 1 ] && flags=($(tiny_flags) --max-steps 6 --warmup-steps 2 --eval-interval 0 $(short_run)
                                   --check-interval "$([ "$ci" = 0 ] && echo 4 || echo 1)")
        rm -rf "$RUN/speed_$ci"
        g train --preset gpt2-124m --data "$RUN/data" --out "$RUN/speed_$ci" "${flags[@]}" > "$OUT/speed_$ci.log" 2>&1
        cp "$RUN/speed_$ci/metrics.jsonl" "$OUT/speed_${ci}_metrics.jsonl"
        echo "{\"check_interval\": \"$ci\", \"throughput_from_step_2\": $(throughput "$RUN/speed_$ci/metrics.jsonl" 2)}" \
            | tee -a "$OUT/speed.jsonl"
    done
}

wiki() {  # Wikipedia prepared on the machine from the compressed files carried in .gpu/wiki (or WIKI=DIR)
    local src=${WIKI:-.gpu/wiki}
    if [ ! -f "$RUN/wiki/manifest.json" ] || ! grep -q '"complete": true' "$RUN/wiki/manifest.json"; then
        g prepare --source "$src" --out "$RUN/wiki" --val-tokens "${WIKI_VAL:-1048576}" --quiet
    fi
}

stage_fastvs() {  # gpt2-124m against FV_FAST (gpt2-124m-fast) on the same Wikipedia tokens and the same number of steps
    wiki
    : > "$OUT/fastvs.jsonl"
    local preset steps=${FV_STEPS:-40} flags fast=${FV_FAST:-gpt2-124m-fast}
    for preset in gpt2-124m "$fast"; do
        flags=(--max-steps "$steps" --warmup-steps $((steps / 10)) --eval-interval "${FV_EVAL:-5}"
               --eval-tokens 1048576 $(short_run))
        [ "$SMOKE" = 1 ] && flags=($(tiny_flags) --max-steps 6 --warmup-steps 1 --eval-interval 2 --eval-tokens 1024
                                   $(short_run))
        rm -rf "$RUN/fv_$preset"
        g train --preset "$preset" --data "$RUN/wiki" --out "$RUN/fv_$preset" "${flags[@]}" > "$OUT/fv_$preset.log" 2>&1
        cp "$RUN/fv_$preset/metrics.jsonl" "$OUT/fv_${preset}_metrics.jsonl"
    done
    "$PY" - "$RUN/fv_gpt2-124m/metrics.jsonl" "$RUN/fv_$fast/metrics.jsonl" "$fast" <<'EOF2' | tee -a "$OUT/fastvs.jsonl"
import json, sys
def load(path):
    recs = [json.loads(x) for x in open(path)]
    train = {r["step"]: r for r in recs if "train_loss" in r}
    evals = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    return train, evals
out = {}
(ft, fe), (mt, me) = load(sys.argv[1]), load(sys.argv[2])
target = fe[-1][1]
def secs(train, upto):  # training seconds of steps 1..upto-1 (step 0 compiles)
    return round(sum(r["dt_ms"] for s, r in train.items() if 1 <= s < upto) / 1000, 1)
def tok(train, upto):
    return max((r["tokens"] for s, r in train.items() if s < upto), default=0)
hit = next((s for s, v in me if v <= target), None)
med = lambda t: sorted(r["tok_per_s"] for s, r in t.items() if s >= 1)[len([s for s in t if s >= 1]) // 2]
out = {"faithful_final": {"step": fe[-1][0], "val_loss": target, "tokens": tok(ft, fe[-1][0]), "seconds": secs(ft, fe[-1][0])},
       "fast_final": {"step": me[-1][0], "val_loss": me[-1][1]},
       "fast_reaches_faithful_final_at": None if hit is None else
           {"step": hit, "tokens": tok(mt, hit), "seconds": secs(mt, hit)},
       "faithful_evals": fe, "fast_evals": me,
       "tok_per_s_median": {"gpt2-124m": round(med(ft)), sys.argv[3]: round(med(mt))}}
print(json.dumps(out))
EOF2
}

stage_infer() {  # inference on this device: bench sample (auto dtype, transformers beside) and bench serve
    local dev=(--device cuda) s=(--new-tokens 256 --repeats 3 --no-cache-repeats 0) v=(--streams 1,8,64 --seconds 10)
    [ "$SMOKE" = 1 ] && dev=(--device cpu --n-layer 2 --n-head 2 --n-embd 64 --block-size 64) \
        s=(--new-tokens 8 --repeats 1 --no-cache-repeats 0) v=(--streams 1,2 --seconds 1 --new-tokens 8)
    export GPT2LAB_PROBE=fresh GPT2LAB_CACHE="$RUN/cache"
    g bench sample "${dev[@]}" "${s[@]}" --peer transformers > "$OUT/infer_sample.json"
    tail -c 3000 "$OUT/infer_sample.json"; echo
    g bench sample "${dev[@]}" "${s[@]}" --peer none --ways sample --all-settings > "$OUT/infer_settings.json"
    tail -c 3000 "$OUT/infer_settings.json"; echo
    g bench serve "${dev[@]}" "${v[@]}" > "$OUT/infer_serve.json"
    tail -c 3000 "$OUT/infer_serve.json"; echo
}

stage_sft() {  # fine-tuning from the speed stage's run: full, LoRA rank 8, and on conversations (chat-gpt2)
    data
    local base="$RUN/speed_0" flags=(--max-steps 20 --eval-interval 10 --eval-tokens 262144 $(short_run))
    [ "$SMOKE" = 1 ] && flags=($(tiny_flags) --max-steps 2 --eval-interval 1 --eval-tokens 256 $(short_run))
    [ -f "$RUN/chat/manifest.json" ] || g prepare --source chitchat --out "$RUN/chat" --quiet
    : > "$OUT/sft.jsonl"
    rm -rf "$RUN/ft_full" "$RUN/ft_lora" "$RUN/ft_chat"
    g train --preset finetune-shakespeare --init-from "$base" --data "$RUN/data" --out "$RUN/ft_full" "${flags[@]}" \
        > "$OUT/ft_full.log" 2>&1
    g train --preset finetune-shakespeare --init-from "$base" --data "$RUN/data" --out "$RUN/ft_lora" "${flags[@]}" \
        --lora-rank 8 --max-lr 1e-3 --min-lr 1e-3 > "$OUT/ft_lora.log" 2>&1
    g train --preset chat-gpt2 --init-from "$base" --data "$RUN/chat" --out "$RUN/ft_chat" "${flags[@]}" \
        > "$OUT/ft_chat.log" 2>&1
    local run
    for run in ft_full ft_lora ft_chat; do
        cp "$RUN/$run/metrics.jsonl" "$OUT/${run}_metrics.jsonl"
        "$PY" - "$RUN/$run/metrics.jsonl" "$run" <<'EOF2' | tee -a "$OUT/sft.jsonl"
import json, sys
recs = [json.loads(x) for x in open(sys.argv[1])]
steps = [r for r in recs if "train_loss" in r and r["step"] >= 1]
print(json.dumps({"run": sys.argv[2], "val_loss": [(r["step"], round(r["val_loss"], 4)) for r in recs if "val_loss" in r],
                  "tok_per_s_median": round(sorted(r["tok_per_s"] for r in steps)[len(steps) // 2]) if steps else None,
                  "peak_mem_gib": max((r.get("peak_mem_gib") or 0) for r in steps) if steps else None}))
EOF2
    done
}

stage_decode() {  # a one-row decode step per held copy, one change at a time, profiles (benchmarks/decode_stall.py)
    local a=(--holds 4 --steps 50)
    [ "$SMOKE" = 1 ] && a=(--holds 1 --steps 2 --tiny)
    "$PY" benchmarks/decode_stall.py "${a[@]}" > "$OUT/decode.jsonl" 2> "$OUT/decode_profile.txt"
    # PyTorch reads DISABLE_ADDMM_CUDA_LT once a process: bias-fused addmm without cuBLASLt, in a process of its own
    DISABLE_ADDMM_CUDA_LT=1 "$PY" benchmarks/decode_stall.py "${a[@]}" --variant DISABLE_ADDMM_CUDA_LT=1 \
        >> "$OUT/decode.jsonl" 2>> "$OUT/decode_profile.txt"
    cat "$OUT/decode.jsonl"
}

stage_chat() {  # chat-gpt2 on the bundled conversations from CHAT_INIT, else a randomly initialised GPT-2 (no hub)
    local init=${CHAT_INIT:-$RUN/gpt2_random} flags=()
    [ "$SMOKE" = 1 ] && flags=($(tiny_flags) --max-steps 2 --eval-interval 1 --eval-tokens 256 $(short_run))
    if [ -z "${CHAT_INIT:-}" ] && [ ! -f "$init/config.json" ]; then
        local shape="GPT2Config()"
        [ "$SMOKE" = 1 ] && shape="GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=64)"
        "$PY" -c "import sys, torch; from transformers import GPT2Config, GPT2LMHeadModel; torch.manual_seed(0)
GPT2LMHeadModel($shape).save_pretrained(sys.argv[1])" "$init"
    fi
    [ -f "$RUN/chat/manifest.json" ] || g prepare --source chitchat --out "$RUN/chat" --quiet
    rm -rf "$RUN/chat_run"
    g train --preset chat-gpt2 --init-from "$init" --data "$RUN/chat" --out "$RUN/chat_run" --progress false \
        "${flags[@]}" > "$OUT/chat.log" 2>&1
    cp "$RUN/chat_run/metrics.jsonl" "$OUT/chat_metrics.jsonl"
    tail -n 12 "$OUT/chat.log"
}

stage_ac() {  # activation checkpointing's cost at 124M: tok/s and peak memory with it on and off
    data
    : > "$OUT/ac.jsonl"
    local ac flags
    for ac in false true; do
        flags=(--max-steps 10 --warmup-steps 2 --eval-interval 0 $(short_run) --activation-checkpointing "$ac")
        [ "$SMOKE" = 1 ] && flags=($(tiny_flags) --max-steps 3 --warmup-steps 1 --eval-interval 0 $(short_run)
                                   --activation-checkpointing "$ac")
        rm -rf "$RUN/ac_$ac"
        g train --preset gpt2-124m --data "$RUN/data" --out "$RUN/ac_$ac" "${flags[@]}" > "$OUT/ac_$ac.log" 2>&1
        echo "{\"activation_checkpointing\": $ac, \"throughput_from_step_2\": $(throughput "$RUN/ac_$ac/metrics.jsonl" 2)}" \
            | tee -a "$OUT/ac.jsonl"
    done
}

[ $# -gt 0 ] || set -- tests ladder16 ladder64 memory big train eval finetune
for stage in "$@"; do
    echo "== $stage ($(date -u +%H:%M:%S))"
    case "$stage" in
        tests) stage_tests ;;
        ladder16) stage_ladder 16 ;;
        ladder64) stage_ladder 64 ;;
        memory) stage_memory ;;
        big) stage_big ;;
        train) stage_train ;;
        eval) stage_eval ;;
        finetune) stage_finetune ;;
        profile) stage_profile ;;
        speed) stage_speed ;;
        fastvs) stage_fastvs ;;
        infer) stage_infer ;;
        sft) stage_sft ;;
        ac) stage_ac ;;
        decode) stage_decode ;;
        chat) stage_chat ;;
        *) echo "unknown stage $stage; stages: tests ladder16 ladder64 memory big train eval finetune profile" \
                "speed fastvs infer sft ac decode chat" >&2; exit 2 ;;
    esac
done
