#!/usr/bin/env bash
# Issues 37 and 38's checks and measurements on the TPU machine, in one call of the device tool:
#
#   source .tpu/setup.sh && bash benchmarks/tpu_session.sh [STEP ...]
#
# STEP is any of check, decode, decode4b, prefill, moe, int8, context, context16k, load8b,
# first, matvec, moetiles, peer, serve (default: the first five, in that order). Each step runs in its own
# process (about 15 s to open the chip) under its own time limit, so a step that hangs or
# fails leaves the others' results; its log and the JSON it writes go to $OUT when the device
# tool sets it (else to results/). `first` (the first `eqx-models generate` of a
# Qwen3-0.6B-shaped checkpoint in a fresh process) and `serve` want the Qwen tokenizer fixture beside
# stories260K: `cp -r ../shared/fixtures/qwen-tokenizer .tpu/fixtures/` after prepare.sh;
# `peer` the peer's code in .peer/llama3 (see tpu_peer.py), carried with .tpu.
set -u
cd "$(dirname "$0")"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(check decode decode4b prefill moe)
declare -A limit=([check]=300 [decode]=140 [decode4b]=130 [prefill]=80 [moe]=110 [int8]=150 [context]=120 [context16k]=200 [load8b]=420 [first]=200 [matvec]=150 [moetiles]=300 [peer]=200 [serve]=500)
declare -A command=(
    [check]="python3 tpu_check.py"
    [decode]="python3 tpu_decode.py --shape 0.6b"
    [decode4b]="python3 tpu_decode.py --shape 4b --batch-sizes 1 16 64"
    [int8]="python3 tpu_decode.py --shape 4b --batch-sizes 1 64 --quantize int8"
    [context]="python3 tpu_decode.py --shape 4b --batch-sizes 8 --prompt 3968"
    [context16k]="python3 tpu_decode.py --shape 4b --batch-sizes 8 --prompt 16256 --quantize int8 --cache-dtype int8"
    [load8b]="python3 tpu_load.py --shape 8b --quantize int8"
    [first]="python3 tpu_load.py --shape 0.6b --write-only && python3 first_generate.py --model /tmp/eqx-random-qwen3-0.6b --out \$EQX_TPU_RESULTS/first_generate_tpu_qwen3_0.6b.json"
    [matvec]="python3 tpu_matvec.py"
    [peer]="python3 tpu_peer.py"
    [moetiles]="python3 tpu_moe.py --experts blocks --batch-sizes 1 && python3 tpu_moe.py --row-tile 256 --batch-sizes && python3 tpu_moe.py --row-tile 512 --weight-tiles 256 128 --batch-sizes"
    [prefill]="python3 tpu_prefill.py --shape 4b --tokens 2048"
    [moe]="python3 tpu_moe.py --layers 6 --tokens 2048 --batch-sizes 1 64"
    [serve]="python3 tpu_serve.py --shape 0.6b --concurrency 1 64 256"
)
# The TPU machine's copy of the checkout is read-only where tracked: results go to $OUT there.
results=${OUT:-$PWD/results}
export EQX_TPU_RESULTS=$results
[ -d ../.peer/llama3 ] && export PEER_LLAMA3=${PEER_LLAMA3:-$(cd ../.peer/llama3 && pwd)}
[ -d ../.tpu/fixtures ] && export EQX_MODELS_FIXTURES=${EQX_MODELS_FIXTURES:-$(cd ../.tpu/fixtures && pwd)}
for step in "${steps[@]}"; do
    [ -n "${command[$step]:-}" ] || { echo "unknown step $step (one of ${!command[*]})"; exit 2; }
    echo "== $step: ${command[$step]}"
    start=$SECONDS
    timeout "${limit[$step]}" bash -c "${command[$step]}" > "$results/tpu_$step.log" 2>&1
    echo "== $step: exit $? after $((SECONDS - start)) s"
    tail -n 5 "$results/tpu_$step.log"
done
