#!/usr/bin/env bash
# The GPU check (issue 8): every `gpu`-marked test, then the benchmarks on CUDA, in one go.
#
# Made for the lent H200 machine (Python 3.12, torch 2.11 + triton, lightning, transformers; no
# hydra-core, wandb, datasets or flash-attn, no network). Runs from the repository root with
# PYTHONPATH=. and, where the package is not installed yet, an editable install without its
# dependencies (offline, no build isolation), so the package imports from anywhere: the GPU tests
# and the benchmarks import
# none of hydra / wandb / datasets. pytest, when missing, is installed offline from outputs/gpu_wheels
# (fill it here with `make gpu-wheels`). Carry outputs/gpu_wheels and outputs/tiny_target to the
# device machine (the tiny target is rebuilt in about a minute if absent).
#
# Results go to $OUT (the device tool's folder) or outputs/gpu_check: env.txt, gpu_tests.log,
# gpu_tests.xml, one <benchmark>.log/.json per benchmark, summary.txt. On a CPU-only machine it
# runs the same steps: the GPU tests report as skipped with their reason and the benchmarks run
# at toy size on CPU (a dry run of the script itself).
#
#   scripts/gpu_check.sh            # or: make gpu-check
#   GPU_CHECK_BUDGET_S=420 scripts/gpu_check.sh   # stop starting benchmarks after that many s
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-outputs/gpu_check}"
mkdir -p "$OUT_DIR"
# The project venv where there is one (this CPU machine), else the machine's python (device).
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY="${PYTHON:-$(command -v python3 || command -v python)}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-480}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
START=$(date +%s)
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

# ---------------------------------------------------------------- environment
if ! "$PY" -c "import torch" 2>/dev/null; then
  note "gpu_check: $PY cannot import torch; set PYTHON=/path/to/python"
  exit 1
fi
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  "$PY" - <<'EOF'
import importlib.util, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__,
      "| cuda", torch.version.cuda, "| available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
for mod in ("triton", "lightning", "transformers", "safetensors", "pytest", "flash_attn",
            "yaml", "hydra", "wandb", "datasets", "matplotlib"):
    spec = importlib.util.find_spec(mod)
    version = ""
    if spec is not None:
        try:
            version = getattr(__import__(mod), "__version__", "")
        except Exception as err:  # importable spec but broken import: say so
            version = f"import fails: {err!r}"[:120]
    print(f"{mod:13s}", "present " + version if spec else "MISSING")
EOF
} > "$OUT_DIR/env.txt" 2>&1
cat "$OUT_DIR/env.txt"
if ! "$PY" -c "import dflash_lab.export" 2>/dev/null; then
  "$PY" -m pip install --no-deps --no-build-isolation --no-index -e . \
    > "$OUT_DIR/pip_editable.log" 2>&1 \
    || note "dflash_lab.export: not importable and the offline editable install failed" \
            "(pip_editable.log); only code that does not import the exporter runs"
fi
ON_CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")
if [ "$ON_CUDA" = 1 ]; then DEVICE=cuda; SIZE=paper; else DEVICE=cpu; SIZE=toy; fi
note "gpu_check: device=$DEVICE size=$SIZE out=$OUT_DIR"
if ! "$PY" -c "import flash_attn" 2>/dev/null; then
  note "flash-attn: NOT installed here (no network to fetch it); the real-flash tests skip and" \
       "the flash wiring is covered on CPU by tests/attention/test_backends.py with a pure-torch" \
       "emulation"
fi

# ---------------------------------------------------------------- gpu-marked tests
if ! "$PY" -c "import pytest" 2>/dev/null; then
  if ls outputs/gpu_wheels/pytest-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install --no-index --find-links outputs/gpu_wheels pytest \
      > "$OUT_DIR/pip_pytest.log" 2>&1 || note "pytest: offline install failed (pip_pytest.log)"
  else
    note "pytest: missing and outputs/gpu_wheels has no wheel (run make gpu-wheels, carry it)"
  fi
fi
# Only the files that hold gpu tests: the others may import hydra/wandb/datasets at collection.
mapfile -t GPU_FILES < <(grep -rl --include="test_*.py" "mark.gpu" tests | sort)
note "gpu test files: ${GPU_FILES[*]}"
if "$PY" -c "import pytest" 2>/dev/null; then
  timeout 300 "$PY" -m pytest -m gpu -rA -p no:cacheprovider "${GPU_FILES[@]}" \
    --junitxml "$OUT_DIR/gpu_tests.xml" > "$OUT_DIR/gpu_tests.log" 2>&1
  note "gpu tests: rc=$? -> $(tail -n 1 "$OUT_DIR/gpu_tests.log")"
else
  note "gpu tests: NOT RUN (no pytest)"
fi

# ---------------------------------------------------------------- benchmarks on the device
# name:timeout_s:extra flags. The peer comparison (speculators) is CPU-only: it is not installed
# on the device machine.
BENCHES=(
  "attention:150:"
  "loss_memory:60:"
  "train_step:180:--compile --variant dflash1"
  "draft_latency:120:"
  "capture:60:"
  "train_step_dflash2:120:--variant both"
)
for entry in "${BENCHES[@]}"; do
  IFS=: read -r name limit extra <<< "$entry"
  module=${name%_dflash2}  # train_step_dflash2: benchmarks.train_step, DFlash 2 vs DFlash 1
  elapsed=$(( $(date +%s) - START ))
  if [ "$elapsed" -ge "$BUDGET_S" ]; then
    note "benchmark $name: SKIPPED (time budget ${BUDGET_S}s used: ${elapsed}s)"
    continue
  fi
  # shellcheck disable=SC2086
  timeout "$limit" "$PY" -m "benchmarks.$module" --device "$DEVICE" --size "$SIZE" $extra \
    --json "$OUT_DIR/$name.json" > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  note "benchmark $name: rc=$rc ($(( $(date +%s) - START ))s since start)"
  grep -E "^ratio|goal" "$OUT_DIR/$name.log" | sed 's/^/  /' | tee -a "$SUMMARY"
done
note "gpu_check done in $(( $(date +%s) - START ))s; results in $OUT_DIR"
