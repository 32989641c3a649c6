"""``mtflow init NAME``: a new environment package in ``./NAME``, ready to run and to test.

It holds a YAML scheduler with one tool (``NAME.yaml``), the tool and the reward in Python
(``NAME_env.py``), a five-line dataset (``data.jsonl``), a scripted model's replies
(``model.jsonl``, so everything runs without a model), a run config (``run.yaml``), a test that
runs it with ``mtflow run`` on the scripted backend (``test_NAME.py``) and a README saying what
to change. It prints the test command; ``mtflow validate NAME.yaml run.yaml`` passes on it as it
is. A directory that exists and is not empty is never written into.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Dict

from mtflow.core.errors import UserError

#: the environment's task: look up a capital with the tool, answer in <answer> tags
ROWS = [('france', 'What is the capital of France?', 'Paris'), ('japan', 'What is the capital of Japan?', 'Tokyo'),
        ('kenya', 'What is the capital of Kenya?', 'Nairobi'), ('peru', 'What is the capital of Peru?', 'Lima'),
        ('canada', 'What is the capital of Canada?', 'Ottawa')]
#: the scripted model: it calls the tool, then answers (wrong for Canada, so the rewards differ)
ANSWERS = {'canada': 'Toronto'}

SCHEDULER = """\
# The {name} environment: the model looks a capital up with the `capital` tool, then answers in
# <answer> tags; the reward is 1.0 for the dataset's answer (data.jsonl: data_dict.answer).
# Check it: mtflow validate {name}.yaml run.yaml   Run it: mtflow run run.yaml
name: {name}
description: Look a capital up with a tool, answer in <answer> tags.
max_turns: 4
parser: hermes                      # the model's tool-call format (docs/declarative.md, "Tool-call formats")
tools:
  - name: capital
    impl: {module}.py:capital       # a function next to this file; its docstring and signature are the schema
    timeout_s: 5
answer:
  pattern: '<answer>\\s*(.*?)\\s*</answer>'
  field: answer                     # data_dict.answer of each dataset line
  compare: exact
reward: {module}.py:reward          # (infer_request, rollout_infos) -> float, at the end of each request
system_prompt: |-
  Answer the question. Look facts up with the tools, then give the final answer as <answer>...</answer>.
  {{tools}}
stop:
  correct_answer: false             # a turn without a tool call ends the request (stop_rule:no_tool_call)
"""

MODULE = '''\
"""The {name} environment's tool and reward (named in {name}.yaml)."""
import re

CAPITALS = {{'france': 'Paris', 'japan': 'Tokyo', 'kenya': 'Nairobi', 'peru': 'Lima', 'canada': 'Ottawa'}}


def capital(country: str) -> str:
    """Look up the capital city of a country.

    Args:
        country: The country's name in English, e.g. "France".
    """
    found = CAPITALS.get(country.strip().lower())
    if found is None:
        raise ValueError(f'no capital known for {{country!r}}')
    return found


def reward(infer_request, rollout_infos) -> float:
    """1.0 when the last <answer> of the final reply is the dataset's answer, else 0.0."""
    reply = next((m.get('content') or '' for m in reversed(infer_request.messages) if m['role'] == 'assistant'), '')
    answers = re.findall(r'<answer>\\s*(.*?)\\s*</answer>', reply, re.DOTALL)
    return float(bool(answers) and answers[-1] == infer_request.data_dict['answer'])
'''

RUN = """\
# Runs {name}.yaml over data.jsonl with the scripted model (model.jsonl: replies by request and
# turn), so it needs no model. For a real one: backend: hf, model: embedded (docs/backends.md).
scheduler: {name}.yaml
backend: scripted
model: model.jsonl
dataset: data.jsonl
out: runs/{name}
max_turns: 4
batch_size: 5
"""

TEST = '''\
"""Runs the {name} environment end to end with `mtflow run` on the scripted backend (no model)."""
import json
from pathlib import Path

from mtflow.cli import main

HERE = Path(__file__).resolve().parent


def test_run_gives_each_request_its_reward(tmp_path):
    out = tmp_path / 'run'
    assert main(['run', str(HERE / 'run.yaml'), '--out', str(out), '--no-progress']) == 0
    lines = [json.loads(line) for line in (out / 'trajectories.jsonl').read_text().splitlines()]
    rewards = {{line['uuid']: line['reward'] for line in lines}}
    assert rewards == {rewards}
    for line in lines:  # every request called the tool once, and got its answer back
        tool = [m for m in line['messages'] if m['role'] == 'tool']
        assert len(tool) == 1 and line['rollout_infos']['tool_errors'] == 0


