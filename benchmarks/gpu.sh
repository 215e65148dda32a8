#!/usr/bin/env bash
# One GPU call per topic: correctness tests with the `gpu` marker, then the benchmarks, with all
# raw results (benchmarks/results/*.json, tuned tables, logs) packed into $OUT/results.tgz.
#   benchmarks/gpu.sh tests-kernels|tests-rest|tests-some|triton|triton-rest|triton-sets|sweep-triton|sweep-triton-rest|sweep-triton-exact|sweep-triton-rotate|triton-grid|overlay-ab|resweep-bar|alpha-grad|nonfinite|cold-start|devices|sweep-rest|sweep-exact|grid-stack-fast|sweep-rotate-a|sweep-rotate-b|sweep-rotate-narrow|f16corr|stack-gaps|bar-rotate|grid-rotate-fused|presets-fast|verify|recheck|matrix|compiled|compiled-medium|compiled-12k|grid-rotate|grid-rotate-rest|grid-stack|replay|closing|replay-memo|smallstep|kernels|kernels-grid|bar|proof|graph|step|model|service|train|md|final|switch [extra args]
# Expects ./.gpu_data (copy of ../shared: data/, reference/) and optionally ./.whl (wheels for
# packages the GPU image lacks: benchmarks/gpu_wheels.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
topic=${1:?topic}; shift || true
out=${OUT:-/tmp/so2serve_out}; mkdir -p "$out" benchmarks/results
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
site=${SO2_SITE:-/tmp/site}  # one per concurrent gpu.sh (benchmarks/gpu_many.sh)
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl && export PYTHONPATH=$site:$PWD
else
  export PYTHONPATH=$PWD
fi
# Another Triton than the image's (benchmarks/pack_triton.sh packs it into .gpu_triton/): unpacked
# once per machine, then first on the path. A call that does not carry it again (the box stays
# warm for a few seconds only) names the unpacked copy in SO2_TRITON_SITE.
# A pack without its CUDA tools (IMAGE_TOOLS.sha256) gets the image's Triton's. ptxas must be the
# same build (it compiles every kernel); nvdisasm and cuobjdump only disassemble, and the image's
# differ from 3.7.1's (H200 box, 2026-12-02), so they are taken as they are.
tsite=${SO2_TRITON_SITE:-}
if ls .gpu_triton/triton-*.tar.xz >/dev/null 2>&1; then
  tsite=${tsite:-/tmp/triton_site}
  if [ ! -d "$tsite/triton" ]; then
    mkdir -p "$tsite" && tar xJf .gpu_triton/triton-*.tar.xz -C "$tsite"
    tools=$tsite/triton/backends/nvidia/bin
    if [ -f "$tools/IMAGE_TOOLS.sha256" ]; then
      image_tools=$(python3 -c 'import os, triton; print(os.path.dirname(triton.__file__))')/backends/nvidia/bin
      for tool in ptxas nvdisasm cuobjdump; do cp "$image_tools/$tool" "$tools/"; done
      (cd "$tools" && grep ' ptxas$' IMAGE_TOOLS.sha256 | sha256sum --quiet -c -) || {
        echo "gpu.sh: the image's ptxas differs from the packed Triton's: pack it with --keep-tools" >&2
        rm -rf "$tsite"; exit 1
      }
    fi
  fi
