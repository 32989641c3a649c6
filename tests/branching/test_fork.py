"""The ``fork`` move and the branching policy, through every driver: where requests fork, what the
children share and copy, the leaf budget, the trace, and the failures that stay with one request."""
from __future__ import annotations

import pytest

from mtflow import Branching, Executor
from mtflow.accounting.token_record import TokenRecord, TokenTurn
from mtflow.core.errors import ForkRefused, IllegalTransition
from mtflow.core.machine import FINISHED, GENERATING, RequestRecord, StateGraph
from tests.branching.helpers import ToolLoop, model, reply_ids
from tests.helpers import dump, out, req

MODES = ({}, {'mode': 'async'}, {'mode': 'async', 'max_concurrency': 1})


def run(branch, mode=None, n=2, max_turns=3, scheduler=None, rollout=model, **kw):
    requests = [req(f'r{i}') for i in range(n)]
    ex = Executor(scheduler or ToolLoop(), rollout, max_turns=max_turns, branch=branch, on_error='return',
                  **(mode or {}), **kw)
    return ex.run(requests), requests


@pytest.mark.parametrize('mode', MODES)
def test_a_fork_at_turn_2_makes_children_that_share_the_history_and_answer_apart(mode):
    result, requests = run({'at': {'turn': 2}, 'copies': 3}, mode)
    uuids = [r.uuid for r in requests]
    assert sorted(uuids) == ['r0', 'r0~1', 'r0~2', 'r1', 'r1~1', 'r1~2']
    assert len(result.outputs) == len(requests) == 6  # outputs[i] answers requests[i]
    by_uuid = {r.uuid: o for r, o in zip(requests, result.outputs)}
    parent, child = by_uuid['r0'], by_uuid['r0~1']
    # turn 1 (and its tool result) is the parent's, generated once; turns 2 and 3 are the child's own
    assert child.messages[:3] == parent.messages[:3]
    assert child.messages[2]['content'] == 'result 1 for r0'
    assert child.messages[3]['content'] == 'r0~1 turn 2' and parent.messages[3]['content'] == 'r0 turn 2'
    assert child.response_token_ids[0] == parent.response_token_ids[0] == reply_ids('r0', 1)
    assert child.response_token_ids[1] == reply_ids('r0~1', 2)
    assert all(r == 'max_turns' for r in result.finish_reasons)
    # the trace shows the fork on the parent (its children) and on each child (its parent)
    parent_fork = [e for e in result.trace.for_request('r0') if e.trigger == 'fork']
    assert [(e.turn, e.src, e.dst, e.extra) for e in parent_fork] == [(2, GENERATING, GENERATING,
                                                                       {'children': ['r0~1', 'r0~2']})]
    child_events = result.trace.for_request('r0~2')
    assert (child_events[0].trigger, child_events[0].src, child_events[0].extra) == ('fork', GENERATING,
                                                                                     {'parent': 'r0'})
    assert result.trace.states('r0~2') == ['generating', 'generating', 'tool_step', 'generating', 'finished']
    # generated once: 2 roots x 1 turn + 6 leaves x 2 turns
    assert sum(e.tokens or 0 for e in result.trace if e.src == GENERATING) == 3 * (2 + 12)


def test_the_children_share_the_token_record_and_its_turns():
    """The shared prefix is held once: a child's request carries its parent's record object (the
    backend gives each request a new record per turn, keeping the earlier turns' objects)."""
    seen = {}

    def rollout(requests, request_config=None):
        for r in requests:
            seen.setdefault(r.uuid, []).append(r.token_record)
            prev = r.token_record
            turns = list(prev.turns) if prev is not None else []
            turns.append(TokenTurn(prompt_len=len(turns), sampled=[len(turns)]))
            r.token_record = TokenRecord(turns=turns)
        return model(requests)

    run({'at': {'turn': 2}, 'copies': 2}, n=1, rollout=rollout)
    assert seen['r0~1'][0] is seen['r0'][1]  # the child's first call carries the parent's record
    assert seen['r0~1'][0].turns[0] is seen['r0'][1].turns[0]


