"""SkyRL's text environments (``env: {skyrl_gym: ...}``, skyrl-gym 0.4) through ``mtflow run``
with the scripted model: every request's rewards equal what skyrl-gym's own environments give
when stepped directly with the same replies (a differential test), for two of its environments
that run offline (GSM8K and its multi-turn form); a request whose row lacks what the environment
asserts, or whose step raises, fails alone with the environment named."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

skyrl_gym = pytest.importorskip('skyrl_gym', reason="needs the 'skyrl-gym' extra")

from mtflow.cli import main

ROOT = Path(__file__).resolve().parents[2]

ROWS = [  # SkyRL's row format: the prompt, reward_spec, extra_info
    ('q1', 'Tom has 3 apples and buys 4 more. How many?', '7'),
    ('q2', 'What is 6 times 7?', '42'),
    ('q3', 'A week has how many days?', '7'),
    ('q4', 'What is 100 minus 1?', '99'),
]
#: the replies, by request and turn: right at once, right on the second try, never right, no format
REPLIES = {
    'q1': ['3 + 4 = 7\n#### 7'],
    'q2': ['I think #### 40', 'Let me redo it: #### 42'],
    'q3': ['#### 5', '#### 6', '#### 8'],
    'q4': ['ninety-nine', 'still ninety-nine', 'nope'],
}


def _reference(env_id, rows, max_turns):
    """skyrl-gym's own environments stepped directly with the same replies."""
    out = {}
    for uuid, question, truth in rows:
        extras = {'reward_spec': {'method': 'rule', 'ground_truth': truth}, 'extra_info': {}, 'max_turns': max_turns}
        env = skyrl_gym.make(env_id, env_config={}, extras=extras)
        env.init([{'role': 'user', 'content': question}])
        rewards = []
        for reply in REPLIES[uuid]:
            step = env.step(reply)
            rewards.append(step['reward'])
            if step['done']:
                break
        env.close()
        out[uuid] = rewards
    return out


def _run(tmp_path, env_id, max_turns):
    data = tmp_path / 'rows.jsonl'
    data.write_text(''.join(json.dumps({'uuid': u, 'messages': [{'role': 'user', 'content': q}],
                                        'reward_spec': {'method': 'rule', 'ground_truth': t}, 'extra_info': {},
                                        'max_turns': max_turns}) + '\n' for u, q, t in ROWS))
    script = tmp_path / 'model.jsonl'
    script.write_text(''.join(json.dumps({'uuid': u, 'turn': k + 1, 'content': text}) + '\n'
                              for u, texts in REPLIES.items() for k, text in enumerate(texts)))
    sched = tmp_path / 's.yaml'
    sched.write_text((ROOT / 'schedulers' / 'skyrl_gsm8k.yaml').read_text().replace('id: gsm8k_multi_turn',
                                                                                     f'id: {env_id}'))
    (tmp_path / 'run.yaml').write_text(textwrap.dedent(f'''\
        scheduler: {sched}
        backend: scripted
        model: {script}
        dataset: {data}
        out: out
        max_turns: 5
        batch_size: 4
        '''))
    assert main(['run', str(tmp_path / 'run.yaml'), '--no-progress']) == 0
    lines = [json.loads(l) for l in (tmp_path / 'out' / 'trajectories.jsonl').read_text().splitlines()]
    return {t['uuid']: t for t in lines}


@pytest.mark.parametrize('env_id, max_turns', [('gsm8k', 1), ('gsm8k_multi_turn', 3)])
def test_rewards_are_skyrl_gyms_own_for_the_same_replies(tmp_path, monkeypatch, env_id, max_turns):
    monkeypatch.chdir(tmp_path)
    runs = _run(tmp_path, env_id, max_turns)
    reference = _reference(env_id, ROWS, max_turns)
    assert {u: t['rollout_infos']['rewards'] for u, t in runs.items()} == reference
    assert {u: t['reward'] for u, t in runs.items()} == {u: sum(r) for u, r in reference.items()}
    assert len({sum(r) for r in reference.values()}) > 1  # the comparison can fail
    assert all(t['finish_reason'] == 'stop_rule:env_done' for t in runs.values())
    if env_id == 'gsm8k_multi_turn':  # the environment's own follow-up is the next message
        assert 'ANSWER' in runs['q2']['messages'][3]['content'] and runs['q2']['num_turns'] == 2


def test_a_row_the_environment_rejects_fails_that_request_alone(tmp_path, monkeypatch):
    from mtflow import Executor
    from mtflow.declarative import load_scheduler
    from tests.helpers import out, req
    sched = load_scheduler(ROOT / 'schedulers' / 'skyrl_gsm8k.yaml')
    good = req('good', {'role': 'user', 'content': 'What is 6 times 7?'},
               data_dict={'reward_spec': {'ground_truth': '42'}, 'extra_info': {}})
    bad = req('bad', {'role': 'user', 'content': 'x'}, data_dict={'extra_info': {}})
    result = Executor(sched, lambda rs, rc=None: [out('#### 42') for _ in rs], max_turns=3, on_error='return').run(
        [good, bad])
    assert result.finish_reasons == ['stop_rule:env_done', 'error']
    assert result.outputs[0].rollout_infos['rewards'] == [1.0]
    (failure, ) = result.failures
    assert failure.uuid == 'bad' and str(failure.error) == (
        "skyrl-gym environment 'gsm8k_multi_turn' failed at reset (make and init): AssertionError: "
        'reward_spec.ground_truth is required')


def test_unknown_id_is_a_config_error_with_the_registered_ones():
    from mtflow.declarative import ConfigError, load_scheduler
    with pytest.raises(ConfigError, match=r"env.skyrl_gym: cannot create environment 'gsm9k'.*registered: .*gsm8k"):
        load_scheduler({'env': {'skyrl_gym': {'id': 'gsm9k'}}})
