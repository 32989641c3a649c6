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
# openenv 0.10, the maintained line (openenv-core was renamed openenv upstream; both install the same `openenv`
# package, so openenv-core goes first), without its Gradio web UI (gradio pins pillow<13 and mtflow never serves
# the UI) and without its fastmcp<4 pin (nothing mtflow calls imports more than fastmcp 4 has), then what its client
# and server import.
.venv/bin/python -c 'import importlib.metadata as m; assert m.version("openenv") == "0.10.0"' 2>/dev/null \
  || { { $PIP uninstall -y openenv-core 2>/dev/null || true; } && $PIP install --no-deps 'openenv==0.10.0' \
  && $PIP install fastmcp 'websockets>=15' 'fastapi>=0.116' 'uvicorn>=0.24' tomli tomli-w requests 'httpx>=0.28.1' \
     'huggingface_hub>=1.29' 'jsonschema>=4.20' typer; }
.venv/bin/python -c 'import reasoning_gym, gymnasium, textarena' 2>/dev/null || $PIP install reasoning-gym gymnasium textarena
# SkyRL's text environments (tests/envs/test_skyrl_gym.py; extra skyrl-gym): nothing in the venv moves.
.venv/bin/python -c 'import skyrl_gym' 2>/dev/null || $PIP install 'skyrl-gym==0.4.0'
# GEM (tests/envs/test_gem.py; extra gem) in a venv of its own: gem-llm pins reasoning-gym 0.1.23, nltk 3.9.1 and
# msgspec 0.19 (here 0.1.25, 3.10, 0.23); mtflow runs there from the checkout (PYTHONPATH) with its own four deps.
.extras/gem-venv/bin/python -c 'import gem, pydantic, yaml, transitions, rich' 2>/dev/null || { .venv/bin/python -m venv .extras/gem-venv \
  && .extras/gem-venv/bin/python -m pip --disable-pip-version-check -q install 'gem-llm==0.1.0' 'pydantic>=2.5,<3' 'pyyaml>=6' \
     'transitions>=0.9.1' 'rich>=13'; } || echo "warning: could not make .extras/gem-venv: the GEM tests are skipped" >&2
# NeMo Gym's resources servers (tests/envs/test_nemo_gym.py; extra nemo-gym: mtflow's side is aiohttp, above) in a
# venv of their own: nemo-gym 0.7 needs Python 3.13 (it declares >=3.13.14, above every 3.13 here, so
# --ignore-requires-python) and pins openai 2.44 and mcp<2 (here 3.63 and 2.3); ~1.4 GB (Ray, MLflow, wandb).
# (a pyenv shim on PATH answers "command not found" where 3.13 is not selected: each candidate must run)
NG_PY=""
for c in $(command -v python3.13) $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13*/bin/python3.13 2>/dev/null); do
  [ -z "$NG_PY" ] && "$c" -c '' 2>/dev/null && NG_PY=$c
done
.extras/nemo-gym-venv/bin/python -c 'import nemo_gym, resources_servers' 2>/dev/null || { [ -n "$NG_PY" ] \
  && "$NG_PY" -m venv .extras/nemo-gym-venv && .extras/nemo-gym-venv/bin/python -m pip --disable-pip-version-check -q \
     install --ignore-requires-python 'nemo-gym==0.7.0'; } \
  || echo "warning: no Python 3.13 or nemo-gym would not install: the NeMo Gym tests are skipped" >&2
# verifiers 0.4 environments in-process (tests/envs/test_verifiers04.py; extra verifiers-v1) in a venv of their own:
# verifiers 0.4 pins mcp 2.0 and openai 2.54 (here 2.3 and 3.63). With openenv 0.10 for its OpenEnv taskset (--no-deps:
# its fastmcp<4 pin left out; fastmcp 4.1.1 is the newest that takes mcp 2.0), uv for its harness program (the
# reference evaluation: vf-eval), and mtflow's four dependencies (mtflow runs there from the checkout).
V=.extras/verifiers04-venv/bin/python
$V -c 'import verifiers.v1, openenv.core, fastmcp, yaml, transitions' 2>/dev/null || { .venv/bin/python -m venv .extras/verifiers04-venv \
  && $V -m pip --disable-pip-version-check -q install 'verifiers==0.4.0' 'pydantic>=2.5,<3' 'pyyaml>=6' 'transitions>=0.9.1' \
     'rich>=13' 'uv==0.13.9' && $V -m pip --disable-pip-version-check -q install --no-deps 'openenv==0.10.0' \
  && $V -m pip --disable-pip-version-check -q install 'fastmcp==4.1.1' 'mcp==2.0.0' 'fastapi>=0.116' 'uvicorn>=0.24' \
     'websockets>=15' requests tomli 'huggingface_hub>=1.29' jsonschema typer; } \
  || echo "warning: could not make .extras/verifiers04-venv: the verifiers 0.4 tests are skipped" >&2

# python tool sandbox (mtflow/tools/isolation.py, tests/declarative/test_sandbox*.py): bubblewrap;
# unshare and setpriv (the fallback and the uid drop) come with util-linux.
command -v bwrap >/dev/null 2>&1 || { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; } \
  || echo "warning: could not install bubblewrap: the sandbox tests use the unshare fallback or skip" >&2
