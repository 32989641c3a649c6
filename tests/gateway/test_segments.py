"""Harnesses that rewrite their history: each rewrite starts a new exact segment, the trace records
its kind and the first differing position, and every segment shares the episode's reward."""
from __future__ import annotations

import httpx
import pytest

from mtflow.accounting.segments_split import training_samples
from mtflow.gateway import Gateway, transition
from mtflow.run.agent_config import GatewayConfig
from tests.gateway.helpers import ADD_TOOL, TIMEOUT_S, assert_tokens_exact, events, lines, scripted

openai = pytest.importorskip('openai')


def _ask(client, messages, **kw):
    reply = client.chat.completions.create(model='m', messages=messages, **kw)
    return reply.choices[0].message.model_dump(exclude_none=True)


def _run(tmp_path, outputs, episode, settings=None):
    """Run ``episode(client)`` against a fresh gateway; finish with reward 0.75; return the line."""
    with Gateway(scripted(*outputs), tmp_path / 'run', settings=settings) as gw:
        client = openai.OpenAI(base_url=gw.base_url('ep'), api_key='unused', timeout=TIMEOUT_S, max_retries=0)
        episode(client)
        assert httpx.post(f'{gw.url}/s/ep/finish', json={'reward': 0.75}, timeout=TIMEOUT_S).status_code == 200
    [line] = lines(tmp_path / 'run')
    return line


def test_a_harness_that_compacts_mid_episode_yields_two_exact_segments_sharing_the_reward(tmp_path):
    def episode(client):
        history = [{'role': 'system', 'content': 'You explore.'}, {'role': 'user', 'content': 'Task: explore.'}]
        for k in range(3):
            history += [_ask(client, history), {'role': 'user', 'content': f'observation {k}'}]
        history = history[:2] + [{'role': 'user', 'content': 'Summary: three steps, nothing found.'}]  # compacted
        for k in range(2):
            history += [_ask(client, history), {'role': 'user', 'content': f'observation {3 + k}'}]

    line = _run(tmp_path, ['looking', 'still looking', 'more looking'], episode)
    samples = training_samples(line)
    assert [s['turns'] for s in samples] == [[1, 3], [4, 5]]
    assert [s['reward'] for s in samples] == [0.75, 0.75] and {s['uuid'] for s in samples} == {'ep'}
    [closed] = line['rollout_infos']['context_segments']
    # before: the conversation as the model saw it (through its last answer); after: the compacted call
    assert closed['ended_by'] == {'kind': 'compaction', 'at': 2, 'char': 0, 'messages_before': 7,
                                  'messages_after': 3}
    assert closed['messages'][-1]['role'] == 'assistant'  # the first segment as the model saw it
    cut = [e for e in events(tmp_path / 'run', 'ep') if (e['extra'] or {}).get('segment')]
    assert [(e['turn'], e['from'], e['extra']['segment']['kind']) for e in cut] == [(3, 'tool_step', 'compaction')]
    assert_tokens_exact(tmp_path / 'run', segments=2)


def test_a_retried_turn_is_its_own_segment_not_a_corrupted_append(tmp_path):
    def episode(client):
        history = [{'role': 'user', 'content': 'Task: answer.'}]
        history += [_ask(client, history), {'role': 'user', 'content': 'and then?'}]
        _ask(client, history)  # the harness timed out on this answer and asks again
        history += [_ask(client, history), {'role': 'user', 'content': 'thanks'}]
        _ask(client, history)

    line = _run(tmp_path, ['first', 'second', 'second again', 'bye'], episode)
    [closed] = line['rollout_infos']['context_segments']
    assert closed['turns'] == [1, 2] and closed['ended_by']['kind'] == 'retry' and closed['ended_by']['at'] == 3
    # the retry's segment holds the retry and what followed it, from the re-sent prompt
    assert [m['content'] for m in line['messages'] if m['role'] == 'assistant'] == ['first', 'second again', 'bye']
    assert [s['turns'] for s in training_samples(line)] == [[1, 2], [3, 4]]
    assert_tokens_exact(tmp_path / 'run', segments=2)


def test_stripped_thinking_a_sub_agent_and_new_tools_each_start_a_segment(tmp_path):
    def episode(client):
        history = [{'role': 'system', 'content': 'Main agent.'}, {'role': 'user', 'content': 'Task: plan.'}]
        answer = _ask(client, history)
        assert answer['content'] == '<think>hidden plan</think>Plan ready.'
        history += [{'role': 'assistant', 'content': 'Plan ready.'}, {'role': 'user', 'content': 'go'}]  # stripped
        history += [_ask(client, history), {'role': 'user', 'content': 'next'}]
        sub = [{'role': 'system', 'content': 'Sub-agent.'}, {'role': 'user', 'content': 'Look up X.'}]
        _ask(client, sub)  # a sub-agent's own conversation on the same session
        history += [_ask(client, history)]
        _ask(client, history + [{'role': 'user', 'content': 'now add'}], tools=[ADD_TOOL])

    # reasoning: none keeps the thinking in the content, so the client's stripping is a rewrite (with the default
    # split, the answer sent back without its reasoning is the model's own text again: test_wire_features.py)
    line = _run(tmp_path, ['<think>hidden plan</think>Plan ready.', 'working', 'X is 4', 'resumed', 'adding'],
                episode, GatewayConfig(reasoning='none'))
    kinds = [s['ended_by']['kind'] for s in line['rollout_infos']['context_segments']]
    assert kinds == ['thinking_stripped', 'new_conversation', 'new_conversation', 'tools_changed']
    assert [s['segment'] for s in training_samples(line)] == [0, 1, 2, 3, 4]
    assert_tokens_exact(tmp_path / 'run', segments=5)


def test_transition_names_the_kind_and_the_first_difference():
    old = [{'role': 'system', 'content': 's'}, {'role': 'user', 'content': 'task'},
           {'role': 'assistant', 'content': 'a1'}, {'role': 'tool', 'content': 'r1', 'tool_call_id': 'c'},
           {'role': 'assistant', 'content': 'a2'}]
    assert transition(old, None, old + [{'role': 'user', 'content': 'more'}], None) is None
    edited = old[:3] + [{'role': 'tool', 'content': 'r1 (trimmed)', 'tool_call_id': 'c'}] + old[4:]
    assert transition(old, None, edited, None) == {'kind': 'tool_result_edited', 'at': 3, 'char': 2,
                                                   'messages_before': 5, 'messages_after': 5}
    assert transition(old, None, old[:3], None)['kind'] == 'retry'
    assert transition(old, None, old[:2] + [{'role': 'assistant', 'content': 'other'}], None)['kind'] == \
        'assistant_edited'
    assert transition(old, None, old[:2] + [{'role': 'user', 'content': 'summary'}], None)['kind'] == 'compaction'
    assert transition(old, None, old, [ADD_TOOL]) == {'kind': 'tools_changed', 'at': None, 'messages_before': 5,
                                                      'messages_after': 5}
