#!/usr/bin/env bash
# Everything the open issues need from the GPU machine, in stages that each fit one device call (10 min):
#   bash benchmarks/gpu_session.sh tests     # gpu tests: whole models, conv-conv kernels, runtime, library forms
#   bash benchmarks/gpu_session.sh correctness  # `tests` and `property` side by side (no timings in either)
#   K="zoo_model and -1]" bash benchmarks/gpu_session.sh models   # test_models_gpu.py's tests that K selects,
#                                            # 8 at once: analyze's launches = the graph's = the profiler's; fp32
#   bash benchmarks/gpu_session.sh bench     # benchmarks/run_all.py, all workloads, autotuned (issues 3, 4);
#                                            # NO_SPLIT_K=1 turns split-K off, NO_LIBRARY=1 the cuBLAS/cuDNN form
#   bash benchmarks/gpu_session.sh splitk    # batch-1 workloads with split-K off and on (issue 4)
#   bash benchmarks/gpu_session.sh profile   # opfuse profile --calibrate on resnet50 (issue 4)
#   bash benchmarks/gpu_session.sh property  # the >= 500-example property run (issue 7)
#   BLOCKS=1-8 bash benchmarks/gpu_session.sh blocks   # mobilenet_v2 per-block table (issue 5); then
#   BLOCKS=9-17, then BLOCKS= WHOLE=1,64 (whole model at batch 1 and 64)
#   MODELS=resnet50,gpt2 COLD_PARALLEL=4 bash benchmarks/gpu_session.sh zoo   # benchmarks/zoo.py (issue 14);
#                                            # ENABLE=norm_prologue turns on fusions that are off by default
#   bash benchmarks/gpu_session.sh check     # compile seconds without and with the compile workers, GPU tests (17)
#   WORKLOADS=gpt2:1,vit_b_16:64 bash benchmarks/gpu_session.sh cold   # cold compiles alone, opfuse against
#                                            # torch.compile (issue 17; default WORKLOADS=zoo: all 26, about 20 min:
#                                            # split them over calls), ends by COMPILE_TIMEOUT s (default 570)
#   WORKLOADS=resnet50:1 bash benchmarks/gpu_session.sh overhead   # benchmarks/call_overhead.py (issue 17, item 3)
#   WORKLOADS=gpt2:1 ENABLE=norm_prologue bash benchmarks/gpu_session.sh ab   # benchmarks/ab_pass.py: default
#                                            # config against one switch on (or WITHOUT=pass left out), one process
#   MODELS=resnet50,mobilenet_v2 bash benchmarks/gpu_session.sh onnx   # benchmarks/onnx_zoo.py (issue 18, item 4):
#                                            # opfuse from .onnx against opfuse from PyTorch, and onnxruntime;
#                                            # BATCHES=1 (default), ends by ONNX_BUDGET s (default 540)
# Results land under $OUT (the device tool's folder that comes back); each stage stops itself before the call's
# limit so that what it wrote still comes back (these variables shorten a stage so that two share one call:
# TESTS_TIMEOUT, PROPERTY_TIMEOUT, BENCH_TIMEOUT, BLOCKS_TIMEOUT, PROFILE_TIMEOUT, ONNX_TIMEOUT).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
stage=${1:?stage: tests | models | correctness | bench | splitk | profile | property | blocks | check | cold | zoo | onnx | overhead | ab}
[ -e "$OUT/gpu.txt" ] || nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv > "$OUT/gpu.txt" 2>&1
case "$stage" in
  tests)
    OPFUSE_GPU_TESTS=1 timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -m gpu -p no:cacheprovider -n "${TEST_WORKERS:-4}" \
      tests/gpu/test_models_gpu.py tests/gpu/test_runtime_gpu.py tests/gpu/test_conv_conv_gpu.py tests/gpu/test_split_k_gpu.py \
      tests/gpu/test_library_forms_gpu.py > "$OUT/gpu-tests.log" 2>&1
    tail -30 "$OUT/gpu-tests.log" ;;
  models)   # tests/gpu/test_models_gpu.py, the tests K selects (pytest -k; default: every zoo model's launch and
            # float32 tests), TEST_WORKERS at once (default 8: compiles are CPU-bound, the GPU mostly idle)
    OPFUSE_GPU_TESTS=1 timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -m gpu -p no:cacheprovider -rA \
      -n "${TEST_WORKERS:-8}" tests/gpu/test_models_gpu.py -k "${K:-zoo_model}" > "$OUT/gpu-models.log" 2>&1
    grep -E "launches: planned|passed|failed|FAILED|Error" "$OUT/gpu-models.log" | tail -60 ;;
  correctness)
    OUT="$OUT" bash "$0" tests > /dev/null 2>&1 &
    OUT="$OUT" bash "$0" property > /dev/null 2>&1 &
    wait
    tail -15 "$OUT/gpu-tests.log"; tail -15 "$OUT/property.log" ;;
  bench)
    timeout "${BENCH_TIMEOUT:-560}" python3 -m benchmarks.run_all --out "$OUT" --tune-top "${TUNE_TOP:-2}" \
      ${NO_SPLIT_K:+--no-split-k} ${NO_LIBRARY:+--no-library} \
      --workloads "${WORKLOADS:-resnet50:1,mobilenet_v2:1,bert-base:1,resnet50:64,mobilenet_v2:64,bert-base:64,resnet18:1,resnet18:64}" \
      > "$OUT/bench.log" 2>&1
    cat "$OUT/RESULTS.md" ;;
  splitk)   # batch-1 workloads: every contender with split-K off, then opfuse alone with it on (issue 4)
    mkdir -p "$OUT/split-off" "$OUT/split-on"
    workloads=${WORKLOADS:-resnet50:1,bert-base:1,mobilenet_v2:1,resnet18:1}
    timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.run_all --out "$OUT/split-off" --tune-top "${TUNE_TOP:-0}" \
      --no-split-k --workloads "$workloads" > "$OUT/split-off/bench.log" 2>&1
    timeout "${BENCH_TIMEOUT:-300}" python3 -m benchmarks.run_all --out "$OUT/split-on" --tune-top "${TUNE_TOP:-0}" \
      --contenders opfuse --workloads "$workloads" > "$OUT/split-on/bench.log" 2>&1
    cat "$OUT/split-off/RESULTS.md" "$OUT/split-on/RESULTS.md" ;;
  profile)
    timeout "${PROFILE_TIMEOUT:-560}" python3 -m opfuse.cli profile "${MODEL:-resnet50}" --calibrate \
      --tune-top "${TUNE_TOP:-4}" --json "$OUT/profile.json" --html "$OUT/profile.html" > "$OUT/profile.log" 2>&1
    tail -40 "$OUT/profile.log" ;;
  property)
    OPFUSE_GPU_TESTS=1 timeout "${PROPERTY_TIMEOUT:-560}" python3 -m pytest -q -m gpu -p no:cacheprovider -n 10 \
      tests/gpu/test_property_gpu.py > "$OUT/property.log" 2>&1
    tail -30 "$OUT/property.log" ;;
  blocks)
    timeout "${BLOCKS_TIMEOUT:-560}" python3 -m benchmarks.mobilenet_blocks --out "$OUT/blocks" --blocks "${BLOCKS:-1-8}" \
      --whole "${WHOLE:-}" --tune-top "${TUNE_TOP:-2}" > "$OUT/blocks.log" 2>&1
    tail -30 "$OUT/blocks.log" ;;
  check)    # the compile workers and the call path (issue 17): cold compile seconds of opfuse without and with
            # the workers (benchmarks/compile_time.py), then the GPU tests of the runtime and of the workers
    timeout "${COMPILE_TIMEOUT:-300}" python3 -m benchmarks.compile_time --workloads "${WORKLOADS:-resnet50:1}" \
      --workers "${WORKERS:-1,8}" --out "$OUT" > "$OUT/compile-time.log" 2>&1
    OPFUSE_GPU_TESTS=1 timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -n 2 \
      tests/gpu/test_precompile_gpu.py tests/gpu/test_runtime_gpu.py > "$OUT/gpu-tests.log" 2>&1
    cat "$OUT/compile-time.log"; tail -15 "$OUT/gpu-tests.log" ;;
  cold)     # cold compiles, one at a time, each in a process of its own: torch.compile then opfuse (issue 17)
    timeout "${COMPILE_TIMEOUT:-570}" python3 -m benchmarks.compile_time --workloads "${WORKLOADS:-zoo}" \
      --workers inductor,default --out "$OUT" > "$OUT/compile-time.log" 2>&1
    cat "$OUT/compile_time.md" ;;
  zoo)      # the model-zoo benchmark (issue 14): MODELS=a,b BATCHES=1,64 or WORKLOADS=a:1,b:64; ends by ZOO_BUDGET s
    timeout "${ZOO_TIMEOUT:-585}" python3 -m benchmarks.zoo --out "$OUT" ${MODELS:+--models "$MODELS"} \
      ${WORKLOADS:+--workloads "$WORKLOADS"} \
      --batches "${BATCHES:-1,64}" --cold-parallel "${COLD_PARALLEL:-1}" --budget "${ZOO_BUDGET:-560}" \
      --cold-timeout "${COLD_TIMEOUT:-420}" ${ENABLE:+--enable "$ENABLE"} \
      --tune-top "${TUNE_TOP:-4}" > "$OUT/zoo-run.log" 2>&1
    cat "$OUT/ZOO.md" ;;
  overhead) # the module call's time over the bare replay, step by step (issue 17, item 3)
    timeout "${OVERHEAD_TIMEOUT:-300}" python3 -m benchmarks.call_overhead --out "$OUT" ${WITH_INDUCTOR:+--with-inductor} \
      --workloads "${WORKLOADS:-resnet50:1,resnext50_32x4d:1}" > "$OUT/call-overhead.log" 2>&1
    cat "$OUT/call-overhead.log" ;;
  ab)       # A/B of one change, both compiles cold and timed in one process (ends by AB_BUDGET s)
    timeout "${AB_TIMEOUT:-585}" python3 -m benchmarks.ab_pass --out "$OUT" --workloads "${WORKLOADS:?WORKLOADS=model:batch,...}" \
      ${ENABLE:+--enable "$ENABLE"} ${WITHOUT:+--without "$WITHOUT"} --budget "${AB_BUDGET:-400}" \
      --tune-top "${TUNE_TOP:-4}" > "$OUT/ab.log" 2>&1
    cat "$OUT/ab.log" ;;
  onnx)     # ONNX against PyTorch compiles of the zoo's torchvision models (issue 18, item 4), in one process
    timeout "${ONNX_TIMEOUT:-585}" python3 -m benchmarks.onnx_zoo --out "$OUT" ${MODELS:+--models "$MODELS"} \
      --batches "${BATCHES:-1}" --budget "${ONNX_BUDGET:-540}" --tune-top "${TUNE_TOP:-4}" \
      > "$OUT/onnx-zoo.log" 2>&1
    cat "$OUT/ONNX_ZOO.md" || tail -30 "$OUT/onnx-zoo.log" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
