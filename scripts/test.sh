#!/usr/bin/env bash
# Set up everything the test suite needs, then run it. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
$PIP install -e '.[hf,test]'
# --- test-only setup (keep each block short and idempotent) ---
# ms-swift integration tests (tests/swift): the tested ms-swift, after torch==2.13.0 (setup.sh);
# math-verify (MathAccuracy) and msgspec (rlhf_trainers) are imported by ms-swift but not declared.
.venv/bin/python -c 'import swift, math_verify, msgspec' 2>/dev/null || $PIP install ms-swift==4.6.0 math-verify msgspec

# --- run ---
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
[ "$rc" -eq 5 ] && { echo "pytest collected no tests" >&2; exit 1; }
exit "$rc"
