#!/usr/bin/env bash
# The GPU session (tools/gpu_session.py) on the GPU machine: its parts, each one command of at most
# 300 s, writing at most 8 files (no folder) to $OUT as each step ends.
#
#   bash tools/gpu_session.sh must              # part 1: bench at the automatic micro batch, host waits
#   bash tools/gpu_session.sh rest              # part 2: fine-tuning step times, gpu-smoke, the fixed-micro trio
#   bash tools/gpu_session.sh docs              # part 3, when time remains: documents apart (varlen, mask, padding)
#   bash tools/gpu_session.sh modern            # part 4: ModernBERT-base at 1,024 tokens beside BERT-base
#   bash tools/gpu_session.sh --rehearse all    # the same steps at tiny size on CPU processes (tests/test_gpu_session.py)
#
# The GPU image lacks some of the project's packages (and has transformers 5.17 where the project pins
# 5.24): bash tools/gpu_wheels.sh fills .whl/ on a CPU machine; here they are installed into a
# temporary target (kept for the second part on a warm machine) ahead of the image's own packages.
# docs/speed.md ("The GPU session") gives the run call: what it runs, what it carries, its time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export OUT=${OUT:-runs/gpu-session}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
rehearse=0
for arg in "$@"; do [ "$arg" = --rehearse ] && rehearse=1; done
if [ "$rehearse" = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
  site=${GPU_SITE:-/tmp/bert-recipes-site}
  if [ ! -f "$site/.installed" ]; then
    t0=$(date +%s)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
      || { echo "config error: the wheels in .whl/ did not install (bash tools/gpu_wheels.sh makes them)" >&2; exit 2; }
    touch "$site/.installed"
    echo "[gpu-session] installed $(ls .whl/*.whl | wc -l) wheels from .whl/ into $site in $(( $(date +%s) - t0 )) s"
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PY" tools/gpu_session.py "$@"
