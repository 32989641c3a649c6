#!/usr/bin/env bash
# Set up everything the test suite needs, then run it. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
$PIP install -e '.[hf,test]'
# --- test-only setup (keep each block short and idempotent) ---

# --- run ---
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
[ "$rc" -eq 5 ] && { echo "pytest collected no tests" >&2; exit 1; }
exit "$rc"
