#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what the GPU machine's image lacks, as Python 3.12 manylinux x86_64 wheels,
# on a CPU machine that reaches PyPI: transformers at the project's pin (the image has 5.17), datasets,
# evaluate, deepspeed (a pure-Python wheel built from its sdist: no op is prebuilt), their dependencies the
# image lacks (the set that worked on 2026-11-30, ../shared/GPU-MEASURED.md), and nvidia-ml-py (NVML, for
# the node doctor). Versions: requirements.txt's pins, and for the dependencies what the project's .venv
# holds (make setup), so the GPU runs the versions the suite ran. The run call carries .whl (64 MiB with the
# working tree); tools/gpu_session.sh installs it.
#
#   bash tools/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_PY=${VENV_PY:-.venv/bin/python}
[ -x "$VENV_PY" ] || { echo "config error: $VENV_PY not found: run make setup first (the versions come from it)" >&2; exit 2; }
version() { "$VENV_PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
pinned() { grep -E "^$1==" requirements.txt | sed -E 's/.*==([^ ]+).*/\1/'; }
rm -rf .whl && mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
wanted=("transformers==$(pinned transformers)" "datasets==$(pinned datasets)" "evaluate==$(pinned evaluate)"
        "tokenizers==$(pinned tokenizers)")
for dep in dill multiprocess pydantic pydantic_core annotated_types typing_inspection hjson fsspec; do
  wanted+=("$dep==$(version "$dep")")
done
nvml=$(version nvidia-ml-py 2>/dev/null || true)   # pinned once the node doctor puts it in requirements.txt
wanted+=("nvidia-ml-py${nvml:+==$nvml}")
quiet() { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }   # this machine's pip notes
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${wanted[@]}" 2> >(quiet)
python3 -m pip wheel -q --no-deps -w .whl "deepspeed==$(pinned deepspeed)" 2> >(quiet)
ls -1 .whl
echo "[gpu-wheels] $(ls .whl/*.whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/ (carry it: the run call's carry [\".whl\", \".gpu_data\"])"
