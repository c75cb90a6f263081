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

# vLLM integration: vLLM 0.33 pins torch 2.14, so it lives in its own venv, cached between runs and created
# when missing (about 8 GB). These tests also run moefx's FX-level pass tests on torch 2.14.
if [ "${MOEFX_SKIP_VLLM:-0}" = "1" ]; then
    echo "== vLLM stage skipped (MOEFX_SKIP_VLLM=1): vLLM integration NOT tested"
    exit 0
fi
VLLM_VENV=${MOEFX_VLLM_VENV:-$HOME/.cache/moefx/venv-vllm}
if ! "$VLLM_VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "== creating $VLLM_VENV with vllm==0.33.0 (first run only; large download)"
    python3 -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/python" -m pip install -q "vllm==0.33.0"
fi
"$VLLM_VENV/bin/python" -m pip install -q --no-deps -e .
"$VLLM_VENV/bin/python" -m pip install -q pytest pytest-timeout
"$VLLM_VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "== pytest in the vLLM venv"
# shellcheck disable=SC2086
MOEFX_REQUIRE_VLLM=1 TORCHINDUCTOR_CACHE_DIR="$TORCHINDUCTOR_CACHE_DIR-vllm" "$VLLM_VENV/bin/python" -m pytest -q -ra \
    --timeout=900 ${PYTEST_ARGS:-} ${MOEFX_VLLM_TESTS:-tests/test_vllm_integration.py tests/test_config.py \
    tests/test_eliminate_noops.py tests/test_pass_manager.py tests/test_fuse_act_quant.py tests/test_fuse_norm_quant.py \
    tests/test_last_token_logits.py tests/test_sampler_syncs.py tests/test_fusion_corpus.py}
