#!/bin/bash
# A lent GPU machine's time, from the checkout's root there. Beforehand, here: `cp -r ../shared/gpu
# gpu-peers` (PEERS, a folder .gitignore leaves out) and `gpu-peers/fetch-peers.sh gpu-peers/peers`
# (DeepSpeed, its wheels and libaio); the call carries gpu-peers and names the commit (the copy of
# the tree there has no .git):
#
#   OFFLOAD_COMMIT=<short hash> bash benchmarks/gpu_session.sh [PEERS]    (timeout_s 600)
#
# The one call of issue 49, at most 9.5 minutes (BUDGET, seconds: 570), everything time-boxed
# (benchmarks/gpu_session.py says what runs when, and why in that order):
#   - at second 0, in the background: DeepSpeed installed into /tmp/site, then its op builds
#     (cpu_adam, fused_adam); in the foreground the project's install;
#   - the host's own time per unit per step, alone (bench_pipeline --measure-host);
#   - in parallel: the whole suite on CUDA over pytest-xdist workers, the CUDA tests under the
#     stream sanitizer, offload estimate's placement for the big model and bench_pipeline's
#     prediction of the steps below;
#   - alone, one after another: bench_gpu at 1.35B, bf16, clipping 1.0 (plain PyTorch, offload
#     none/cpu and cpu/cpu at the engine's own schedule, DeepSpeed ZeRO-Offload and SuperOffload),
#     the 13B step (7B on a GPU under 120 GiB) in the recommended placement, ZenFlow if time is left.
# What comes back in $OUT (three files, whatever stops the call): records.tar (one record per
# part: untar into benchmarks/results/, then python benchmarks/make_results.py), logs.tar.gz (every
# part's log, the JUnit reports) and summary.txt (the counts, the failing tests, each run's s/step
# beside its peers and the replay's prediction, the losses), which is also the output's tail.
#
#   bash benchmarks/gpu_session.sh --dry               the same plan here on the CPU: tiny sizes, no
#                                                      DeepSpeed (its parts skipped, with the reason),
#                                                      about a minute; tests/test_gpu_session.py runs it
#   bash benchmarks/gpu_session.sh lease PEERS         the compact-state lease of 2026-11-27, about 9
#                                                      minutes: bench_adam's compact kernels against fp32
#                                                      on the host's cores, bench_step cpu/nvme and
#                                                      nvme/nvme with io.background_depth 0 and 2, the
#                                                      CUDA and compact-state tests (those on CUDA under
#                                                      the stream sanitizer), then nvme/nvme with fp32,
#                                                      bf16 and int8 state if time is left
# The phases peers, tests, bench and 7b of earlier leases are parts of the default call now.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
started=$(date +%s)
budget=${BUDGET:-570}
out=${OUT:-/tmp/gpu-session/out}
work=${WORK:-/tmp/gpu-session/work}
python=${PYTHON:-python3}
mkdir -p "$out" "$work/logs"

# DeepSpeed from PEERS/peers (fetch-peers.sh's folder) into /tmp/site, built against this
# machine's torch without its ops (DS_BUILD_OPS=0), as ../shared/gpu/setup-on-device.sh does
install_deepspeed() {
  local dir=$1 tmp
  [ -f /tmp/site/.ok ] && return 0
  "$python" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$dir"/whl/*.whl || return 1
  tmp=$(mktemp -d) && tar xzf "$dir"/whl/deepspeed-*.tar.gz -C "$tmp" || return 1
  (cd "$tmp"/deepspeed-* && DS_BUILD_OPS=0 PYTHONPATH=/tmp/site "$python" -m pip install -q --no-index --no-deps \
    --no-build-isolation --target /tmp/site .) || return 1
  touch /tmp/site/.ok
}

# the ops its runs JIT-build on first use (about a minute each), built now, side by side
build_deepspeed_ops() {
  local builders=(CPUAdamBuilder FusedAdamBuilder) pids=() builder
  for builder in "${builders[@]}"; do
    "$python" -c "from deepspeed.ops.op_builder import $builder as B; B().load(); print('$builder built')" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || return 1; done
}

environment() {
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-} TORCH_CUDA_ARCH_LIST=9.0 # the image's 9.0a breaks DeepSpeed's JIT builder
  local aio=$1/peers/aio/root
  if [ -d "$aio" ]; then
    export CPATH=$aio/usr/include LIBRARY_PATH=$aio/usr/lib/x86_64-linux-gnu LD_LIBRARY_PATH=$aio/usr/lib/x86_64-linux-gnu
  fi
}

machine_info() {
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    "$python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1
    echo "commit ${OFFLOAD_COMMIT:-unknown (set OFFLOAD_COMMIT)}"
  } >"$work/logs/machine.log"
}

