#!/usr/bin/env bash
# Install what the tests need (into a reused venv) and run them. CI calls this through .ci/run.
#   MOEFX_VENV        venv folder (default .venv)
#   PYTEST_ARGS       extra pytest arguments, e.g. "-k config"
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${MOEFX_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

if ! python -c "import torch" 2>/dev/null; then
    echo "== installing torch 2.13.0 (CPU; taken from this machine's local wheel where present)"
    local_wheel=$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n 1 || true)
    python -m pip install -q "${local_wheel:-torch==2.13.0}"
fi
echo "== installing moefx[dev]"
python -m pip install -q -e ".[dev]" "triton==3.6.0"
python -c "import moefx, torch, triton; print('moefx', moefx.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"

echo "== ruff"
ruff check moefx tests bench examples scripts

export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$HOME/.cache/moefx/inductor}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.cache/moefx/triton}
echo "== pytest (inductor cache: $TORCHINDUCTOR_CACHE_DIR)"
# shellcheck disable=SC2086
python -m pytest -q -ra --durations=15 --timeout=900 ${PYTEST_ARGS:-} tests
