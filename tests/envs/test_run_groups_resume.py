"""A reasoning-gym run config with ``num_generations`` through the streaming ``mtflow run``
(issue 11's run store): a run cut short and resumed equals one uninterrupted run, trajectories,
trace events and the per-group reward spread alike (the spread is a running tally, rebuilt from
the files an earlier attempt wrote); the fingerprint covers the generated dataset's spec."""
from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest

pytest.importorskip('reasoning_gym', reason="needs the 'reasoning-gym' extra")

from mtflow.cli import main
from mtflow.data.reasoning_gym import ReasoningGymSpec
from mtflow.data.sources import count_requests, iter_requests
from tests.helpers import run_contents

ROOT = Path(__file__).resolve().parents[2]
EASY = {'min_terms': 2, 'max_terms': 2, 'min_digits': 1, 'max_digits': 1, 'operators': ['+', '-'],
        'allow_parentheses': False, 'allow_negation': False}
DATASET = {'reasoning_gym': {'name': 'basic_arithmetic', 'size': 4, 'seed': 3, 'config': EASY}}
N = 3
#: which copies answer right, per task: rewards 1/3, 1, 0, 2/3 per group
RIGHT = {0: {0}, 1: {0, 1, 2}, 2: set(), 3: {1, 2}}


def _write_project(d: Path, dataset=DATASET, num_generations=N) -> None:
    spec = ReasoningGymSpec(**DATASET['reasoning_gym'])
    lines = []
    for r in iter_requests({'reasoning_gym': spec.model_dump()}, None, None, N):
        index, k = r.data_dict['reasoning_gym']['index'], int(r.uuid.rpartition('#')[2])
        answer = r.data_dict['answer'] if k in RIGHT[index] else str(int(r.data_dict['answer']) + 1)
        # keyed by uuid and turn: each request gets the same replies whichever attempt runs it
        lines += [{'uuid': r.uuid, 'turn': t, 'content': f'<answer>{answer}</answer>'} for t in (1, 2)]
    (d / 'script.jsonl').write_text(''.join(json.dumps(line) + '\n' for line in lines))
    (d / 'run.yaml').write_text(textwrap.dedent(f'''\
        scheduler: {ROOT / 'schedulers' / 'reasoning_gym.yaml'}
        backend: scripted
        model: script.jsonl
        dataset: {json.dumps(dataset)}
        num_generations: {num_generations}
        max_turns: 2
        batch_size: 4
        '''))


def _expected_groups():
    groups = []
    for index in range(4):
        rewards = [1.0 if k in RIGHT[index] else 0.0 for k in range(N)]
        mean = sum(rewards) / N
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / N)
        groups.append({'group': f'basic_arithmetic-3-{index}', 'n': N, 'mean': round(mean, 4), 'std': round(std, 4),
                       'min': min(rewards), 'max': max(rewards)})
    return groups


def test_count_and_stream_a_generated_dataset_in_groups():
    assert count_requests(DATASET, None, None, N) == 12 and count_requests(DATASET, None, 2, N) == 6
    uuids = [r.uuid for r in iter_requests(DATASET, None, 2, N)]
    assert uuids == [f'basic_arithmetic-3-{i}#{k}' for i in range(2) for k in range(N)]


