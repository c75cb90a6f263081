#!/usr/bin/env bash
# Install what the tests need and run them; CI calls this through .ci/run, which adds --full --vllm --torch211.
#
#   bash scripts/test.sh           the main stage: ruff + pytest on this checkout, without the tests marked slow or
#                                  compile (budget: 10 min on 2 busy cores, cold caches)
#   bash scripts/test.sh --full    the main stage with every test: also the whole-model inductor compiles, the
#                                  bench/CLI subprocess runs, sm_90a kernel compiles, examples, multi-process ranks
#   bash scripts/test.sh --vllm    then the vLLM stage too: the vLLM integration and FX-level pass tests in a
#                                  cached venv with vLLM 0.33 (torch 2.14); its first run builds that venv (about
#                                  9.4 GB download and disk)
#   bash scripts/test.sh --torch211  then the torch 2.11 stage too (the GPU machine's torch): the saved-trace,
#                                  compile-cache and FX-level pass tests in a cached venv with torch 2.11.0 and
#                                  transformers 5.17.0; its first run builds that venv (PyPI's torch 2.11 is a
#                                  CUDA build of a few GB, which runs on a CPU)
#   bash scripts/test.sh --help    this text
#
# Exit code: 0 every stage that ran passed, 1 main failed, 2 vLLM failed, 3 both failed, 4 bad argument or knob
# (nothing ran); 8 is added when the torch 2.11 stage failed (8 it alone, 9 with main, 10 with vLLM, 11 all three).
# pytest collecting no test (exit 5) counts as a failure.
#
# Environment, in the order it is chosen:
#   VIRTUAL_ENV       an active virtualenv is used as it is (its torch is kept; moefx[dev] is installed into it)
#   MOEFX_VENV        else this venv folder (default .venv), created when missing with torch 2.13 (CPU)
#   MOEFX_TORCH       what pip installs as torch into a venv that has none (default: this machine's local
#                     torch 2.13.0+cpu wheel in /opt/wheels when present, else torch==2.13.0); also the CPU
#                     torch of the quick-start test's fresh venv (skipped when neither is set)
#   MOEFX_TRITON      a pip requirement for Triton installed with moefx[dev], e.g. triton==3.6.0 (the GPU
#                     machine's); default none: pip keeps or resolves the newest Triton moefx[dev] allows
#   PYTEST_ARGS       extra pytest arguments for every stage, e.g. "-k config"
#   MOEFX_TEST_WORKERS pytest-xdist workers for the main stage (default 2; 0 = serial)
#   MOEFX_TEST_FULL=1 every test in the main stage (the same as --full)
#   MOEFX_TEST_VLLM=1 run the vLLM stage too (the same as --vllm)
#   MOEFX_SKIP_VLLM=1 skip the vLLM stage even when --vllm or MOEFX_TEST_VLLM=1 asks for it (and say so)
#   MOEFX_VLLM_VENV   the vLLM venv (default $HOME/.cache/moefx/venv-vllm, which CI caches between runs)
#   MOEFX_TEST_TORCH211=1 run the torch 2.11 stage too (the same as --torch211)
#   MOEFX_SKIP_TORCH211=1 skip the torch 2.11 stage even when asked for (and say so)
#   MOEFX_TORCH211_VENV the torch 2.11 venv (default $HOME/.cache/moefx/venv-torch211, which CI caches)
#   MOEFX_TORCH211    what pip installs as torch into that venv (default torch==2.11.0)
#   MOEFX_TORCH211_TESTS the test files of the torch 2.11 stage (default: the list in torch211_stage)
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' scripts/test.sh; }

want_vllm=${MOEFX_TEST_VLLM:-0}
want_full=${MOEFX_TEST_FULL:-0}
want_torch211=${MOEFX_TEST_TORCH211:-0}
for arg in "$@"; do
    case "$arg" in
        --vllm) want_vllm=1 ;;
        --full) want_full=1 ;;
        --torch211) want_torch211=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "scripts/test.sh: unknown argument '$arg' (valid: --full, --vllm, --torch211, --help)" >&2; exit 4 ;;
    esac
done
for knob in MOEFX_TEST_FULL MOEFX_TEST_VLLM MOEFX_SKIP_VLLM MOEFX_TEST_TORCH211 MOEFX_SKIP_TORCH211; do
    value=${!knob:-0}
    if [ "$value" != "0" ] && [ "$value" != "1" ]; then
        echo "scripts/test.sh: $knob='$value' is not valid (valid: 0, 1)" >&2
        exit 4
    fi