default_call() {
  local peers=$1 status=$work/deepspeed.status ds=()
  environment "$peers"
  rm -f "$status"
  if [ -d "$peers/peers/whl" ]; then
    ( (install_deepspeed "$peers/peers" && build_deepspeed_ops) >"$work/logs/deepspeed.log" 2>&1
      echo $? >"$status") &
    ds=(--deepspeed-status "$status")
  else
    echo "no $peers/peers/whl: DeepSpeed's runs will be skipped" | tee "$work/logs/deepspeed.log"
  fi
  "$python" -m pip install -q --no-build-isolation --no-deps -e . >"$work/logs/setup.log" 2>&1 || {
    tail -20 "$work/logs/setup.log"
    exit 1
  }
  machine_info
  echo "set up in $(($(date +%s) - started)) s"
  "$python" benchmarks/gpu_session.py --deadline $((started + budget)) --started "$started" --out "$out" --work "$work" \
    --python "$python" "${ds[@]}"
}

# part SECONDS LOG COMMAND... (lease): COMMAND with its output in $work/logs/LOG, stopped after
# SECONDS or at the lease's deadline (DEADLINE seconds from the start), whichever comes first
part() {
  local cap=$1 log=$work/logs/$2
  shift 2
  local left=$((DEADLINE - SECONDS - 5))
  ((left < cap)) && cap=$left
  if ((cap < 20)); then
    echo "skipped: $* (no time left)" >"$log"
    return
  fi
  timeout "$cap" "$@" >"$log" 2>&1
  echo "exit $? after $SECONDS s of the phase: $*" >>"$log"
}

lease() {
  local peers=${1:?usage: gpu_session.sh lease PEERS}
  DEADLINE=${DEADLINE:-570}
  local ds=()
  [ -d "$peers/peers/whl" ] && ds=("$peers/peers")
  bash "$peers/setup-on-device.sh" "${ds[@]}" >"$work/logs/setup.log" 2>&1 || {
    tail -20 "$work/logs/setup.log"
    exit 1
  }
  environment "$peers"
  machine_info
  export OFFLOAD_RESULTS_DIR=$work/results
  # (9 rounds: with 5, the fp32 kernel at 100M measured 4.68 Gparam/s on 2026-11-27 against 5.65 a
  # day before with the same code, 0.91x DeepSpeed's CPUAdam where it had been ahead)
  part 200 adam.log "$python" benchmarks/bench_adam.py --sizes 30e6 100e6 --repeats 9 --bnb-rounds 0
  # io.background_depth on this machine's drive (it reads and writes at once): the state's
  # write-back beside the step's urgent reads (2 places of 8), against urgent-first (0)
  for depth in 0 2; do
    check=$([ $depth = 0 ] && echo on || echo off) # the drive's rates and overlap, once
    part 80 "io_background_$depth.log" "$python" benchmarks/bench_step.py --runs cpu/nvme,nvme/nvme --precision bf16 \
      --batch 8 --seq 1024 --steps 4 --plain-once --disk-check $check --io "threads=8,queue_depth=16,background_depth=$depth"
  done
  part 110 cuda.log "$python" -m pytest tests/test_cuda.py tests/test_compact_state.py tests/test_compact_kernels.py -q -p no:cacheprovider
  # the stream sanitizer on the tests that run on CUDA only (the host-only kernel tests did not
  # finish under it in 120 s on 2026-11-27)
  TORCH_CUDA_SANITIZER=1 part 120 sanitizer.log "$python" -m pytest tests/test_cuda.py tests/test_compact_state.py \
    -q -p no:cacheprovider
  part 100 compact_step.log "$python" benchmarks/bench_step.py --runs nvme/nvme --state-precisions fp32,bf16,int8 \
    --precision bf16 --batch 8 --seq 1024 --steps 4 --plain-once
  mkdir -p "$work/results"
  tar cf "$out/records.tar" -C "$work/results" . && tar czf "$out/logs.tar.gz" -C "$work/logs" .
  tail -n 30 "$work/logs/adam.log"
  grep -h -E "^swap path|^offload" "$work"/logs/io_background_*.log
  tail -n 4 "$work/logs/cuda.log" "$work/logs/sanitizer.log"
  tail -n 20 "$work/logs/compact_step.log"
}

case "${1:-}" in
--dry)
  exec "$python" benchmarks/gpu_session.py --dry --deadline $((started + budget)) --started "$started" --out "$out" \
    --work "$work" --python "$python"
  ;;
lease)
  lease "${2:-}"
  ;;
peers | tests | bench | 7b)
  echo "the $1 phase is part of the default call now: bash benchmarks/gpu_session.sh PEERS" >&2
  exit 2
  ;;
*)
  default_call "${1:-gpu-peers}"
  ;;
esac