def test_cut_short_then_resumed_equals_one_run_with_the_same_group_spread(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _write_project(tmp_path)
    assert main(['run', 'run.yaml', '--out', 'whole', '-q']) == 0
    whole = run_contents(tmp_path / 'whole')
    summary = json.loads((tmp_path / 'whole' / 'summary.json').read_text())
    spread = summary['reward_groups']
    expected = _expected_groups()
    assert spread['per_group'] == expected
    assert spread['groups'] == 4 and spread['group_sizes'] == [N] and spread['with_spread'] == 2
    assert spread['requests_rewarded'] == 6 and spread['requests_scored'] == 12
    assert spread['mean_std'] == round(sum(g['std'] for g in expected) / 4, 4) == 0.2357
    assert summary['reward_mean'] == 0.5 and summary['requests'] == 12

    # the same run, "killed" after 5 whole trajectories and half of the 6th: what a SIGKILL in the
    # middle of a write leaves (the store's --resume drops the torn line and its orphaned events)
    assert main(['run', 'run.yaml', '--out', 'cut', '-q']) == 0
    path = tmp_path / 'cut' / 'trajectories.jsonl'
    lines = path.read_text().splitlines(True)
    path.write_text(''.join(lines[:5]) + lines[5][:len(lines[5]) // 2])
    (tmp_path / 'cut' / 'summary.json').unlink()
    assert main(['run', 'run.yaml', '--out', 'cut', '--resume', '-q']) == 0
    assert run_contents(tmp_path / 'cut') == whole
    resumed = json.loads((tmp_path / 'cut' / 'summary.json').read_text())
    assert resumed['resumed_from'] == 5 and resumed['written'] == 12
    assert resumed['reward_groups'] == spread  # rebuilt from the 5 kept lines, then fed the other 7

    # a second --resume of the complete run runs nothing and reports the same spread
    monkeypatch.setenv('COLUMNS', '240')  # the summary table on one line per row
    assert main(['run', 'run.yaml', '--out', 'cut', '--resume', '--no-progress']) == 0
    shown = ' '.join(capsys.readouterr().out.split())
    assert '2 of 4 groups (size 3) have unequal rewards; mean group std 0.2357' in shown
    assert 'basic_arithmetic-3-0 0.3333±0.4714' in shown
    again = json.loads((tmp_path / 'cut' / 'summary.json').read_text())
    assert again['reward_groups'] == spread and again['rollout_fn_calls'] == 0
    assert run_contents(tmp_path / 'cut') == whole


@pytest.mark.parametrize('change, named', [
    ({'dataset': {'reasoning_gym': {**DATASET['reasoning_gym'], 'seed': 4}}}, 'config.dataset'),
    ({'num_generations': 2}, 'config.num_generations'),
])
def test_resume_with_another_generated_dataset_or_group_size_is_refused(tmp_path, monkeypatch, capsys, change,
                                                                         named):
    monkeypatch.chdir(tmp_path)
    _write_project(tmp_path)
    assert main(['run', 'run.yaml', '--out', 'out', '-q', '--limit', '1']) == 0
    before = (tmp_path / 'out' / 'trajectories.jsonl').read_text()
    _write_project(tmp_path, **change)
    assert main(['run', 'run.yaml', '--out', 'out', '-q', '--limit', '1', '--resume']) != 0
    err = capsys.readouterr().err
    assert 'cannot resume' in err and named in err, err
    assert (tmp_path / 'out' / 'trajectories.jsonl').read_text() == before


@pytest.mark.slow
def test_ray_fan_out_of_a_generated_dataset_in_groups_equals_the_local_run(tmp_path, monkeypatch):
    """``--ray 2`` streams the same generated requests (issue 13's fan-out reads the dataset
    through the same iterator): the same trajectories and the same group spread."""
    pytest.importorskip('ray')
    monkeypatch.chdir(tmp_path)
    _write_project(tmp_path)
    assert main(['run', 'run.yaml', '--out', 'local', '-q']) == 0
    assert main(['run', 'run.yaml', '--out', 'ray', '--ray', '2', '-q']) == 0
    local, _ = run_contents(tmp_path / 'local')
    fanned, _ = run_contents(tmp_path / 'ray')
    strip = lambda ts: {u: {k: v for k, v in t.items() if k != 'rank'} for u, t in ts.items()}  # noqa: E731
    assert strip(fanned) == strip(local) and len(local) == 12
    groups = [json.loads((tmp_path / d / 'summary.json').read_text())['reward_groups'] for d in ('local', 'ray')]
    assert groups[0] == groups[1] and groups[0]['per_group'] == _expected_groups()
