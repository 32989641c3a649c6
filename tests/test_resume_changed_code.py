"""``--resume`` after the code a run's config names changed (issue 47, item 2): the reward module
edited between two attempts would mix two reward functions in one run without a word. The
fingerprint holds the content hash of every module and file the config names, a change is refused
naming the field and the file, and ``--accept-changed`` goes on knowingly, recorded in ``run.json``."""
from __future__ import annotations

import json
import os
import sys

import pytest

from mtflow.cli import main

REWARD = 'def reward(infer_request, rollout_infos):\n    return {value}\n'
SCHED = 'name: s\nmax_turns: 2\nreward: rewards:reward\ntools:\n  - {name: shout, impl: "tools.py:shout"}\n'
TOOLS = 'def shout(text: str) -> str:\n    return text.upper()\n'
RUN = 'scheduler: sched.yaml\nbackend: scripted\nmodel: script.jsonl\nbackend_options: {cycle: true}\n' \
      'dataset: data.jsonl\nout: out\nbatch_size: 1\n'


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv('MTFLOW_DEBUG', raising=False)
    (tmp_path / 'rewards.py').write_text(REWARD.format(value=1.0))
    (tmp_path / 'tools.py').write_text(TOOLS)
    (tmp_path / 'sched.yaml').write_text(SCHED)
    (tmp_path / 'run.yaml').write_text(RUN)
    (tmp_path / 'script.jsonl').write_text(json.dumps({'content': 'hello', 'token_ids': [5, 6]}) + '\n')
    (tmp_path / 'data.jsonl').write_text(''.join(json.dumps({'uuid': f'q{i}', 'prompt': f'p{i}'}) + '\n'
                                                 for i in range(4)))
    return tmp_path


def _run(capsys, *flags):
    for name, module in list(sys.modules.items()):  # each run as a new process sees the files
        if str(getattr(module, '__file__', None) or '').startswith(os.getcwd()):
            del sys.modules[name]
    code = main(['run', 'run.yaml', '--no-progress', *flags])
    return code, capsys.readouterr().err


def _rewards(path):
    return {json.loads(l)['uuid']: json.loads(l)['rollout_infos'].get('reward') for l in path.read_text().splitlines()}


def test_a_resume_after_the_reward_changed_is_refused_naming_it_and_goes_on_with_accept_changed(project, capsys):
    assert _run(capsys, '--until', 'requests=2')[0] == 0
    before = (project / 'out' / 'trajectories.jsonl').read_text()
    run_json = (project / 'out' / 'run.json').read_text()
    assert set(_rewards(project / 'out' / 'trajectories.jsonl').values()) == {1.0}
    (project / 'rewards.py').write_text(REWARD.format(value=0.5))

    code, err = _run(capsys, '--resume')
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith('mtflow: cannot resume out: code or files the config names changed since the run '
                           'started (code.reward (rewards.py): "sha256:')
    assert 'pass --accept-changed to go on with the new ones (recorded in run.json)' in line
    assert 'tools' not in line  # only what changed is named
    assert (project / 'out' / 'trajectories.jsonl').read_text() == before  # nothing touched
    assert (project / 'out' / 'run.json').read_text() == run_json

    code, err = _run(capsys, '--resume', '--accept-changed')
    assert code == 0, err
    assert '--accept-changed: going on with changed code (code.reward (rewards.py)' in err
    rewards = _rewards(project / 'out' / 'trajectories.jsonl')
    assert sorted(rewards.values()) == [0.5, 0.5, 1.0, 1.0]  # the old lines kept, the rest by the new reward
    info = json.loads((project / 'out' / 'run.json').read_text())
    assert [a.get('accepted_changes', []) for a in info['attempts']][0] == []
    assert info['attempts'][-1]['accepted_changes'][0].startswith('code.reward (rewards.py): "sha256:')
    # the run now holds the new code: a resume with it needs no flag, a change of a tool does
    assert _run(capsys, '--resume')[0] == 0
    (project / 'tools.py').write_text(TOOLS.replace('upper', 'lower'))
    code, err = _run(capsys, '--resume')
    assert code == 2 and 'code.tools[0].impl (tools.py)' in err


def test_a_changed_config_value_is_not_gone_past_by_accept_changed(project, capsys):
    assert _run(capsys, '--until', 'requests=2')[0] == 0
    (project / 'run.yaml').write_text(RUN + 'max_turns: 1\n')
    code, err = _run(capsys, '--resume', '--accept-changed')
    assert code == 2 and 'the run was started with another config or dataset (config.max_turns: null -> 1)' in err


def test_accept_changed_goes_with_resume(project, capsys):
    code, err = _run(capsys, '--accept-changed')
    assert code == 2 and 'mtflow: --accept-changed goes with --resume' in err


def test_quiet_still_says_the_accepted_change_in_one_line(project, capsys):
    """``-q`` hides the progress and the summary, not what changes what the run means: the line
    naming the code ``--accept-changed`` went past is said, alone."""
    assert _run(capsys, '--until', 'requests=2')[0] == 0
    (project / 'rewards.py').write_text(REWARD.format(value=0.5))
    code, err = _run(capsys, '--resume', '--accept-changed', '-q')
    assert code == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('mtflow: --accept-changed: going on with changed code '
                                                   '(code.reward (rewards.py): "sha256:')
    assert lines[0].endswith('recorded in run.json')
    code, err = _run(capsys, '--resume', '-q')  # nothing accepted this time: -q says nothing
    assert code == 0 and err == ''
