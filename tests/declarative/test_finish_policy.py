"""The finish-reason policy on each finish reason, applied in one place (the scheduler's
``finalize_output`` hook, which the executor calls on every finish path) and recorded in
``rollout_infos['mtflow_policy']`` and in ``mtflow run``'s summary."""
from __future__ import annotations

import asyncio

import pytest

from mtflow import Executor, RolloutInterrupted
from mtflow.declarative import ConfigError, load_scheduler, validate_file
from mtflow.declarative.policy import FinishPolicy, apply_policy, summarize_policy
from mtflow.core.protocol import RolloutOutput
from tests.helpers import Scripted, req

from .util import ids_of, model_out, tok

ME = __name__

POLICY = {
    'length': 'mask',
    'max_turns': {'reward': 0.0},
    'error': 'drop',
    'timeout': {'drop': True, 'mask': True},
    'interrupted': 'drop',
    'stop_rule:*': 'keep',
    'tool_error:timeout': {'reward': -1.0},
    'default': {'reward': 0.5},
}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
BAD_CALL = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'


async def slow(x: str) -> str:
    """Sleep past the timeout."""
    await asyncio.sleep(5)
    return x


def reward(infer_request, infos):
    return 7.0


def scheduler(**kw):
    cfg = {'name': 'policy', 'tools': [{'name': 'calculator'}], 'finish_policy': POLICY, 'reward': f'{ME}:reward',
           'max_turns': 5}
    cfg.update(kw)
    return load_scheduler(cfg, tokenizer=tok())


def run(s, script, **kw):
    rollout = Scripted({u: [model_out(t) if isinstance(t, str) else t for t in texts] for u, texts in script.items()})
    return Executor(s, rollout, **kw).run([req(u) for u in script])


def test_stop_rule_star_keeps_and_records():
    res = run(scheduler(), {'a': ['The answer is 2.']})
    o = res.outputs[0]
    assert res.finish_reasons == ['stop_rule:no_tool_call']
    assert o.rollout_infos['mtflow_policy'] == {'rule': 'stop_rule:*', 'action': 'keep',
                                                'finish_reason': 'stop_rule:no_tool_call'}
    assert o.rollout_infos['reward'] == 7.0 and 'mtflow_drop' not in o.rollout_infos
    assert o.response_loss_mask == [[1] * len(ids_of('The answer is 2.'))]


def test_the_policy_record_is_on_the_finish_event_of_the_trace():
    res = run(scheduler(), {'a': ['The answer is 2.']})
    (finish, ) = [e for e in res.trace.events if e.dst == 'finished']
    assert finish.extra == {'finish_policy': res.outputs[0].rollout_infos['mtflow_policy']}


def interrupted_run():
    """One request interrupted by Ctrl-C in its second rollout_fn call: the RunResult so far."""
    calls = []

    def rollout(requests, config):
        calls.append(len(requests))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return [model_out(CALL) for _ in requests]

    with pytest.raises(RolloutInterrupted) as info:
        Executor(scheduler(), rollout).run([req('a')])
    return info.value.result


def test_interrupted_policy_is_on_the_finish_event_too():
    (finish, ) = [e for e in interrupted_run().trace.events if e.dst == 'finished']
    assert finish.extra['finish_policy']['rule'] == 'interrupted'


def test_length_masks_the_whole_trajectory():
    res = run(scheduler(), {'a': [CALL, model_out('Still thinking and', finish_reason='length')]})
    o = res.outputs[0]
    assert res.finish_reasons == ['length']
    assert o.response_token_ids and all(v == 0 for seg in o.response_loss_mask for v in seg)
    assert [len(s) for s in o.response_loss_mask] == [len(s) for s in o.response_token_ids]
    assert o.rollout_logprobs == []  # logprobs pair with trained tokens; none are left
    assert o.rollout_infos['mtflow_policy']['action'] == 'mask'


def test_max_turns_sets_the_reward_and_keeps_the_previous_one():
    res = run(scheduler(max_turns=1), {'a': [CALL]})
    o = res.outputs[0]
    assert res.finish_reasons == ['max_turns']
    assert o.rollout_infos['reward'] == 0.0
    assert o.rollout_infos['mtflow_policy'] == {'rule': 'max_turns', 'action': 'reward=0', 'finish_reason': 'max_turns',
                                                'previous_reward': 7.0}


def test_error_is_dropped():
    res = run(scheduler(tool_errors='finish'), {'a': [BAD_CALL], 'b': ['fine']}, on_error='return')
    assert res.finish_reasons == ['error', 'stop_rule:no_tool_call']
    assert res.outputs[0].rollout_infos['mtflow_drop'] is True
    assert res.outputs[0].rollout_infos['mtflow_policy']['rule'] == 'error'
    assert 'mtflow_drop' not in res.outputs[1].rollout_infos


def test_tool_error_kind_rule():
    s = scheduler(tools=[{'name': 'slow', 'impl': f'{ME}:slow', 'timeout_s': 0.05}],
                  finish_policy={'tool_error:timeout': {'reward': -1.0}, 'tool_error:*': 'drop'})
    res = run(s, {'a': ['<tool_call>{"name": "slow", "arguments": {"x": "1"}}</tool_call>', 'gave up']})
    o = res.outputs[0]
    assert o.rollout_infos['tool_error_kinds'] == {'timeout': 1}
    assert o.rollout_infos['reward'] == -1.0 and o.rollout_infos['mtflow_policy']['rule'] == 'tool_error:timeout'


