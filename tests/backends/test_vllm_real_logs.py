"""Opt-in (skipped unless ``vllm`` is importable; see docs/backends.md "vLLM on CPU"): what a
user reads when mtflow starts and stops a real vLLM engine, bfloat16 on a float32 checkpoint, for
``vllm.LLM`` and ``AsyncLLM``. Each engine runs in a subprocess
(``tests/backends/vllm_engine_run.py``) whose stdout and stderr, where vLLM's engine core and
worker processes write too, are read whole:

- the per-tensor "Attempted to load weight ... float32 into parameter with dtype torch.bfloat16"
  warnings are one line with their count (the tiny Qwen2: 10);
- no "Passing raw prompts to InputProcessor is deprecated" (``AsyncLLM`` gets rendered prompts);
- the engine core gives its workers mtflow's grace period, and no "grace period"/SIGTERM/SIGKILL
  line is logged at shutdown."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip('vllm')

from tests.backends.test_vllm_real import _tiny_model_dir  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.hf]
ROOT = Path(__file__).resolve().parents[2]
#: vLLM's per-tensor warning for the tiny model: 2 layers x 4 unfused tensors + embedding + norm
TINY_WEIGHT_WARNINGS = 10


@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
    return _tiny_model_dir(tmp_path_factory.mktemp('tiny-qwen2'))


def _engine_output(model_dir: str, engine: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get('PYTHONPATH', '')]))
    env.pop('VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS', None)
    env.pop('VLLM_LOGGING_CONFIG_PATH', None)
    proc = subprocess.run([sys.executable, str(ROOT / 'tests' / 'backends' / 'vllm_engine_run.py'), model_dir, engine,
                           'bfloat16'], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=900)
    assert proc.returncode == 0 and 'mtflow-run: ok' in proc.stdout, proc.stdout[-4000:]
    return proc.stdout


@pytest.mark.parametrize('engine', ['llm', 'async'])
def test_engine_log_start_to_shutdown(model_dir, engine):
    out = _engine_output(model_dir, engine)
    lines = out.splitlines()
    raw = [line for line in lines if re.search(r'Attempted to load weight \S+ with dtype', line)]
    assert not raw, f'{len(raw)} per-tensor dtype warnings, e.g. {raw[0]}'
    summary = [line for line in lines if "'Attempted to load weight' warnings summarised" in line]
    assert len(summary) == 1, summary
    assert re.search(rf'\b{TINY_WEIGHT_WARNINGS} weights loaded .*{TINY_WEIGHT_WARNINGS} from torch\.float32 into '
                     r'torch\.bfloat16', summary[0]), summary[0]
    # the prompt path's deprecations (raw prompts, or an EngineCoreRequest); vLLM's own import
    # of torch.distributed.reduce_op warns too (a FutureWarning of vLLM's, not of a prompt)
    deprecated = [line for line in lines if re.search(r'Passing (raw prompts|EngineCoreRequest)', line)]
    assert not deprecated, deprecated
    grace = re.search(r'mtflow-run: worker grace (\S+)', out)
    assert grace and grace.group(1) == '20', grace and grace.group(0)
    shutdown = [line for line in lines if re.search(r'grace period|SIGTERM count|SIGKILL', line)]
    assert not shutdown, shutdown
