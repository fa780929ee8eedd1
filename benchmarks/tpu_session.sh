#!/usr/bin/env bash
# Issue 37's checks and measurements on the TPU machine, in one call of the device tool:
#
#   source .tpu/setup.sh && bash benchmarks/tpu_session.sh [STEP ...]
#
# STEP is any of check, decode, decode4b, prefill, moe (default: all, in that order). Each
# step runs in its own process (about 15 s to open the chip) under its own time limit, so a
# step that hangs or fails leaves the others' results; its output goes to
# benchmarks/results/tpu_<step>.log and, with the JSON, to $OUT when the device tool sets it.
set -u
cd "$(dirname "$0")"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(check decode decode4b prefill moe)
declare -A command=(
    [check]="python3 tpu_check.py"
    [decode]="python3 tpu_decode.py --shape 0.6b"
    [decode4b]="python3 tpu_decode.py --shape 4b --batch-sizes 1 16"
    [prefill]="python3 tpu_prefill.py --shape 4b --tokens 2048"
    [moe]="python3 tpu_moe.py --layers 6 --tokens 2048 --batch-sizes 1 64"
)
for step in "${steps[@]}"; do
    [ -n "${command[$step]:-}" ] || { echo "unknown step $step (one of ${!command[*]})"; exit 2; }
    echo "== $step: ${command[$step]}"
    start=$SECONDS
    timeout 240 ${command[$step]} > "results/tpu_$step.log" 2>&1
    echo "== $step: exit $? after $((SECONDS - start)) s"
    tail -n 5 "results/tpu_$step.log"
    if [ -n "${OUT:-}" ]; then cp "results/tpu_$step.log" results/tpu_*.json "$OUT/" 2>/dev/null; fi
done