def test_validate_finds_no_problem():
    assert main(['validate', str(HERE / '{name}.yaml'), str(HERE / 'run.yaml')]) == 0
'''

README = """\
# {name}

An mtflow environment, made by `mtflow init {name}`: the model looks a capital up with the
`capital` tool, then answers in `<answer>` tags; the reward is 1.0 for the dataset's answer.

| file | what |
|---|---|
| `{name}.yaml` | the scheduler: the tool, the answer format, the reward (docs/declarative.md) |
| `{module}.py` | the tool (`capital`) and the reward (`reward`) |
| `data.jsonl` | five prompts; `answer` goes to each request's `data_dict` |
| `model.jsonl` | the scripted model's replies (by request and turn), so it runs without a model |
| `run.yaml` | the run config: this scheduler over `data.jsonl` with the scripted model |
| `test_{name}.py` | runs it with `mtflow run` and checks each request's reward |

```bash
mtflow validate {name}.yaml run.yaml   # every problem, with file, line and field
{test}   # the test
mtflow run run.yaml                  # trajectories in runs/{name}/
```

To make it yours: change the tool in `{module}.py` (its docstring and signature are the schema
the model sees), the task in `data.jsonl`, the reward, and run it with a real model
(`backend: hf`, `model: embedded` in `run.yaml`).
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser('init', help='scaffold an environment package: scheduler, tool, reward, dataset, test')
    p.add_argument('name', help='the new directory (and the environment\'s name)')
    p.set_defaults(func=main)


def files(name: str, test_command: str) -> Dict[str, str]:
    """The package's files (relative path -> text) for environment ``name``."""
    module = f'{name.replace("-", "_")}_env'
    rows = [{'uuid': uuid, 'prompt': question, 'answer': answer} for uuid, question, answer in ROWS]
    replies = []
    for uuid, question, answer in ROWS:
        country = question.rsplit(' ', 1)[1].rstrip('?')
        call = json.dumps({'name': 'capital', 'arguments': {'country': country}})
        replies.append({'uuid': uuid, 'turn': 1, 'content': f'<tool_call>{call}</tool_call>'})
        said = ANSWERS.get(uuid, answer)
        replies.append({'uuid': uuid, 'turn': 2, 'content': f'The capital is <answer>{said}</answer>.'})
    rewards = {uuid: float(uuid not in ANSWERS) for uuid, _, _ in ROWS}
    fmt = dict(name=name, module=module, test=test_command, rewards=rewards)
    return {
        f'{name}.yaml': SCHEDULER.format(**fmt),
        f'{module}.py': MODULE.format(**fmt),
        'data.jsonl': ''.join(json.dumps(r) + '\n' for r in rows),
        'model.jsonl': ''.join(json.dumps(r) + '\n' for r in replies),
        'run.yaml': RUN.format(**fmt),
        f'test_{name.replace("-", "_")}.py': TEST.format(**fmt),
        'README.md': README.format(**fmt),
    }


def main(args: argparse.Namespace) -> int:
    name = args.name.rstrip('/')
    if not re.fullmatch(r'[A-Za-z][A-Za-z0-9_-]{0,63}', name):
        raise UserError(f'init: {args.name!r} is not a name for an environment: use letters, digits, - and _, '
                        'starting with a letter (it becomes a directory and a Python module)')
    target = Path(name)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UserError(f'init: {target} already exists and is not an empty directory; nothing was written')
    test_command = f'{shlex.quote(sys.executable)} -m pytest -q test_{name.replace("-", "_")}.py'
    target.mkdir(exist_ok=True)
    for rel, text in files(name, test_command).items():
        (target / rel).write_text(text, encoding='utf-8')
    print(f'made {target}/: {name}.yaml (scheduler, one tool), {name.replace("-", "_")}_env.py (tool and reward), '
          'data.jsonl (5 prompts), model.jsonl (scripted replies), run.yaml, '
          f'test_{name.replace("-", "_")}.py, README.md')
    print(f'test it:  cd {shlex.quote(str(target))} && {test_command}')
    print(f'run it:   cd {shlex.quote(str(target))} && mtflow run run.yaml')
    return 0
