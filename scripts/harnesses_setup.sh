#!/usr/bin/env bash
# Opt-in setup of the real agent harnesses that tests/gateway/test_harnesses.py drives through the gateway
# (scripts/test.sh runs it when MTFLOW_HARNESSES=1). Idempotent; everything goes into .extras/ (gitignored):
#   .extras/harnesses            Codex CLI and Claude Code from npm (their platform binaries come as optional packages;
#                                npm 11 does not run claude-code's postinstall script, which it does not need)
#   .extras/mini-swe-agent-venv  mini-swe-agent from PyPI in a venv of its own (it would move python-dateutil and
#                                importlib-metadata down in mtflow's venv)
set -euo pipefail
cd "$(dirname "$0")/.."
H=.extras/harnesses
if [ -x $H/node_modules/.bin/codex ] && [ -x $H/node_modules/.bin/claude ]; then :
elif command -v npm >/dev/null 2>&1; then
  mkdir -p $H && (cd $H && npm install --no-audit --no-fund --loglevel=error '@openai/codex@0.171.0' '@anthropic-ai/claude-code@2.1.197')
else
  echo "warning: npm not found: the Codex CLI and Claude Code tests are skipped" >&2
fi
M=.extras/mini-swe-agent-venv
$M/bin/python -c 'import minisweagent' >/dev/null 2>&1 || { python3 -m venv $M \
  && $M/bin/python -m pip --disable-pip-version-check -q install 'mini-swe-agent==2.4.6'; } \
  || echo "warning: could not install mini-swe-agent: its test is skipped" >&2
