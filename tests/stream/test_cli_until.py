"""``mtflow run`` through the streaming producer: ``--until groups=N`` writes exactly N complete
groups, ``--resume`` continues to the directory of an uninterrupted streamed run, and the stream
writes what the batch loop writes."""
from __future__ import annotations

import json
import textwrap

import pytest

from mtflow.cli import main
from tests.helpers import jsonl_lines, run_contents

SCHEDULER = '''
from mtflow import Scheduler


class Plays(Scheduler):
    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= int(infer_request.data_dict['turns'])

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': f'observation {current_turn}'})
        ids = response_choice.token_ids or []
        return {'infer_request': infer_request, 'response_token_ids': ids, 'response_loss_mask': [1] * len(ids)}
'''

TURNS = [2, 1, 3, 2, 1, 3, 2, 1, 3, 1]


@pytest.fixture(scope='module')
def project(tmp_path_factory):
    d = tmp_path_factory.mktemp('until')
    (d / 'sched.py').write_text(SCHEDULER)
    prompts = [{'uuid': f'p{i}', 'prompt': f'play {i}', 'turns': n} for i, n in enumerate(TURNS)]
    (d / 'prompts.jsonl').write_text(''.join(json.dumps(p) + '\n' for p in prompts))
    script = [{'uuid': f'p{i}', 'turn': t, 'content': f'p{i} says {t}', 'token_ids': [i, t, 7]}
              for i in range(len(TURNS)) for t in range(1, 5)]
    (d / 'script.jsonl').write_text(''.join(json.dumps(s) + '\n' for s in script))
    (d / 'run.yaml').write_text(textwrap.dedent('''\
        scheduler: sched.py:Plays
        backend: scripted
        model: script.jsonl
        dataset: prompts.jsonl
        out: out
        max_turns: 4
        batch_size: 4
        num_generations: 3
        '''))
    return d


def _run(project, *flags) -> int:
    return main(['run', str(project / 'run.yaml'), '-q', '--no-progress', *flags])


def _groups(out) -> dict:
    groups: dict = {}
    for line in jsonl_lines(out / 'trajectories.jsonl'):
        groups.setdefault(line['group'], []).append(line['uuid'])
    return groups


def _same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for uuid in a:
        x = {k: v for k, v in a[uuid].items() if k not in ('index', 'rank')}
        y = {k: v for k, v in b[uuid].items() if k not in ('index', 'rank')}
        assert x == y, uuid


def test_until_groups_writes_complete_groups_and_resume_continues(project, monkeypatch):
    monkeypatch.chdir(project)
    assert _run(project, '--mode', 'async', '--max-concurrency', '4', '--out', 'full') == 0
    full_t, full_e = run_contents(project / 'full')
    assert len(full_t) == 30 and all('policy_versions' in t['rollout_infos'] for t in full_t.values())

    assert _run(project, '--until', 'groups=4', '--max-concurrency', '4', '--out', 'part') == 0
    groups = _groups(project / 'part')
    assert len(groups) == 4 and all(len(m) == 3 for m in groups.values())
    run_json = json.loads((project / 'part' / 'run.json').read_text())
    assert run_json['attempts'][-1]['status'] == 'partial'

    assert _run(project, '--until', 'groups=2', '--max-concurrency', '4', '--out', 'part', '--resume') == 0
    assert len(_groups(project / 'part')) == 6
    assert _run(project, '--max-concurrency', '4', '--out', 'part', '--resume', '--mode', 'async') == 0
    part_t, part_e = run_contents(project / 'part')
    _same(part_t, full_t)
    for uuid, events in full_e.items():
        assert [(e['from'], e['to'], e['turn']) for e in events] == [(e['from'], e['to'], e['turn'])
                                                                      for e in part_e[uuid]]


def test_the_stream_writes_what_the_batch_loop_writes(project, monkeypatch):
    monkeypatch.chdir(project)
    assert _run(project, '--out', 'lock') == 0
    assert _run(project, '--mode', 'async', '--max-concurrency', '5', '--out', 'stream') == 0
    lock, _ = run_contents(project / 'lock')
    streamed, _ = run_contents(project / 'stream')
    for t in streamed.values():
        assert set(t['rollout_infos'].pop('policy_versions')) == {0}
    _same(streamed, lock)


def test_until_mistakes_are_one_line(project, monkeypatch, capsys):
    monkeypatch.chdir(project)
    assert main(['run', str(project / 'run.yaml'), '--until', 'turns=3', '--out', 'bad']) == 2
    assert 'KEY=N with KEY one of requests, groups, seconds, tokens' in capsys.readouterr().err
    assert not (project / 'bad').exists()