done

# pytest that collected nothing (exit 5) is a failure here: a filter or import that hides every test must not pass.
run_pytest() {
    "$@"
    local rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "== pytest collected no tests (exit 5): counted as a failure" >&2
    fi
    return "$rc"
}

main_stage() {
    if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
        echo "== using the active virtualenv $VIRTUAL_ENV (its torch is kept)"
        PY="$VIRTUAL_ENV/bin/python"
    else
        local venv=${MOEFX_VENV:-.venv}
        echo "== no active virtualenv: using $venv (MOEFX_VENV; created with torch 2.13 CPU when missing)"
        if [ ! -x "$venv/bin/python" ]; then
            python3 -m venv "$venv" || return 1
        fi
        PY="$venv/bin/python"
    fi
    local local_wheel
    local_wheel=$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n 1 || true)
    # The quick-start test (tests/test_quickstart_venv.py, slow) installs this CPU torch into a fresh venv.
    if [ -z "${MOEFX_TORCH:-}" ] && [ -n "$local_wheel" ]; then export MOEFX_TORCH=$local_wheel; fi
    if ! "$PY" -c "import torch" 2>/dev/null; then
        local torch_req=${MOEFX_TORCH:-${local_wheel:-torch==2.13.0}}
        echo "== installing torch: $torch_req"
        "$PY" -m pip install -q "$torch_req" || return 1
    fi
    # No Triton pin by default: the tests run on what a fresh resolve of moefx[dev] installs.
    local triton_req=()
    if [ -n "${MOEFX_TRITON:-}" ]; then triton_req=("$MOEFX_TRITON"); fi
    echo "== installing moefx[dev]${MOEFX_TRITON:+ with $MOEFX_TRITON (MOEFX_TRITON)}"
    "$PY" -m pip install -q -e ".[dev]" "${triton_req[@]}" || return 1
    "$PY" -c "import moefx, torch, triton; print('moefx', moefx.__version__, 'from', moefx.__path__[0], 'torch', \
torch.__version__, 'triton', triton.__version__, 'python', __import__('sys').executable)" || return 1

    local rc=0
    echo "== ruff"
    "$PY" -m ruff check moefx tests bench examples scripts || rc=1

    export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$HOME/.cache/moefx/inductor}
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.cache/moefx/triton}
    local tier=()
    if [ "$want_full" = "1" ]; then
        echo "== pytest, every test (inductor cache: $TORCHINDUCTOR_CACHE_DIR)"
    else
        tier=(-m "not slow and not compile")
        echo "== pytest without the tests marked slow or compile (--full runs them; CI does) (inductor cache:" \
            "$TORCHINDUCTOR_CACHE_DIR)"
    fi
    # shellcheck disable=SC2086
    # Two workers, one thread each (faster than serial on 2 cores; docs/CLI.md "Budget" has the measured times);
    # MOEFX_TEST_WORKERS=0 runs it serially.
    local workers=${MOEFX_TEST_WORKERS:-2}
    local xdist=()
    if [ "$workers" != "0" ]; then xdist=(-n "$workers"); fi
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} run_pytest "$PY" -m pytest -q -ra --durations=25 --timeout=900 \
        "${xdist[@]}" "${tier[@]}" ${PYTEST_ARGS:-} tests || rc=1
    return "$rc"
}

# vLLM 0.33 pins torch 2.14, so it lives in its own venv, cached between runs and created when missing (about
# 9.4 GB). These tests also run moefx's FX-level pass tests and the saved traces (torch's AOT compile) on torch 2.14.
vllm_stage() {
    local venv=${MOEFX_VLLM_VENV:-$HOME/.cache/moefx/venv-vllm}
    if ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
        echo "== creating $venv with vllm==0.33.0 (first run only; large download)"
        python3 -m venv "$venv" || return 1
        "$venv/bin/python" -m pip install -q "vllm==0.33.0" || return 1
    fi
    "$venv/bin/python" -m pip install -q --no-deps -e . || return 1
    "$venv/bin/python" -m pip install -q pytest pytest-timeout || return 1
    "$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" || return 1
    echo "== pytest in the vLLM venv"
    # shellcheck disable=SC2086
    MOEFX_REQUIRE_VLLM=1 TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$HOME/.cache/moefx/inductor}-vllm" \
        run_pytest "$venv/bin/python" -m pytest -q -ra --timeout=900 ${PYTEST_ARGS:-} ${MOEFX_VLLM_TESTS:-\
tests/test_vllm_integration.py tests/test_config.py tests/test_eliminate_noops.py tests/test_pass_manager.py \
tests/test_fuse_act_quant.py tests/test_fuse_norm_quant.py tests/test_last_token_logits.py tests/test_sampler_syncs.py \
tests/test_fusion_corpus.py tests/test_fuse_moe_routing.py tests/test_fuse_norm_linear.py tests/test_fuse_qk_norm_rope.py \
tests/test_aot_steps.py}
}