fi
[ -n "$tsite" ] && export PYTHONPATH=$tsite:$PYTHONPATH
log="$out/$topic.log"
# Each step is time-boxed (STEP_S seconds) and results are packed after every step, so a call
# that hits the device's wall-clock limit still returns what finished.
pack() {
  tar czf "$out/results.tgz" --exclude='*.pt' --exclude='*.safetensors' \
    benchmarks/results so2kernels/tables runs 2>/dev/null || true
}
run() {
  echo "+ $*" | tee -a "$log"
  timeout --signal=INT "${STEP_S:-300}" "$@" 2>&1 | tee -a "$log"
  pack
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$log"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$log"
case "$topic" in
  tests-kernels)  # every kernel gpu test (run beside tests-rest on a second GPU: gpu_many.sh)
    STEP_S=${TESTS_S:-280} run python3 -m pytest -q -m gpu tests/kernels
    ;;
  triton)  # under the packed Triton (.gpu_triton/): every kernel gpu test, then the bars of both fused ops (~7 min)
    STEP_S=${TESTS_S:-300} run python3 -m pytest -q -m gpu tests/kernels
    STEP_S=150 run python3 benchmarks/kernels_mixing_stack.py --cases bar --no-compile --profile
    STEP_S=90 run python3 benchmarks/kernels_rotate_mix.py --edges 1051392 --cases 128,2,1,1 --no-compile
    # the fused stack again on the image's own Triton, same machine, for the side-by-side
    PYTHONPATH=${PYTHONPATH#"$tsite":} STEP_S=120 run python3 benchmarks/kernels_mixing_stack.py \
      --cases bar --no-compile --profile --only fused_exact fused_fast
    ;;
  alpha-grad)  # after the alpha gradient moved into the final residual GEMMs: the stack's gpu tests, its bar (both tiers), the kernel sets re-recorded and checked (~8 min)
    STEP_S=150 run python3 -m pytest -q -m gpu tests/kernels/test_mixing_stack.py
    STEP_S=170 run python3 benchmarks/kernels_mixing_stack.py --cases bar --no-compile --profile
    STEP_S=${COLD_S:-150} run python3 benchmarks/cold_start.py --scenarios record --precisions fp32 fp16x3 --workloads water-192 --repeats 1
    STEP_S=120 run python3 -m pytest -q -m gpu tests/service/test_warm_up.py -k "cover_the_warm_up or local_calculator_compiles"
    ;;
  triton-sets)  # under the packed Triton: its kernel sets recorded, their cover checked, the stack's gpu tests (~6 min)
    STEP_S=${COLD_S:-150} run python3 benchmarks/cold_start.py --scenarios record --precisions fp32 fp16x3 --workloads water-192 --repeats 1
    STEP_S=120 run python3 -m pytest -q -m gpu tests/service/test_warm_up.py -k "cover_the_warm_up or local_calculator_compiles"
    STEP_S=150 run python3 -m pytest -q -m gpu tests/kernels/test_mixing_stack.py
    ;;
  sweep-triton)  # under the packed Triton: the bar shape's fp16x3 tiles swept into its table overlay, then the bar's fast tier with it (~7 min)
    STEP_S=500 run python3 benchmarks/kernels_mixing_stack.py --cases bar --no-compile --profile \
      --only fused_fast --sweep --sweep-cases bar --sweep-precisions fp16x3
    ;;
  sweep-triton-rest)  # under the packed Triton: fp16x3 tiles of the grid shapes its overlay lacks (Cf 64 / lmax 3; ~2.5 min per shape) swept into it (~8.5 min)
    STEP_S=540 run python3 benchmarks/kernels_mixing_stack.py --cases bar --no-compile --only fused_fast \
      --sweep --sweep-cases all --sweep-precisions fp16x3 --sweep-skip-tuned
    ;;
  sweep-triton-exact)  # under the packed Triton: the exact tier's tiles of every grid shape swept into its overlay (~1.3 min per shape), then the bar's both tiers on the tables in effect (~8 min; re-record the kernel sets after it: triton-sets)
    STEP_S=390 run python3 benchmarks/kernels_mixing_stack.py --cases bar --no-compile --sweep \
      --sweep-cases all --sweep-precisions ieee --sweep-skip-tuned
    sleep 15  # the sweep leaves the board at its power cap
    STEP_S=100 run python3 benchmarks/kernels_mixing_stack.py --cases bar --no-compile --profile \
      --only fused_exact fused_fast
    ;;
  sweep-triton-rotate)  # under the packed Triton: the rotate-mix table's model/bar key (C_wide 128, lmax 2, rank 1) swept into a scratch table beside the shipped one, then the rotate_mix bar under both Tritons (~6 min)
    STEP_S=${SWEEP_KEY_S:-260} run python3 benchmarks/sweep_tiles.py --keys 128,2,2,1 \
      --tables benchmarks/results/rotate_table_triton-3.7
    STEP_S=90 run python3 benchmarks/kernels_rotate_mix.py --edges 1051392 --cases 128,2,1,1 --compare-variants
    PYTHONPATH=${PYTHONPATH#"$tsite":} STEP_S=90 run python3 benchmarks/kernels_rotate_mix.py \
      --edges 1051392 --cases 128,2,1,1 --compare-variants
    ;;
  triton-grid)  # under the packed Triton, after sweep-triton-rest: the stack grid's fused tiers, then the image's Triton's fast tier beside it, the kernel sets re-recorded and their cover checked, the fast tier's realistic-size tests (~9 min)
    STEP_S=200 run python3 benchmarks/kernels_mixing_stack.py --cases all --no-compile --only fused_exact fused_fast
    PYTHONPATH=${PYTHONPATH#"$tsite":} STEP_S=100 run python3 benchmarks/kernels_mixing_stack.py \
      --cases all --no-compile --only fused_fast
    STEP_S=${COLD_S:-130} run python3 benchmarks/cold_start.py --scenarios record --precisions fp32 fp16x3 --workloads water-192 --repeats 1
    STEP_S=100 run python3 -m pytest -q -m gpu tests/service/test_warm_up.py -k "cover_the_warm_up or local_calculator_compiles"
    STEP_S=90 run python3 -m pytest -q -m gpu tests/kernels/test_mixing_stack.py -k "realistic and fp16x3"
    ;;
  resweep-bar)  # the bar shape's fp16x3 tiles swept again under the running Triton (base table or its release's overlay), then the fast tier on the tables before and after, alternating (~5 min)
    before=/tmp/stack_tiles_before.json
    python3 -c 'import json, sys, torch; from so2kernels import mixing_stack_kernels as k
