#!/usr/bin/env bash
# Several gpu.sh topics at once on a multi-GPU machine, one topic per GPU, each in its own copy of
# the tree (a sweep rewrites the tile table another topic may be reading) and its own $OUT/<gpu>/.
#   benchmarks/gpu_many.sh TOPIC0 [TOPIC1 ...]   # topic i runs on GPU i; A+B runs A then B there
# Device time counts the machine held, not the GPUs busy: independent topics that each take
# minutes cost one call this way instead of one each.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/so2serve_out}
gpu=0
for topic in "$@"; do
  tree=/tmp/so2serve_gpu$gpu
  rm -rf "$tree" && mkdir -p "$tree" "$out/$gpu"
  # Links (.whl, .gpu_data) are copied as the folders they point to.
  cp -rL . "$tree" 2>/dev/null
  (
    cd "$tree" || exit
    for one in ${topic//+/ }; do
      CUDA_VISIBLE_DEVICES=$gpu OUT="$out/$gpu" SO2_SITE=/tmp/site$gpu benchmarks/gpu.sh "$one" > /dev/null 2>&1
    done
  ) &
  gpu=$((gpu + 1))
done
wait
