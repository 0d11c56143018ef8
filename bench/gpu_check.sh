#!/usr/bin/env bash
# One prepared device check (bounded well under 8 min): runs bench/gpu_check.py from the repo root.
# Results: $OUT/gpu_check.json (rewritten after every measurement), gpu_check.log, env.txt.
# Extra arguments go to gpu_check.py (e.g. --budget-s 200, --parts sampler_check,sampler).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/runs/gpu_check}"
mkdir -p "$OUT"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
{
  nvidia-smi || true
  "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  "$PY" -c "import transformers; print('transformers', transformers.__version__)" || true
} >"$OUT/env.txt" 2>&1
# Internal budget 330 s stops new measurements; the hard timeout is the backstop.
timeout -k 10 420 "$PY" -u bench/gpu_check.py --out "$OUT" --budget-s 330 "$@" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
echo "gpu_check exit $rc; results in $OUT/gpu_check.json"
exit "$rc"