json.dump({"meta": {}, "configs": k._load_table(torch.cuda.get_device_name())}, open(sys.argv[1], "w"))' "$before"
    STEP_S=300 run python3 benchmarks/kernels_mixing_stack.py --cases bar --no-compile --profile \
      --only fused_fast --sweep --sweep-cases bar --sweep-precisions fp16x3
    sleep 20  # the sweep leaves the board at its power cap; the pairs below start rested
    for pass in 1 2; do
      SO2_STACK_TABLE=$before STEP_S=90 run python3 benchmarks/kernels_mixing_stack.py --cases bar \
        --no-compile --profile --only fused_fast
      STEP_S=90 run python3 benchmarks/kernels_mixing_stack.py --cases bar --no-compile --profile \
        --only fused_fast
    done
    ;;
  overlay-ab)  # under the packed Triton: the bar's fast tier on the base table alone and with the release's overlay, alternating, then the stack's gpu tests (~6 min)
    base=so2kernels/tables/mixing_stack_nvidia_h200.json
    for pass in 1 2; do
      SO2_STACK_TABLE=$base STEP_S=90 run python3 benchmarks/kernels_mixing_stack.py --cases bar \
        --no-compile --profile --only fused_fast
      STEP_S=90 run python3 benchmarks/kernels_mixing_stack.py --cases bar --no-compile --profile \
        --only fused_fast
    done
    STEP_S=150 run python3 -m pytest -q -m gpu tests/kernels/test_mixing_stack.py
    ;;
  triton-rest)  # under the packed Triton: the graph, model, service, client and training gpu tests (carry .gpu_triton, .whl and .gpu_data: ~58 MiB with the tree)
    STEP_S=${TESTS_S:-540} run python3 -m pytest -q -m gpu tests/graph tests/model tests/service tests/clients tests/training
    ;;
  nonfinite)  # experiment: where the fp16x3 forward wrote NaN under the packed Triton 3.7.1 (final-layer epilogue on column halves, replaced 2026-12-02), per fwd tile and epilogue variant; then the image's Triton (~5 min)
    STEP_S=240 run python3 benchmarks/stack_nonfinite_probe.py --variants halves barrier explicit
    PYTHONPATH=${PYTHONPATH#"$tsite":} STEP_S=120 run python3 benchmarks/stack_nonfinite_probe.py \
      --shipped-only --variants halves barrier explicit
    ;;
  tests-some)  # chosen gpu tests: benchmarks/gpu.sh tests-some PATH_OR_NODEID...
    STEP_S=${TESTS_S:-280} run python3 -m pytest -q -m gpu "$@"
    ;;
  tests-rest)  # every other gpu test (graph, model, service, clients, training)
    STEP_S=${TESTS_S:-280} run python3 -m pytest -q -m gpu tests/graph tests/model tests/service tests/clients tests/training
    ;;
  cpu-step)  # the shipped model's CPU step on the GPU host's cores: time and peak memory per edge-chunk size, and the host-memory estimate against the peak (~5 min)
    STEP_S=${CPU_S:-540} run python3 benchmarks/cpu_step.py "$@"
    ;;
  cold-start)  # a fresh server process: imports, model load, warm-up, first requests; --scenarios record ... records the kernel sets
    STEP_S=${COLD_S:-500} run python3 benchmarks/cold_start.py "$@"
    ;;
  devices)  # every visible GPU behind one queue: the engine, then so2serve screen over HTTP and in process
    STEP_S=${DEVICES_S:-300} run python3 benchmarks/devices.py "$@"
    ;;
  kernels)
    run python3 -m pytest -q -m "gpu and not slow" tests/kernels -x
    run python3 benchmarks/kernels_rotate_mix.py --edges 1051392 --cases 128,2,1,1 128,3,1,1 --compare-variants
    run python3 benchmarks/kernels_aggregate.py
    STEP_S=400 run python3 benchmarks/kernels_mixing_stack.py --cases bar --sweep --sweep-cases served
    ;;
  verify)  # GPU correctness of everything changed since the last GPU run, then the model bar
    STEP_S=200 run python3 -m pytest -q -m gpu tests/kernels
    STEP_S=120 run python3 -m pytest -q -m gpu tests/model/test_golden_systems.py tests/model/test_captured.py tests/model/test_fast_tier.py tests/graph/test_sync_free.py
    STEP_S=110 run python3 benchmarks/model.py --cases bar:192,12288 --paths fused fused-fp16x3 --profile --repeats 5 --no-agreement
    STEP_S=70 run python3 benchmarks/model.py --cases bar:73728 --paths fused-fp16x3 --memory lean --no-agreement --repeats 2
    ;;
  recheck)  # after CPU-only changes to graph/model: their gpu tests, the stack's, then 192-12k steps
    STEP_S=230 run python3 -m pytest -q -m gpu tests/graph tests/model
    STEP_S=100 run python3 -m pytest -q -m gpu tests/kernels/test_mixing_stack.py
    STEP_S=150 run python3 benchmarks/model.py --cases bar:192,1536,12288 --paths fused fused-fp16x3 --profile --repeats 5 --no-agreement "$@"
    ;;
  matrix)  # issue #4's size matrix left after 2026-11-30: the compile-abort probe, bar at 98k + largest, medium exact at 98k, the medium reference series
    STEP_S=280 run python3 benchmarks/compile_probe.py --config tiny --sizes 192 1536 --variants baseline single-thread-backward --timeout-s 135
    STEP_S=130 run python3 benchmarks/model.py --cases bar:98304 --paths fused-fp16x3 fused --memory auto --no-agreement --repeats 2 --find-max --max-atoms 200000
    STEP_S=60 run python3 benchmarks/model.py --cases medium:98304 --paths fused --memory auto --no-agreement --repeats 2
    STEP_S=110 run python3 benchmarks/model.py --cases medium:192,1536,12288,98304 --paths reference --memory auto --no-agreement --repeats 2
    ;;
  compiled)  # what the seventh session left of issue #4 (~10 min): the replay's host time, medium exact at 98k + largest, the compiled small series
    STEP_S=150 run python3 benchmarks/replay_host_probe.py --steps 300
    STEP_S=200 run python3 benchmarks/model.py --cases medium:98304 --paths fused --memory auto --no-agreement --repeats 2 --find-max --max-atoms 400000
    STEP_S=300 run python3 benchmarks/model.py --cases small:192,1536,12288 --paths compiled --compile-configs small --compile-max-atoms 12288 --memory auto --no-agreement --repeats 2
    ;;
  compiled-medium)  # the compiled medium series, then the aggregate op's benchmark (~8 min)
    STEP_S=290 run python3 benchmarks/model.py --cases medium:192,1536,12288 --paths compiled --compile-configs medium --compile-max-atoms 12288 --memory auto --no-agreement --repeats 2
    STEP_S=200 run python3 benchmarks/kernels.py --ops aggregate --per-op-timeout 190
    ;;
  compiled-12k)  # the compiled medium model at 12,288 atoms (its own compile, ~3 min)
    STEP_S=230 run python3 benchmarks/model.py --cases medium:12288 --paths compiled --compile-configs medium --compile-max-atoms 12288 --memory auto --no-agreement --repeats 2
    ;;
  grid-rotate)  # issue #2's rotate_mix grid at E = 1M with torch.compile, one GPU's worth (~9 min)
    STEP_S=560 run python3 benchmarks/kernels.py --ops rotate_mix --per-op-timeout 550
    ;;
  grid-rotate-rest)  # the rotate_mix grid cases whose compiled reference hit the recompile limit on 2026-11-30 (~2.5 min)
    STEP_S=200 run python3 benchmarks/kernels_rotate_mix.py --edges 1000000 --cases 128,3,1,1 128,3,1,2 128,3,2,1 128,3,2,2 256,2,2,1 256,2,2,2 256,3,2,1 256,3,2,2
    ;;
  sweep-rotate-a|sweep-rotate-b)  # the rotate-mix table's keys cut or partly swept on 2026-11-30, swept in full (run a and b side by side: gpu_many.sh)
    keys=("128,3,2,2 256,2,2,2 256,3,2,1" "256,3,2,2 128,3,2,1"); k=${keys[$([ "$topic" = sweep-rotate-a ] && echo 0 || echo 1)]}
    for key in $k; do STEP_S=${SWEEP_KEY_S:-180} run python3 benchmarks/sweep_tiles.py --keys "$key"; done
    ;;
  sweep-rotate-narrow)  # the rotate-mix table at narrow widths (C_wide 32 and 64), where the edge-block backward is meant to win (~8 min)
    for key in 32,2,1,1 64,2,1,1 64,3,1,1; do STEP_S=${SWEEP_KEY_S:-170} run python3 benchmarks/sweep_tiles.py --keys "$key"; done
    ;;
  f16corr)  # experiment: the fast tier's correction products accumulated in fp16, against shipped, alternating processes (~3 min)
    for v in shipped f16corr shipped f16corr; do STEP_S=100 run python3 benchmarks/f16_correction_probe.py --variant $v; done
    ;;
  stack-gaps)  # experiment: the fast tier's bar step, kernels' sum vs timed step (idle gaps, timing method), both tiers (~2 min)
    STEP_S=150 run python3 benchmarks/stack_gap_probe.py --precision fp16x3
    STEP_S=150 run python3 benchmarks/stack_gap_probe.py --precision ieee
    ;;
  bar-rotate)  # DeePMD's rotate_mix bar (E = 1,051,392, C_wide 128, lmax 2, F 1, rank 1) with every backward schedule (~1 min)
    STEP_S=90 run python3 benchmarks/kernels_rotate_mix.py --edges 1051392 --cases 128,2,1,1 --compare-variants
    ;;
  grid-rotate-fused)  # the rotate_mix grid at E = 1M with the shipped table, fused and eager only (~3 min)
    STEP_S=280 run python3 benchmarks/kernels.py --ops rotate_mix --no-compile
    ;;
  grid-stack)  # issue #2's mixing-stack grid at E = 1M, both tiers, with torch.compile (~9 min)
    STEP_S=560 run python3 benchmarks/kernels.py --ops mixing_stack --per-op-timeout 550
    ;;
  replay)  # the sync-free replay (search inside the CUDA graph) and the descriptor-fed stack: their gpu tests, then the 192/1,536-atom steps
    STEP_S=110 run python3 -m pytest -q -m gpu tests/model/test_captured.py tests/graph/test_sync_free.py tests/graph/test_pair_search.py tests/model/test_fast_tier.py
    STEP_S=130 run python3 -m pytest -q -m "gpu and not slow" tests/kernels/test_mixing_stack.py
    STEP_S=100 run python3 benchmarks/model.py --cases bar:192,1536 --paths fused-fp16x3 fused --repeats 5 --no-agreement --profile --profile-max-atoms 2000
    ;;
  sweep-rest)  # fp16x3 tiles for the grid shapes without table entries (Cf 64 / lmax 3; ~2.5 min per shape), then the grid without compile
    STEP_S=480 run python3 benchmarks/kernels_mixing_stack.py --cases bar --no-compile --sweep --sweep-cases all --sweep-precisions fp16x3 --sweep-skip-tuned
    STEP_S=100 run python3 -m pytest -q -m gpu tests/kernels/test_mixing_stack.py -k "realistic and fp16x3"
    ;;
  sweep-exact)  # exact-tier tiles for every grid shape (~1.3 min per shape; the table is written after each)
    STEP_S=470 run python3 benchmarks/kernels_mixing_stack.py --cases bar --no-compile --sweep --sweep-cases all --sweep-precisions ieee --sweep-skip-tuned
    ;;
  grid-stack-fast)  # the mixing-stack grid at E = 1M without torch.compile (both tiers, eager), after a tile sweep (~5 min)
    STEP_S=400 run python3 benchmarks/kernels_mixing_stack.py --cases all --no-compile
    ;;
  presets-fast)  # small and medium model steps, both tiers, after a tile sweep (~4 min)
    STEP_S=330 run python3 benchmarks/model.py --cases small:192,1536,12288 medium:192,1536,12288 --paths fused-fp16x3 fused --no-agreement --repeats 3
    ;;
  replay-memo)  # the search-table memo of replayed steps: its gpu tests, the host-time probe (memo vs rebuilt), then the service (~6 min)
    STEP_S=150 run python3 -m pytest -q -m gpu tests/model/test_captured.py tests/graph/test_pair_search.py tests/graph/test_sync_free.py
    STEP_S=120 run python3 benchmarks/replay_host_probe.py --steps 300
    STEP_S=170 run python3 benchmarks/service.py --device cuda --quick --phases in_process engine http throughput
    ;;
  closing)  # last call of a session (~5.5 min): the service (paired overhead, steady-window crowd), then the gpu tests of the replay, the stack's capture, golden systems and served checkpoints
    STEP_S=170 run python3 benchmarks/service.py --device cuda --quick --phases in_process engine http throughput
    STEP_S=150 run python3 -m pytest -q -m gpu tests/model/test_captured.py tests/kernels/test_mixing_stack.py::test_gpu_capture_reads_cached_weight_operands tests/model/test_golden_systems.py tests/service/test_deepmd_served_gpu.py
    ;;
  smallstep)  # after graph/glue/service changes: their gpu tests, neighbour-search crossover, 192-12k steps, service
    STEP_S=150 run python3 -m pytest -q -m gpu tests/graph/test_pair_search.py tests/graph/test_neighbors.py tests/graph/test_sync_free.py tests/kernels/test_aggregate.py tests/kernels/test_outer_sum.py tests/kernels/test_mixing_stack.py tests/model/test_captured.py tests/model/test_golden_systems.py tests/model/test_fast_tier.py
    STEP_S=35 run python3 benchmarks/graph.py --sizes 1 2 4 --neighbors-only --repeats 5
    STEP_S=160 run python3 benchmarks/model.py --cases bar:192,1536,12288 --paths fused-fp16x3 fused --repeats 5 --no-agreement --profile --profile-max-atoms 2000
    STEP_S=120 run python3 benchmarks/service.py --device cuda --quick --profile-server
    ;;
  final)  # end of session: model + service gpu tests, service bench, bar model, preset matrix
    STEP_S=100 run python3 -m pytest -q -m gpu tests/model/test_golden_systems.py tests/model/test_captured.py tests/model/test_fast_tier.py tests/graph/test_sync_free.py
    STEP_S=130 run python3 benchmarks/service.py --device cuda --quick
    STEP_S=110 run python3 benchmarks/model.py --cases bar:192,1536,12288 --paths fused fused-fp16x3 --profile --repeats 5 --agreement-sizes 192 12288 --fp64-sizes 192
    STEP_S=150 run python3 benchmarks/model.py --cases small:192,1536,12288,98304 medium:192,1536,12288 --paths fused fused-fp16x3 reference --memory auto --no-agreement --repeats 3
    ;;
  switch)  # the server's interpreter switch interval at 0.5 ms, then the kernel grid without compile
    STEP_S=120 run python3 benchmarks/service.py --device cuda --quick --switch-interval-ms 0.5 --sizes 192 1536 --clients 1 64
    STEP_S=330 run python3 benchmarks/kernels.py --no-compile --per-op-timeout 165 --ops rotate_mix mixing_stack
    ;;
  proof)  # one call: aggregate op, fast-tier stack sweep + bar, model step both tiers + lean, service
    STEP_S=80 run python3 -m pytest -q -m gpu tests/kernels/test_aggregate.py tests/kernels/test_outer_sum.py -x
    STEP_S=60 run python3 benchmarks/kernels_aggregate.py --no-compile
    STEP_S=150 run python3 benchmarks/kernels_mixing_stack.py --cases bar --no-compile --sweep --sweep-cases bar --sweep-precisions fp16x3
    STEP_S=100 run python3 benchmarks/model.py --cases bar:192,12288 --paths fused fused-fp16x3 --profile --repeats 5 --agreement-sizes 192 12288 --fp64-sizes 192 --fp64-configs
    STEP_S=70 run python3 benchmarks/model.py --cases bar:98304 --paths fused-fp16x3 --memory lean --no-agreement --repeats 2
    STEP_S=120 run python3 benchmarks/service.py --device cuda --quick
    ;;
  bar)  # the DeePMD bars in one call: stack + rotate_mix at E = 1.05M, model step with both tiers
    STEP_S=200 run python3 benchmarks/kernels_mixing_stack.py --cases bar
    STEP_S=100 run python3 benchmarks/kernels_rotate_mix.py --edges 1051392 --cases 128,2,1,1 --compare-variants
    STEP_S=240 run python3 benchmarks/model.py --cases bar:192,12288 --paths fused fused-fp16x3 --memory fast lean --profile --no-agreement --repeats 5 "$@"
    ;;
  kernels-grid)  # issue #2's grid at E = 1M: every op, fused (both tiers) vs eager vs compiled
    STEP_S=560 run python3 benchmarks/kernels.py --per-op-timeout 270 "$@"
    ;;
  graph)
    run python3 -m pytest -q -m gpu tests/graph
    run python3 benchmarks/graph.py "$@"
    ;;
  step)  # sync audit, CUDA-graph replay vs eager, small-size step timings
    run python3 benchmarks/sync_audit.py
    run python3 -m pytest -q -m gpu tests/model/test_captured.py tests/model/test_fast_tier.py tests/graph/test_sync_free.py
    run python3 benchmarks/model.py --cases bar:192,1536,12288 small:192,1536,12288 --paths fused fused-eager fused-fp16x3 --no-agreement --repeats 10 "$@"
    ;;
  model)
    run python3 -m pytest -q -m gpu tests/model
    run python3 benchmarks/model.py "$@"
    ;;
  service)
    run python3 -m pytest -q -m gpu tests/service tests/clients
    run python3 benchmarks/service.py "$@"
    ;;
  train)
    # A warm machine keeps the last call's run (runs/ is not in the checkout): a fresh run is
    # refused there, and the copies below would publish the old model.
    rm -rf runs/water_small
    STEP_S=${TRAIN_S:-560} run python3 -m service.cli train configs/water_small.toml "$@"
    cp runs/water_small/model.safetensors "$out/default.safetensors" 2>/dev/null
    cp runs/water_small/log.csv "$out/train_log.csv" 2>/dev/null
    run python3 -m service.cli eval default .gpu_data/data/water --json "$out/eval.json" --plot "$out/eval.png"
    ;;
  md)
    run python3 -m service.training.md_check default .gpu_data/data/water/data_0 --steps 20000 --max-wall-s "${MD_S:-240}" --out runs/md_check
    cp runs/md_check/* "$out/" 2>/dev/null
    ;;
  *) echo "unknown topic $topic"; exit 2 ;;
esac
