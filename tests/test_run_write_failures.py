"""A finished request whose line cannot be written is never dropped in silence (a trajectory lost
with status ``complete`` and exit 0): the run fails naming the request, in lockstep and in
``--mode async`` (the streamed path never looked), what finished beside it is written, and
``--resume`` completes the run; a group a full disk held back keeps every line, those of
``interrupted.jsonl`` too; a gateway session whose line was refused gets a 500 on its finish, never
a summary of a trajectory that is not on disk."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from mtflow.cli import main
from mtflow.gateway import Gateway
from mtflow.run.store import RunDirError, RunStore, WriteRefused
from tests.gateway.helpers import TIMEOUT_S, lines, scripted
from tests.helpers import jsonl_lines

SCHEDULERS = '''
import os
from mtflow import Branching, Scheduler


class Forks(Scheduler):
    """Each request forks into two copies before turn 2 (its child is named <uuid>~1)."""
    branch = Branching(at={'turn': 2}, copies=2)

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= 2

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'more'})
        return {'infer_request': infer_request}


class TupleKeys(Scheduler):
    """While the file ``bad`` exists, request b's infos hold a dict with a tuple key (JSON has none)."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= 2

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'more'})
        bad = infer_request.uuid == 'b' and os.path.exists('bad')
        return {'infer_request': infer_request, 'rollout_infos': {'seen': {(1, 2): 3}} if bad else {}}
'''


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv('MTFLOW_DEBUG', raising=False)
    (tmp_path / 'scheds.py').write_text(SCHEDULERS)
    return tmp_path


def _config(project: Path, scheduler: str, uuids: list) -> str:
    (project / 'data.jsonl').write_text(''.join(json.dumps({'uuid': u, 'prompt': 'go'}) + '\n' for u in uuids))
    (project / 'run.yaml').write_text(f'scheduler: scheds.py:{scheduler}\nbackend: scripted\nbackend_options: '
                                      '{outputs: [a guess], cycle: true}\ndataset: data.jsonl\nout: out\n'
                                      'max_turns: 4\nbatch_size: 4\n')
    return 'run.yaml'


def _written(project: Path) -> list:
    return [t['uuid'] for t in jsonl_lines(project / 'out' / 'trajectories.jsonl')]


def _last_line(capsys) -> str:
    err = capsys.readouterr().err
    assert 'Traceback' not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize('mode', ['lockstep', 'async'])
def test_a_line_the_store_refuses_fails_the_run_naming_the_request(project, capsys, mode):
    """A dataset uuid ``p~1`` beside prompt ``p``, whose fork's child is ``p~1`` too: the second
    trajectory under that uuid was dropped (lockstep: before it reached the store; async: the
    store's refusal was never looked at), status complete, exit 0."""
    config = _config(project, 'Forks', ['p', 'p~1'])
    assert main(['run', config, '-q', '--mode', mode]) == 2
    assert _last_line(capsys) == ('mtflow: request p~1 could not be written: request p~1 is already written to '
                                  'out/trajectories.jsonl: a request is written once; the requests written before '
                                  'are whole')
    assert sorted(_written(project)) == ['p', 'p~1', 'p~1~1']  # the others are on disk, each once
    info = json.loads((project / 'out' / 'run.json').read_text())
    assert info['attempts'][-1]['status'] == 'failed' and not (project / 'out' / 'summary.json').exists()


@pytest.mark.parametrize('mode', ['lockstep', 'async'])
def test_a_value_json_cannot_hold_fails_the_run_naming_it_and_resume_completes(project, capsys, mode):
    config = _config(project, 'TupleKeys', ['a', 'b', 'c', 'd'])
    (project / 'bad').touch()
    assert main(['run', config, '-q', '--mode', mode]) == 2
    assert _last_line(capsys) == ('mtflow: request b could not be written: TypeError: keys must be str, int, float, '
                                  'bool or None, not tuple; the requests written before are whole')
    before = _written(project)
    assert 'b' not in before
    if mode == 'lockstep':  # what finished beside it is written (async: what had finished when the run stopped)
        assert sorted(before) == ['a', 'c', 'd']
    (project / 'bad').unlink()
    assert main(['run', config, '-q', '--mode', mode, '--resume']) == 0
    after = _written(project)
    assert after[:len(before)] == before and sorted(after) == ['a', 'b', 'c', 'd']
    assert json.loads((project / 'out' / 'summary.json').read_text())['status'] == 'complete'


def test_a_group_the_disk_held_back_keeps_its_interrupted_lines_too(tmp_path):
    store = RunStore.open(tmp_path / 'out', 'new', {'x': 1}, flush_every=100)
    store.write({'uuid': 'a', 'finish_reason': 'stop'}, [{'uuid': 'a', 'dst': 'finished'}])
    store.write_interrupted({'uuid': 'b', 'finish_reason': 'interrupted'}, [])
    (tmp_path / 'out' / 'interrupted.jsonl').mkdir()  # the file cannot be written, as on a full disk
    with pytest.raises(RunDirError, match='cannot write to'):
        store.flush()
    assert (tmp_path / 'out' / 'trajectories.jsonl').read_text() == ''  # cut back to the last whole group
    (tmp_path / 'out' / 'interrupted.jsonl').rmdir()
    store.close('interrupted')
    assert [t['uuid'] for t in jsonl_lines(tmp_path / 'out' / 'trajectories.jsonl')] == ['a']
    assert [t['uuid'] for t in jsonl_lines(tmp_path / 'out' / 'interrupted.jsonl')] == ['b']


def test_a_gateway_session_whose_line_is_refused_is_told_and_fails_the_gateway(tmp_path, monkeypatch):
    hello = {'model': 'm', 'messages': [{'role': 'user', 'content': 'hello'}]}
    with pytest.raises(RunDirError, match='request bad could not be written: the disk refused it'):
        with Gateway(scripted('fine'), tmp_path / 'run') as gw:
            write_together = gw.store.write_together  # what every finished line goes through

            def refusing(items):
                if any(record['uuid'] == 'bad' for record, _ in items):
                    raise WriteRefused('the disk refused it')
                return write_together(items)

            monkeypatch.setattr(gw.store, 'write_together', refusing)
            for session in ('bad', 'good'):
                assert httpx.post(f'{gw.url}/s/{session}/v1/chat/completions', json=hello,
                                  timeout=TIMEOUT_S).status_code == 200
            refused = httpx.post(f'{gw.url}/s/bad/finish', json={'reward': 1}, timeout=TIMEOUT_S)
            assert refused.status_code == 500 and refused.json()['error']['code'] == 'not_written'
            assert "session 'bad' could not be written: the disk refused it" in refused.json()['error']['message']
            good = httpx.post(f'{gw.url}/s/good/finish', json={'reward': 1}, timeout=TIMEOUT_S)
            assert good.status_code == 200 and good.json()['reward'] == 1.0
    assert [line['uuid'] for line in lines(tmp_path / 'run')] == ['good']
