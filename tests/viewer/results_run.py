"""A run with rewards and GRPO groups, written by ``mtflow run`` itself (scripted model, a Python
scheduler that scores each copy): the material of the reward/group views (``trace show --where``,
the HTML page's table, plots and group view).

Prompt ``p<i>`` (i = 0..n-1), 4 copies each (``p<i>#k``); copy k plays ``2 + (i + k) % 3`` turns;
its reward is ``k / 3`` for even i and 0 for odd i (so every odd group earns nothing); every fifth
prompt's copy 1 has a failing python tool call (``error_kind: timeout``); the observations of
prompt 7 say 'zebra' (the word the page's search looks for)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict

ROOT = Path(__file__).resolve().parents[2]

SCHEDULER = '''
from mtflow import Scheduler


def _ik(uuid):
    head, _, k = uuid.rpartition('#')
    return int(head[1:]), int(k)


class Scored(Scheduler):
    finish_reasons = ('stop_rule:done',)

    def check_finished(self, infer_request, response_choice, current_turn):
        i, k = _ik(infer_request.uuid)
        return current_turn >= 2 + (i + k) % 3

    def step(self, infer_request, response_choice, current_turn):
        i, k = _ik(infer_request.uuid)
        word = 'zebra' if i == 7 else 'lower'
        infer_request.messages.append({'role': 'user', 'content': f'turn {current_turn}: guess {word}'})
        info = {}
        if i % 5 == 0 and k == 1:
            info = {'calls': [{'name': 'python', 'ok': False, 'error_kind': 'timeout', 'seconds': 0.2}]}
        else:
            info = {'calls': [{'name': 'calculator', 'ok': True, 'seconds': 0.01 * (1 + i % 4)}]}
        reward = (k / 3) if i % 2 == 0 else 0.0
        return {'infer_request': infer_request, 'trace_info': info, 'rollout_infos': {'reward': reward}}
'''


def write_results_run(tmp: Path, prompts: int = 50) -> Dict[str, Path]:
    """Run it; ``{'out', 'trace', 'trajectories', 'summary', 'config'}``."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / 'scored.py').write_text(SCHEDULER)
    lines = [{'uuid': f'p{i}', 'prompt': f'guess the number {i}', 'answer': str(i)} for i in range(prompts)]
    (tmp / 'prompts.jsonl').write_text(''.join(json.dumps(l) + '\n' for l in lines))
    (tmp / 'run.yaml').write_text(textwrap.dedent(f'''\
        scheduler: scored.py:Scored
        backend: scripted
        model: {ROOT / 'configs' / 'scripted_guesses.jsonl'}
        backend_options: {{cycle: true}}
        dataset: prompts.jsonl
        num_generations: 4
        out: out
        max_turns: 5
        batch_size: 64
        '''))
    proc = subprocess.run([sys.executable, '-m', 'mtflow', 'run', 'run.yaml', '-q'], cwd=tmp, capture_output=True,
                          text=True, env={**__import__('os').environ, 'PYTHONPATH': str(ROOT)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = tmp / 'out'
    return {'out': out, 'trace': out / 'trace.jsonl', 'trajectories': out / 'trajectories.jsonl',
            'summary': out / 'summary.json', 'config': tmp / 'run.yaml'}