# rootless calls on subordinate uids (newuidmap, Debian's uidmap; setup.sh installs it as root), and the normal
# user the rootless tests of issue 52 run as when this runs as root (tests/declarative/sandbox_util.py TEST_USER;
# useradd gives it a subordinate uid range where these files exist)
command -v newuidmap >/dev/null 2>&1 || { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq uidmap >/dev/null; } \
  || echo "warning: could not install uidmap: rootless sandbox tests run without subordinate uids" >&2
if [ "$(id -u)" -eq 0 ]; then
  touch /etc/subuid /etc/subgid
  id mtflow-sbx >/dev/null 2>&1 || useradd -m mtflow-sbx \
    || echo "warning: could not add the user mtflow-sbx: the rootless sandbox tests of issue 52 skip" >&2
  for ids in uid gid; do  # a user made before these files existed has no range: 65536 above every range there
    ! id mtflow-sbx >/dev/null 2>&1 || grep -q '^mtflow-sbx:' /etc/sub$ids \
      || { first=$(awk -F: 'BEGIN { m = 100000 } $2 + $3 > m { m = $2 + $3 } END { print m }' /etc/sub$ids) \
           && usermod --add-sub${ids}s "$first-$((first + 65535))" mtflow-sbx; } \
      || echo "warning: could not give mtflow-sbx subordinate ${ids}s: its rootless tests run without them" >&2
  done
fi
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
# gpt-oss's harmony parser (mtflow/declarative/parsers/harmony.py, the 'harmony' extra) and the vocabulary that
# openai-harmony would download: rebuilt from a PyPI package, checked by its SHA-256 (scripts/harmony_vocab.py);
# tests/conftest.py points TIKTOKEN_ENCODINGS_BASE at it
.venv/bin/python -c 'import openai_harmony' 2>/dev/null || $PIP install 'openai-harmony==0.0.8'
.venv/bin/python scripts/harmony_vocab.py .extras/tiktoken

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
# verifiers 0.4 for tests/gateway/test_verifiers04.py (its v1 stack against the gateway by X-Session-ID): the
# .extras/verifiers04-venv made above
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

# the trainers mtflow hands rollouts to (docs/training.md, tests/train): each apart from the venv, where its pins
# conflict. TRL 1.16 (environment_factory) beside ms-swift's 0.29.1, without dependencies (none moves; ~2 s)
[ -d .extras/trl116/trl ] || $PIP install --no-deps --target .extras/trl116 'trl==1.16.0'
# verl 0.9.1 in a venv of its own (transformers 5.10, hydra, ray; ~90 s); torch pinned first (a bare torch pulls CUDA);
# cachetools, uvicorn and fastapi are imported by its agent loop but not declared
XPIP() { "$1/bin/python" -m pip --disable-pip-version-check -q install "${@:2}"; }
.extras/verl-venv/bin/python -c 'import verl, cachetools, uvicorn, fastapi, transitions' 2>/dev/null || { .venv/bin/python -m venv .extras/verl-venv \
  && XPIP .extras/verl-venv torch==2.13.0 && XPIP .extras/verl-venv 'verl==0.9.1' cachetools uvicorn fastapi 'transitions>=0.9.1'; }
# the Tinker cookbook 0.6.1 (~90 s): it requires tml-renderers>=0.4.1, which the registry does not have (0.2.1 is the
# newest), so it goes in without dependencies, beside the ones its RL data path imports
.extras/tinker-venv/bin/python -c 'import tinker_cookbook.rl.data_processing, PIL, yaml, transitions' 2>/dev/null || { .venv/bin/python -m venv .extras/tinker-venv \
  && XPIP .extras/tinker-venv torch==2.13.0 && XPIP .extras/tinker-venv 'tinker==0.38.0' 'transformers==5.10.4' 'chz>=0.4.0' \
     'blobfile>=3.0.0' 'pyrage>=1.4.0' 'tiktoken>=0.12.0' 'datasets>=2.14.0' 'pillow>=10.0.0' termcolor cloudpickle safetensors pyyaml 'transitions>=0.9.1' \
  && XPIP .extras/tinker-venv --no-deps 'tinker-cookbook==0.6.1'; }
# SkyRL's skyrl-train 0.3.1 (~110 s) requires Python 3.12 and flash-attn (CUDA only): its data path (generator output,
# batch builder, advantages) under 3.11, without its declared dependencies, beside the ones that path imports
.extras/skyrl-venv/bin/python -c 'import skyrl_train.dataset.preprocess, skyrl_train.utils.trainer_utils, yaml, transitions' 2>/dev/null || { .venv/bin/python -m venv .extras/skyrl-venv \
  && XPIP .extras/skyrl-venv torch==2.13.0 && XPIP .extras/skyrl-venv 'transformers==5.10.4' 'ray==2.51.1' 'datasets==4.0.0' torchdata \
     jaxtyping loguru omegaconf pandas requests fastapi uvicorn func_timeout pyyaml 'transitions>=0.9.1' rich \
  && XPIP .extras/skyrl-venv --no-deps --ignore-requires-python 'skyrl-train==0.3.1' 'skyrl-gym==0.4.0'; }

# --- run ---
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
[ "$rc" -eq 5 ] && { echo "pytest collected no tests" >&2; exit 1; }
exit "$rc"