@pytest.mark.parametrize('mode', MODES)
def test_a_fork_at_tool_step_shares_the_turn_and_runs_each_branch_step(mode):
    sched = ToolLoop()
    result, requests = run({'at': {'turn': 2, 'state': 'tool_step'}, 'copies': 2}, mode, n=1, scheduler=sched)
    by_uuid = {r.uuid: o for r, o in zip(requests, result.outputs)}
    parent, child = by_uuid['r0'], by_uuid['r0~1']
    assert parent.messages[3] == child.messages[3] == {'role': 'assistant', 'content': 'r0 turn 2'}
    assert parent.messages[4]['content'] == 'result 2 for r0' and child.messages[4]['content'] == 'result 2 for r0~1'
    assert sched.forks == [('r0', ['r0~1'], 2)]
    [node] = [n for n in result.trees[0]['nodes'] if n['uuid'] == 'r0~1']
    assert node['turns'] == [3, 3]  # its own turns start after the shared one


@pytest.mark.parametrize('mode', MODES)
def test_the_leaf_budget_gives_exactly_n_leaves(mode):
    """r0 forks at turn 2 (budget 5 split 3/2; ``at`` names turn 2 only, so neither forks again):
    when they finish, the 2 + 1 leaves they did not spend are copies of the prompt; r1 finishes at
    turn 1 and gives its 4 back at once. The copies are numbered after the children the root could
    have forked (budget - 1), whichever record's budget they came from."""
    sched = ToolLoop(stop_at={'r1': 1})
    result, requests = run(Branching(at={'turn': 2}, copies=2, leaves=5), mode, scheduler=sched)
    trees = {t['root']: t for t in result.trees}
    assert [len(t['leaves']) for t in result.trees] == [5, 5]
    assert trees['r0']['forks'][0] == {'parent': 'r0', 'children': ['r0~1'], 'turn': 2, 'state': 'generating'}
    assert trees['r0']['forks'][1] == {'parent': 'r0', 'children': ['r0~5', 'r0~6', 'r0~7'], 'turn': 0,
                                       'state': 'pending', 'top_up': True} and trees['r0']['topped_up'] == 3
    assert trees['r1']['topped_up'] == 4 and trees['r1']['forks'] == [
        {'parent': 'r1', 'children': ['r1~5', 'r1~6', 'r1~7', 'r1~8'], 'turn': 0, 'state': 'pending', 'top_up': True}]
    # r1's copies started in the turn r1 finished, not after the rest of its tree
    assert result.trace.for_request('r1~5')[0].t <= result.trace.for_request('r1')[-1].t + 1.0
    by_uuid = {r.uuid: (o, reason) for r, o, reason in zip(requests, result.outputs, result.finish_reasons)}
    # a top-up copy plays the prompt from turn 1 (on_trajectory_start and all), under its own uuid
    copy, reason = by_uuid['r1~6']
    assert copy.messages[1]['content'] == 'r1~6 turn 1' and reason == 'max_turns'
    assert result.trace.states('r1~6')[:3] == ['pending', 'pending', 'generating']
    assert by_uuid['r1'][1] == 'done_by_hook'


def test_a_record_whose_budget_is_one_never_forks():
    result, requests = run(Branching(at={'tool_calls': True}, copies=3, leaves=4), n=1, max_turns=4)
    tree = result.trees[0]
    # turn 2: r0 (budget 4) -> r0, r0~1, r0~2 with 2, 1, 1; turn 3: r0 (2) -> r0, r0~3; the others never fork
    assert [(f['parent'], f['children'], f['turn']) for f in tree['forks']] == [
        ('r0', ['r0~1', 'r0~2'], 2), ('r0', ['r0~3'], 3)]
    assert len(tree['leaves']) == 4 and tree['topped_up'] == 0