# The GPU machine's torch (2.11.0, with transformers 5.17.0) in its own venv, cached between runs and created when
# missing: torch 2.11 keeps the engine's traces only with enable_aot_compile on and moefx's serializable callable
# (moefx/engine/compile_cache/aot.py), and its FX graphs differ from 2.13's in places the passes match on.
torch211_stage() {
    local venv=${MOEFX_TORCH211_VENV:-$HOME/.cache/moefx/venv-torch211}
    local check="import sys, torch, transformers; sys.exit(not (torch.__version__.startswith('2.11.') and \
transformers.__version__ == '5.17.0'))"
    if ! "$venv/bin/python" -c "$check" 2>/dev/null; then
        echo "== creating $venv with ${MOEFX_TORCH211:-torch==2.11.0} and transformers==5.17.0 (first run only; a few GB)"
        python3 -m venv "$venv" || return 1
        "$venv/bin/python" -m pip install -q "${MOEFX_TORCH211:-torch==2.11.0}" "transformers==5.17.0" || return 1
    fi
    "$venv/bin/python" -m pip install -q --no-deps -e . || return 1
    "$venv/bin/python" -m pip install -q sympy pyyaml pytest pytest-timeout || return 1
    "$venv/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', \
transformers.__version__)" || return 1
    echo "== pytest in the torch 2.11 venv"
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} \
    TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$HOME/.cache/moefx/inductor}-torch211" \
        run_pytest "$venv/bin/python" -m pytest -q -ra --timeout=900 ${PYTEST_ARGS:-} ${MOEFX_TORCH211_TESTS:-\
tests/test_aot_steps.py tests/test_compile_cache.py tests/test_saved_traces_gpu.py tests/test_config.py \
tests/test_eliminate_noops.py tests/test_pass_manager.py tests/test_fuse_act_quant.py tests/test_fuse_norm_quant.py \
tests/test_last_token_logits.py tests/test_sampler_syncs.py tests/test_fusion_corpus.py tests/test_fuse_moe_routing.py \
tests/test_fuse_norm_linear.py tests/test_fuse_qk_norm_rope.py}
}

optional_stage() {  # wanted (1 or not), skip variable, what it tests, how to ask for it, stage function
    # sets stage_rc (1: it failed), stage_result (the summary's words) and stage_s
    local wanted=$1 skip=$2 what=$3 ask=$4 fn=$5 began=$SECONDS
    stage_rc=0
    if [ "$wanted" != "1" ]; then
        stage_result="not run: $what NOT tested ($ask runs it)"
    elif [ "${!skip:-0}" = "1" ]; then
        stage_result="skipped ($skip=1): $what NOT tested"
    else
        "$fn" || stage_rc=1
        stage_result=$([ "$stage_rc" -eq 0 ] && echo passed || echo FAILED)
    fi
    stage_s=$((SECONDS - began))
}

start=$SECONDS
main_rc=0
main_stage || main_rc=1
main_s=$((SECONDS - start))

optional_stage "$want_vllm" MOEFX_SKIP_VLLM "vLLM integration" "bash scripts/test.sh --vllm, or MOEFX_TEST_VLLM=1," \
    vllm_stage
vllm_rc=$stage_rc vllm_result=$stage_result vllm_s=$stage_s
optional_stage "$want_torch211" MOEFX_SKIP_TORCH211 "torch 2.11 (the GPU machine's)" "bash scripts/test.sh --torch211" \
    torch211_stage
torch211_rc=$stage_rc torch211_result=$stage_result torch211_s=$stage_s

tier_name=$([ "$want_full" = "1" ] && echo "every test" || echo "without slow/compile tests: --full runs them")
echo "== main stage ($tier_name): $([ "$main_rc" -eq 0 ] && echo passed || echo FAILED) (${main_s} s)"
echo "== torch 2.11 stage: $torch211_result (${torch211_s} s)"
echo "== vLLM stage: $vllm_result (${vllm_s} s)"
exit $((main_rc + 2 * vllm_rc + 8 * torch211_rc))
