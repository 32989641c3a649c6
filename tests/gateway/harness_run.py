"""One real agent harness, unchanged, against an in-process gateway: a scripted model
(``configs/gateway_harnesses.jsonl``) makes it run one shell command in a scratch directory and
finish. Run as a script (``tests/gateway/test_harnesses.py`` starts it, inside a network namespace
with loopback only when the machine allows one), it prints one JSON line: the harness's exit code
and output tails, what it wrote, the finish.

    python tests/gateway/harness_run.py codex|claude|mini RUN_DIR SCRATCH_DIR

Each harness is kept from the network by its own switches (found by resolving every name it asks
for with a logging resolver: ``docs/gateway.md``, "Harnesses offline"):

* Codex CLI: ``-c analytics.enabled=false --disable plugins`` (else it looks up ab.chatgpt.com,
  chatgpt.com, github.com, api.github.com), a ``CODEX_HOME`` of its own;
* Claude Code: ``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1`` (else api.anthropic.com, and a
  side call for the session's title), a ``HOME`` of its own;
* mini-swe-agent: ``LITELLM_LOCAL_MODEL_COST_MAP=True`` (else LiteLLM fetches its cost map from
  raw.githubusercontent.com), ``MSWEA_CONFIGURED=true`` (else it asks for a setup on stdin).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mtflow import RequestConfig  # noqa: E402
from mtflow.backends.scripted import ScriptedBackend  # noqa: E402
from mtflow.gateway import Gateway  # noqa: E402
from tests.tiny_model import make_tokenizer  # noqa: E402

BIN = ROOT / '.extras' / 'harnesses' / 'node_modules' / '.bin'
MINI = ROOT / '.extras' / 'mini-swe-agent-venv' / 'bin' / 'mini'
#: the model's side of each session (``<harness>-1``), by turn: docs/gateway.md's examples serve the same
SCRIPT = ROOT / 'configs' / 'gateway_harnesses.jsonl'
TASK = 'Write hello into out.txt'


def _command(harness: str, gw: Gateway, session: str, home: Path) -> tuple:
    """``(argv, extra environment)`` of one harness against session ``session``."""
    if harness == 'codex':
        provider = (f'model_providers.mtflow={{name="mtflow", base_url="{gw.base_url(session)}", '
                    'wire_api="responses", env_key="MTFLOW_KEY"}')
        return ([str(BIN / 'codex'), 'exec', '--skip-git-repo-check', '--dangerously-bypass-approvals-and-sandbox',
                 '-m', 'any', '-c', 'model_provider=mtflow', '-c', provider, '-c', 'analytics.enabled=false',
                 '--disable', 'plugins', TASK], {'CODEX_HOME': str(home), 'MTFLOW_KEY': 'unused'})
    if harness == 'claude':
        return ([str(BIN / 'claude'), '-p', TASK, '--model', 'any', '--allowedTools', 'Bash'],
                {'HOME': str(home), 'ANTHROPIC_BASE_URL': gw.base_url(session, 'anthropic'),
                 'ANTHROPIC_API_KEY': 'unused', 'CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC': '1'})
    return ([str(MINI), '-m', 'openai/any', '-t', TASK, '-y', '--exit-immediately', '-o', str(home / 'traj.json'),
             '-c', 'mini.yaml', '-c', f'model.model_kwargs.api_base={gw.base_url(session)}', '-c',
             'agent.cost_limit=0'],
            {'MSWEA_GLOBAL_CONFIG_DIR': str(home), 'MSWEA_CONFIGURED': 'true', 'MSWEA_COST_TRACKING': 'ignore_errors',
             'LITELLM_LOCAL_MODEL_COST_MAP': 'True', 'OPENAI_API_KEY': 'unused'})


def main(harness: str, run_dir: str, scratch: str) -> Dict[str, Any]:
    scratch_dir, home = Path(scratch), Path(scratch).parent / f'{harness}-home'
    scratch_dir.mkdir(parents=True, exist_ok=True)
    home.mkdir(parents=True, exist_ok=True)
    session = f'{harness}-1'
    backend = ScriptedBackend(SCRIPT, tokenizer=make_tokenizer())
    with Gateway(backend, run_dir, mode='overwrite', request_config=RequestConfig(max_tokens=256)) as gw:
        argv, env = _command(harness, gw, session, home)
        done = subprocess.run(argv, cwd=scratch_dir, env=dict(os.environ, **env), capture_output=True, text=True,
                              timeout=240, stdin=subprocess.DEVNULL)
        written = (scratch_dir / 'out.txt').read_text() if (scratch_dir / 'out.txt').is_file() else None
        finish = gw.finish(session, reward=1.0 if written == 'hello\n' else 0.0, info={'out.txt': written})
    return {'returncode': done.returncode, 'stdout': done.stdout[-2000:], 'stderr': done.stderr[-3000:],
            'out': written, 'finish': finish}


if __name__ == '__main__':
    print(json.dumps(main(*sys.argv[1:4])))