def test_tool_calls_forks_only_after_a_step_that_ran_tools():
    class SomeTools(ToolLoop):
        def step(self, infer_request, response_choice, current_turn):
            if current_turn == 2:  # a plain user message: no tool ran
                infer_request.messages.append({'role': 'user', 'content': 'go on'})
                return {'infer_request': infer_request}
            return super().step(infer_request, response_choice, current_turn)

    result, _ = run(Branching(at='tool_calls', copies=2, leaves=3), n=1, max_turns=4, scheduler=SomeTools())
    assert [f['turn'] for f in result.trees[0]['forks']] == [2, 4]  # not 3: its step ran no tool


def test_entropy_forks_where_the_last_turn_was_uncertain():
    def rollout(requests, request_config=None):
        outs = []
        for r in requests:
            turn = 1 + sum(1 for m in r.messages if m['role'] == 'assistant')
            lp = -2.0 if turn == 2 else -0.1  # turn 2 is uncertain
            outs.append(out(f'{r.uuid} {turn}', [turn, 7], [lp, lp]))
        return outs

    result, _ = run({'at': {'entropy': {'above': 1.0}}, 'copies': 2}, n=1, max_turns=4, rollout=rollout)
    assert [(f['turn'], f['parent']) for f in result.trees[0]['forks']] == [(3, 'r0')]
    result, _ = run({'at': {'entropy': {'rise': 1.5}}, 'copies': 2}, n=1, max_turns=4, rollout=rollout)
    assert [f['turn'] for f in result.trees[0]['forks']] == [3]  # 2.0 - 0.1 >= 1.5 over the first turn


def test_entropy_without_logprobs_fails_that_request_with_a_clear_error():
    def rollout(requests, request_config=None):
        return [out('x', [1, 2]) for _ in requests]

    result, requests = run({'at': {'entropy': 1.0}, 'copies': 2}, n=2, rollout=rollout)
    assert result.finish_reasons == ['error', 'error']
    failure = result.failures[0]
    assert failure.phase == 'fork' and isinstance(failure.error, ForkRefused)
    assert 'logprobs' in str(failure.error) and 'branch.at.entropy' in str(failure.error) and 'turn 1' in str(
        failure.error)


def test_a_hook_chooses_the_branches_and_its_failure_stays_with_its_request():
    calls = []

    def hook(infer_request, state, turn):
        calls.append((infer_request.uuid, state, turn))
        if infer_request.uuid == 'r1':
            raise RuntimeError('no decision')
        return 3 if turn == 3 else None

    result, requests = run({'at': {'hook': hook}, 'copies': 2}, n=2)
    assert ('r0', 'generating', 2) in calls and ('r0', 'generating', 3) in calls
    reasons = dict(zip([r.uuid for r in requests], result.finish_reasons))
    assert reasons == {'r0': 'max_turns', 'r1': 'error', 'r0~1': 'max_turns', 'r0~2': 'max_turns'}
    [failure] = result.failures
    assert failure.uuid == 'r1' and failure.phase == 'fork' and 'no decision' in str(failure.error)


def test_a_refused_fork_fails_its_request_only_and_names_the_state():
    class Refuses(ToolLoop):
        def on_fork(self, infer_request, children, current_turn):
            if infer_request.uuid == 'r0':
                raise ForkRefused('environment Dice cannot be copied', uuid=infer_request.uuid, turn=current_turn,
                                  field='env')

    result, requests = run({'at': {'turn': 2}, 'copies': 2}, n=2, scheduler=Refuses())
    reasons = dict(zip([r.uuid for r in requests], result.finish_reasons))
    assert reasons == {'r0': 'error', 'r1': 'max_turns', 'r1~1': 'max_turns'}
    [failure] = result.failures
    message = str(failure.error)
    assert failure.phase == 'fork' and failure.turn == 2
    assert 'environment Dice' in message and "state 'generating'" in message and 'request r0' in message