def test_interrupted_is_dropped():
    result = interrupted_run()
    (o, ) = result.outputs
    assert result.finish_reasons == ['interrupted']
    assert o.rollout_infos['mtflow_drop'] is True and o.rollout_infos['mtflow_policy']['rule'] == 'interrupted'


@pytest.mark.parametrize('reason,rule,action', [
    ('timeout', 'timeout', 'mask+drop'),
    ('done_by_hook', 'tool_error:timeout', 'reward=-1'),
    ('stop_rule:final_answer', 'stop_rule:*', 'keep'),
])
def test_pure_policy_on_the_other_reasons(reason, rule, action):
    out = RolloutOutput(response_token_ids=[[1, 2], [3]], response_loss_mask=[[1, 1], [1]],
                        rollout_logprobs=[[-0.1, -0.2], [-0.3]], rollout_infos={'tool_error_kinds': {'timeout': 1}})
    apply_policy(FinishPolicy(POLICY), out, reason)
    assert out.rollout_infos['mtflow_policy']['rule'] == rule and out.rollout_infos['mtflow_policy']['action'] == action
    if 'mask' in action:
        assert out.response_loss_mask == [[0, 0], [0]] and out.rollout_logprobs == []
    assert summarize_policy([out.rollout_infos]) == {f'{rule} -> {action}': 1, 'dropped': int('drop' in action)}


def test_exact_reason_wins_over_tool_error_rule():
    out = RolloutOutput(rollout_infos={'tool_error_kinds': {'timeout': 2}})
    apply_policy(FinishPolicy({'tool_error:timeout': 'drop', 'length': 'mask'}), out, 'length')
    assert out.rollout_infos['mtflow_policy']['rule'] == 'length' and 'mtflow_drop' not in out.rollout_infos


def test_bad_policies_are_reported_with_lines(tmp_path):
    f = tmp_path / 'p.yaml'
    f.write_text('name: p\ntools: [{name: calculator}]\nfinish_policy:\n  lenght: mask\n  length: trim\n'
                 '  "tool_error:o o": drop\n  "stop_rule:final": keep\n  max_turns: {reward: high}\n')
    got = {(p.line, p.path): p.message for p in validate_file(f)}
    assert 'unknown finish reason' in got[(4, 'finish_policy.lenght')]
    assert "'keep', 'mask' or 'drop'" in got[(5, 'finish_policy.length')]
    assert 'is not a name' in got[(6, 'finish_policy.tool_error:o o')]
    assert "no stop rule 'final'" in got[(7, 'finish_policy.stop_rule:final')]
    assert any(k[0] == 8 and 'valid number' in v for k, v in got.items())
    with pytest.raises(ConfigError):
        load_scheduler(str(f))


def test_default_rule_when_nothing_else_matches():
    out = RolloutOutput(rollout_infos={})
    apply_policy(FinishPolicy(POLICY), out, 'done_by_hook')
    assert out.rollout_infos['mtflow_policy']['rule'] == 'default' and out.rollout_infos['reward'] == 0.5


def test_mtflow_run_summary_counts_what_the_policy_did(tmp_path, monkeypatch):
    import json

    from mtflow.cli import main as cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / 's.yaml').write_text('name: p\nmax_turns: 3\ntools: [{name: calculator}]\nfinish_policy: {length: mask, '
                                     '"stop_rule:*": keep}\n')
    (tmp_path / 'p.jsonl').write_text(''.join(json.dumps({'uuid': f'u{i}', 'prompt': 'hi'}) + '\n' for i in range(3)))
    (tmp_path / 'script.jsonl').write_text(
        json.dumps({'uuid': 'u0', 'content': 'cut', 'finish_reason': 'length'}) + '\n' +
        json.dumps({'uuid': 'u1', 'content': 'done'}) + '\n' + json.dumps({'uuid': 'u2', 'content': 'done'}) + '\n')
    (tmp_path / 'run.yaml').write_text('scheduler: s.yaml\nbackend: scripted\nmodel: script.jsonl\ndataset: p.jsonl\n'
                                       'out: out\n')
    assert cli(['run', 'run.yaml', '-q']) == 0
    summary = json.loads((tmp_path / 'out' / 'summary.json').read_text())
    assert summary['finish_policy'] == {'length -> mask': 1, 'stop_rule:* -> keep': 2, 'dropped': 0}
    lines = [json.loads(l) for l in (tmp_path / 'out' / 'trajectories.jsonl').read_text().splitlines()]
    assert [l['rollout_infos']['mtflow_policy']['rule'] for l in lines] == ['length', 'stop_rule:*', 'stop_rule:*']


def test_timeout_through_the_executor_deadline():
    """A step that misses the executor's deadline finishes with 'timeout'; the policy sees it."""
    s = scheduler(tools=[{'name': 'slow', 'impl': f'{ME}:slow'}])
    res = run(s, {'a': ['<tool_call>{"name": "slow", "arguments": {"x": "1"}}</tool_call>'], 'b': ['fine']},
              on_error='return', step_timeout_s=0.5)
    assert res.finish_reasons == ['timeout', 'stop_rule:no_tool_call']
    o = res.outputs[0]
    assert o.rollout_infos['mtflow_policy']['rule'] == 'timeout' and o.rollout_infos['mtflow_drop'] is True
    assert all(v == 0 for seg in o.response_loss_mask for v in seg)
