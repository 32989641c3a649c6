#!/usr/bin/env bash
# Set up everything the test suite needs, then run it. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
$PIP install -e '.[hf,test,images]'
# --- test-only setup (keep each block short and idempotent) ---
# ms-swift integration tests (tests/swift): the tested ms-swift, after torch==2.13.0 (setup.sh);
# math-verify (MathAccuracy) and msgspec (rlhf_trainers) are imported by ms-swift but not declared.
.venv/bin/python -c 'import swift, math_verify, msgspec' 2>/dev/null || $PIP install ms-swift==4.6.0 math-verify msgspec
# trace viewer browser test (tests/viewer/test_trace_browser.py): Debian's chromium driven by Playwright.
# Never `playwright install` (it downloads its own browser); the test uses /usr/bin/chromium.
SUDO=$([ "$(id -u)" -eq 0 ] || echo sudo)
command -v chromium >/dev/null 2>&1 || { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
  || echo "warning: could not install chromium: the browser test will be skipped" >&2
.venv/bin/python -c 'import playwright' 2>/dev/null || $PIP install playwright
# OpenAI-compatible backend (mtflow/backends/openai_server.py, the 'openai' extra) and its tests.
.venv/bin/python -c 'import httpx' 2>/dev/null || $PIP install 'httpx>=0.24'
# aiohttp: the backend's preferred client at high concurrency (benchmarks/serving.py); both are tested.
.venv/bin/python -c 'import aiohttp' 2>/dev/null || $PIP install 'aiohttp==3.14.5'
# Environments from the ecosystem (tests/envs; extras openenv, gym, reasoning-gym, textarena).
# openenv-core without its Gradio web UI (gradio pins pillow<13 and mtflow never serves the UI),
# then what its client and server import.
.venv/bin/python -c 'import openenv.core' 2>/dev/null || { $PIP install --no-deps 'openenv-core==0.3.0' \
  && $PIP install fastmcp 'websockets>=15' 'fastapi>=0.104' 'uvicorn>=0.24' tomli tomli-w requests; }
.venv/bin/python -c 'import reasoning_gym, gymnasium, textarena' 2>/dev/null || $PIP install reasoning-gym gymnasium textarena

# python tool sandbox (mtflow/tools/isolation.py, tests/declarative/test_sandbox*.py): bubblewrap;
# unshare and setpriv (the fallback and the uid drop) come with util-linux.
command -v bwrap >/dev/null 2>&1 || { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; } \
  || echo "warning: could not install bubblewrap: the sandbox tests use the unshare fallback or skip" >&2
# its seccomp filter is built with libseccomp (mtflow/tools/seccomp.py): the pyseccomp binding and the library
SECCOMP_OK='import pyseccomp; pyseccomp.system_arch()'  # (pyseccomp loads libseccomp on import; no ldconfig needed)
.venv/bin/python -c "$SECCOMP_OK" 2>/dev/null || { $PIP install 'pyseccomp==0.1.2' && { .venv/bin/python -c "$SECCOMP_OK" 2>/dev/null \
  || $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libseccomp2 >/dev/null; }; } \
  || echo "warning: could not install pyseccomp/libseccomp2: every python tool call is refused" >&2
# mtflow run --log tensorboard (mtflow/run/tracking.py, the 'tensorboard' extra) and its test.
.venv/bin/python -c 'import tensorboardX' 2>/dev/null || $PIP install 'tensorboardX==2.6.5'
# mtflow run --otel (mtflow/run/otel.py, the 'otel' extra) and tests/test_otel.py.
.venv/bin/python -c 'import opentelemetry.sdk, opentelemetry.exporter.otlp.proto.http' 2>/dev/null || $PIP install 'opentelemetry-api==1.45.2' 'opentelemetry-sdk==1.45.2' 'opentelemetry-exporter-otlp-proto-http==1.45.2'
# Ray fan-out (mtflow/distributed/ray_fanout.py, the 'ray' extra) and its tests (tests/distributed).
.venv/bin/python -c 'import ray' 2>/dev/null || $PIP install 'ray==2.60.0'

# the gateway (mtflow/gateway, the 'gateway' extra: aiohttp, above) and its tests (tests/gateway): the anthropic
# client and smolagents, pinned, in the venv (nothing there moves); the OpenAI Agents SDK apart, without its
# dependencies (all in the venv already; its wheel pins websockets<17 where openenv's is 17.4), as
# docs/training.md installs TRL 1.16 apart
.venv/bin/python -c 'import anthropic, smolagents' 2>/dev/null || $PIP install 'anthropic==2.17.0' 'smolagents==1.26.0'
[ -d .extras/openai-agents/agents ] || $PIP install --no-deps --target .extras/openai-agents 'openai-agents==0.24.0'
# verifiers (tests/gateway/test_verifiers.py) in a venv of its own: it would move mcp 2.3 -> 1.30 and websockets
# 17.4 -> 16.1 here (and bring prime-* packages); 0.3.1 is the newest release with the MultiTurnEnv/ToolEnv/Rubric API (0.4.0 ships only its v1 stack)
.extras/verifiers-venv/bin/python -c 'import verifiers.legacy' 2>/dev/null || { .venv/bin/python -m venv .extras/verifiers-venv \
  && .extras/verifiers-venv/bin/python -m pip --disable-pip-version-check -q install 'verifiers==0.3.1'; }
# verifiers 0.4 (tests/gateway/test_verifiers04.py: its v1 stack against the gateway by X-Session-ID) in a venv of its
# own as well (the same venv another branch's in-process environments use)
.extras/verifiers04-venv/bin/python -c 'import verifiers.v1' 2>/dev/null || { .venv/bin/python -m venv .extras/verifiers04-venv \
  && .extras/verifiers04-venv/bin/python -m pip --disable-pip-version-check -q install 'verifiers==0.4.0'; }
# real agent harnesses (tests/gateway/test_harnesses.py: Codex CLI, Claude Code, mini-swe-agent), opt-in: npm and PyPI
if [ "${MTFLOW_HARNESSES:-0}" = 1 ]; then bash scripts/harnesses_setup.sh; fi
# the model families' chat templates as their repositories ship them (tests/backends/test_chat_templates.py), from two
# registry packages: llama.cpp's copies in the llama-cpp-python sdist, TRL 1.16's originals in its wheel (.jinja only)
CT=.extras/chat-templates
[ -f $CT/.complete ] || { D=$(mktemp -d) && $PIP download --no-deps --no-binary :all: -d "$D" 'llama-cpp-python==0.3.36' \
  && $PIP download --no-deps -d "$D" 'trl==1.16.0' && mkdir -p $CT/llama.cpp $CT/trl && tar -xzf "$D"/llama_cpp_python-*.tar.gz \
  -C $CT/llama.cpp --strip-components=5 --wildcards '*/vendor/llama.cpp/models/templates/*.jinja' && .venv/bin/python -c \
  'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [open(sys.argv[2] + n.rsplit("/", 1)[1], "wb").write(z.read(n))
   for n in z.namelist() if n.startswith("trl/chat_templates/") and n.endswith(".jinja")]' "$D"/trl-*.whl $CT/trl/ \
  && touch $CT/.complete; rm -rf "$D"; } || echo "warning: could not fetch the chat templates: their tests are skipped" >&2

# --- run ---
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
[ "$rc" -eq 5 ] && { echo "pytest collected no tests" >&2; exit 1; }
exit "$rc"