def test_the_graph_refuses_a_fork_out_of_finished():
    graph = StateGraph()
    rec = RequestRecord(0, 'done', None)
    graph.move(rec, 'fail', 1)
    assert rec.state == FINISHED
    with pytest.raises(IllegalTransition, match="'fork' from state 'finished'"):
        graph.fork(rec, [RequestRecord(1, 'done~1', None)], 1)


@pytest.mark.parametrize('bad, match', [
    ({'at': {'turns': 2}}, "unknown key.*'turns'"),
    ({'at': {'turn': 0}}, 'turn must be an int >= 1'),
    ({'at': {'turn': 2}, 'copies': 1}, 'copies must be an int >= 2'),
    ({'at': {'turn': 2}, 'leaves': 0}, 'leaves must be an int >= 1'),
    ({'at': {'state': 'tool_step', 'tool_calls': True}}, 'state must be generating'),
    ({'at': {'entropy': {'over': 1}}}, 'entropy must be a number or a dict'),
    ({'at': {}}, 'say where to fork'),
    ({'at': {'turn': 2}, 'copy': 3}, "unknown key.*'copy'"),
])
def test_a_bad_branching_is_refused_when_the_executor_is_built(bad, match):
    with pytest.raises(ValueError, match=match):
        Executor(ToolLoop(), model, branch=bad)


def test_branching_refuses_given_first_turn_outputs():
    ex = Executor(ToolLoop(), model, max_turns=2, branch={'at': {'turn': 2}})
    with pytest.raises(ValueError, match='first_turn_outputs'):
        ex.run([req('a')], [out('x', [1])])


def test_a_stream_delivers_each_tree_as_one_group():
    ex = Executor(ToolLoop(stop_at={'b': 1}), model, max_turns=3, mode='async',
                  branch=Branching(at={'turn': 2}, copies=2, leaves=3))
    groups = list(ex.stream([[req('a')], [req('b')]], max_staleness=0, max_concurrency=2))
    by_root = {g.trees[0]['root']: g for g in groups}
    assert sorted(by_root['a'].uuids) == ['a', 'a~1', 'a~3'] and sorted(by_root['b'].uuids) == ['b', 'b~3', 'b~4']
    assert by_root['a'].trees[0]['forks'][0]['children'] == ['a~1']
    assert all(len(g.outputs) == len(g.events) == 3 for g in groups)


def test_without_branching_nothing_changes():
    plain, requests = run(None, n=2)
    assert [r.uuid for r in requests] == ['r0', 'r1'] and plain.trees == []
    assert not [e for e in plain.trace if e.trigger == 'fork']
    again, _ = run(None, mode={'mode': 'async'}, n=2)
    assert dump(again.outputs) == dump(plain.outputs)


def test_a_partial_rollout_hands_the_children_back_and_resuming_them_gives_the_full_run():
    branch = Branching(at={'turn': 2}, copies=3)
    ex = Executor(ToolLoop(), model, max_turns=3, mode='async', max_concurrency=2, branch=branch)
    requests = [req('a'), req('b')]
    first = ex.run(requests, until={'finished': 1})
    back = {u.uuid: u.state for u in first.unfinished}
    assert any('~' in uuid for uuid in back) and all(state == GENERATING for state in back.values())
    second = ex.run(first.unfinished)
    assert second.ok and not second.unfinished
    got = {r.uuid: o for r, o in zip(requests, first.outputs) if o is not None}
    got.update(zip(back, second.outputs))
    full_requests = [req('a'), req('b')]
    full = Executor(ToolLoop(), model, max_turns=3, branch=branch).run(full_requests)
    assert sorted(got) == sorted(r.uuid for r in full_requests)
    assert all(dump([got[r.uuid]]) == dump([o]) for r, o in zip(full_requests, full.outputs))
