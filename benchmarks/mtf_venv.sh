#!/usr/bin/env bash
# Create the Mesh TensorFlow virtual environment used by benchmarks/vs_mesh_tensorflow.py.
#
#   bash benchmarks/mtf_venv.sh [VENV_DIR]      # default: $MTF_VENV or /work/mtf-venv
#
# Installs exactly tensorflow-cpu 2.12.1, tensorflow-estimator 2.12.0 and mesh-tensorflow 0.1.21
# into its own venv (python3.11). It is never a test or runtime dependency of meshtorch.
# No extra pin is needed: tensorflow-cpu 2.12.1 itself pins numpy>=1.22,<=1.24.3 (pip picks 1.24.3);
# mesh-tensorflow 0.1.21 needs gin-config, six, future, absl-py (pulled in by pip). Its transformer
# package needs tensorflow-datasets too, which the benchmark does not use (hand-written mtf LM).
# Re-running on an existing venv re-checks the pins and is quick.
set -euo pipefail
VENV="${1:-${MTF_VENV:-/work/mtf-venv}}"
PY="${PYTHON:-python3.11}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet \
    "tensorflow-cpu==2.12.1" "tensorflow-estimator==2.12.0" "mesh-tensorflow==0.1.21"
"$VENV/bin/python" - <<'PY'
import numpy, tensorflow as tf, mesh_tensorflow as mtf  # noqa: F401
import importlib.metadata as md
print("tensorflow-cpu", md.version("tensorflow-cpu"), "| mesh-tensorflow", md.version("mesh-tensorflow"),
      "| numpy", numpy.__version__)
PY
echo "Mesh TF venv ready: $VENV  (python: $VENV/bin/python)"
