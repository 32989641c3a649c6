"""Each ready scheduler driven through ``mtflow.Executor`` by a scripted ``rollout_fn`` with real
token ids (the shared BPE tokenizer) and fixed logprobs: messages, finish reason, ids, masks and
logprobs are checked exactly; the Python equivalents must give the same outputs as the YAML."""
from __future__ import annotations

import asyncio
import copy

import pytest

import schedulers
from mtflow import Executor, MultiTurnRolloutError
from mtflow.declarative import GuessNumberEnv, load_scheduler, register_env
from schedulers.gym import GymScheduler
from schedulers.math_tip_trick import MathTipTrickScheduler
from tests.helpers import Scripted, out, req

from .util import ids_of, logprobs_for, model_out, tok


def lp(text: str):
    return logprobs_for(len(ids_of(text)))


def run(scheduler, script, requests, **kw):
    rollout = Scripted({uuid: [model_out(t) if isinstance(t, str) else t for t in texts]
                        for uuid, texts in script.items()})
    return Executor(scheduler, rollout, **kw).run(requests)


# ---- react_calculator: inline observations, mask 0 ---------------------------------------------
T1 = 'Thought: I add.\nAction: calculator\nAction Input: {"expression": "0 + 1"}'
OBS = '\nObservation: 1'
T2 = '4. Final Answer: 14'


def react(**overrides):
    s = load_scheduler(schedulers.path('react_calculator'), tokenizer=tok())
    s.config.observation.suffix = overrides.get('suffix', '')
    return s


def test_react_calculator_inline_observation_masks_and_logprobs():
    res = run(react(), {'a': [T1, T2]}, [req('a', {'role': 'user', 'content': 'What is 0 + 1, then 14?'})])
    o = res.outputs[0]
    assert res.finish_reasons == ['stop_rule:final_answer']
    assert [m['role'] for m in o.messages] == ['system', 'user', 'assistant']
    assert 'calculator: Evaluate an arithmetic expression' in o.messages[0]['content']
    assert o.messages[2]['content'] == T1 + OBS + T2
    # the model's own ids are kept exactly; the observation is encoded on its own
    expected_ids = ids_of(T1) + ids_of(OBS) + ids_of(T2)
    assert o.response_token_ids == [expected_ids]
    assert expected_ids != ids_of(T1 + OBS + T2)  # BPE merges across the boundary ('1' + '4.' vs '14.')
    assert o.response_loss_mask == [[1] * len(ids_of(T1)) + [0] * len(ids_of(OBS)) + [1] * len(ids_of(T2))]
    assert o.rollout_logprobs == [lp(T1) + lp(T2)]  # aligned with the mask-1 tokens: the check passed
    assert o.rollout_infos == {'tool_calls': 1, 'tool_errors': 0, 'stop_rule': 'stop_rule:final_answer',
                               'num_turns': 2}
    step_events = [e for e in res.trace if e.src == 'tool_step']
    assert step_events[0].extra['calls'] == [{'name': 'calculator', 'ok': True,
                                              'duration_s': step_events[0].extra['calls'][0]['duration_s']}]


def test_react_errors_are_fed_back_and_counted():
    bad = 'Action: calc\nAction Input: {"expression": "1"}'
    broken = 'Action: calculator\nAction Input: {"expression": '
    res = run(react(suffix='\n'), {'a': [bad, broken, 'Final Answer: none']}, [req('a')])
    o = res.outputs[0]
    text = o.messages[-1]['content']
    assert "\nObservation: Error: unknown tool 'calc' (available: calculator)\n" in text
    assert '\nObservation: Error: could not parse the tool call: invalid JSON' in text
    assert o.rollout_infos['tool_errors'] == 2 and o.rollout_infos['tool_calls'] == 2
    assert o.rollout_infos['tool_error_kinds'] == {'unknown_tool': 1, 'parse': 1}
    assert res.finish_reasons == ['stop_rule:final_answer']
    mask = o.response_loss_mask[0]
    assert sum(mask) == sum(len(ids_of(t)) for t in (bad, broken, 'Final Answer: none'))
    assert sum(map(len, o.rollout_logprobs)) == sum(mask)


def test_react_tool_errors_finish():
    s = react()
    s.config.tool_errors = 'finish'
    res = Executor(s, Scripted({'a': [model_out('Action: calculator\nAction Input: {"expression": "1/0"}')]}),
                   on_error='return').run([req('a')])
    assert res.finish_reasons == ['error']
    (failure, ) = res.failures
    assert failure.phase == 'step' and failure.turn == 1
    assert "request a, turn 1, field 'tool_calls'" in str(failure.error) and 'division by zero' in str(failure.error)
    assert res.outputs[0].rollout_infos['mtflow_error']['type'] == 'ToolCallError'


def test_react_max_turns_and_length():
    call = 'Action: calculator\nAction Input: 2+2'
    res = run(react(), {'a': [call] * 5, 'b': [out('Action: calc', ids_of('Action: calc'), finish_reason='length')]},
              [req('a'), req('b')])
    assert res.finish_reasons == ['max_turns', 'length']
    assert res.outputs[0].rollout_infos['tool_calls'] == 4 and res.outputs[0].rollout_infos['num_turns'] == 5


def test_inline_without_tokenizer_fails_clearly_instead_of_dropping_ids():
    """The model's ids of earlier turns are never dropped silently: with ids and no tokenizer to
    encode the inline observation, the request fails naming the reason; the others go on."""
    s = load_scheduler(schedulers.path('react_calculator'))
    res = run(s, {'a': [T1, T2], 'b': ['Final Answer: 3']}, [req('a'), req('b')], on_error='return')
    assert res.finish_reasons == ['error', 'stop_rule:final_answer']
    (failure, ) = res.failures
    assert failure.uuid == 'a' and failure.turn == 1 and 'no tokenizer' in str(failure.error)
    assert getattr(failure.error, 'field', None) == 'observation.mode'
    assert res.outputs[1].response_token_ids == [ids_of('Final Answer: 3')]


def test_inline_without_tokenizer_and_without_ids_is_text_only():
    s = load_scheduler(schedulers.path('react_calculator'))
    script = {'a': [out(T1, None), out(T2, None)]}
    res = run(s, script, [req('a')])
    o = res.outputs[0]
    assert res.finish_reasons == ['stop_rule:final_answer']
    assert o.messages[-1]['content'].startswith(T1 + OBS) and o.messages[-1]['content'].endswith(T2)
    assert o.response_token_ids == []


# ---- hermes_tools: tool messages, several concurrent calls --------------------------------------
H1 = ('<think>two tools</think><tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
      '\n<tool_call>\n{"name": "python", "arguments": {"code": "print(sum(range(5)))"}}\n</tool_call>'
      '\n<tool_call>{"name": "python", "arguments": {"code": </tool_call>')
H2 = 'Both give 42 and 10.'


def test_hermes_tools_messages_ids_and_errors():
    from mtflow.tools.isolation import resolve_isolation
    if not resolve_isolation('auto').available:  # the python call would be refused (docs/sandbox.md)
        pytest.skip(f'no sandbox for the python tool here: {resolve_isolation("auto").detail}')
    s = load_scheduler(schedulers.path('hermes_tools'), tokenizer=tok())
    res = run(s, {'a': [H1, H2]}, [req('a', {'role': 'system', 'content': 'Be brief.'},
                                        {'role': 'user', 'content': 'Compute.'})])
    o = res.outputs[0]
    assert res.finish_reasons == ['stop_rule:no_tool_call']
    assert o.messages[0] == {'role': 'system', 'content': 'Be brief.'}  # if_missing keeps the user's system prompt
    assert o.messages[2:] == [  # the reasoning apart (reasoning: auto), the ids below whole
        {'role': 'assistant', 'content': H1[len('<think>two tools</think>'):], 'reasoning_content': 'two tools'},
        {'role': 'tool', 'name': 'calculator', 'content': '42'},
        {'role': 'tool', 'name': 'python', 'content': '10\n'},
        {'role': 'tool', 'content': o.messages[5]['content']},
        {'role': 'assistant', 'content': H2},
    ]
    assert o.messages[5]['content'].startswith('Error: could not parse the tool call: invalid JSON')
    assert o.response_token_ids == [ids_of(H1), ids_of(H2)]
    assert o.response_loss_mask == [[1] * len(ids_of(H1)), [1] * len(ids_of(H2))]
    assert o.rollout_logprobs == [lp(H1), lp(H2)]
    assert o.rollout_infos == {'tool_calls': 3, 'tool_errors': 1, 'tool_error_kinds': {'parse': 1},
                               'stop_rule': 'stop_rule:no_tool_call', 'num_turns': 2}


def test_hermes_system_prompt_lists_tools_when_missing():
    s = load_scheduler(schedulers.path('hermes_tools'), tokenizer=tok())
    res = run(s, {'a': ['no tools needed']}, [req('a')])
    system = res.outputs[0].messages[0]
    assert system['role'] == 'system' and '<tools>' in system['content'] and '"name": "python"' in system['content']


# ---- tools of all requests of a turn run concurrently; results applied in order ---------------
_ACTIVE = {'now': 0, 'max': 0}


async def probe(i: int) -> str:
    """Record how many calls overlap."""
    _ACTIVE['now'] += 1
    _ACTIVE['max'] = max(_ACTIVE['max'], _ACTIVE['now'])
    await asyncio.sleep(0.01 * (5 - i % 5))  # later calls finish first
    _ACTIVE['now'] -= 1
    return f'probe {i}'


def test_tool_steps_run_concurrently_across_requests_and_calls():
    _ACTIVE.update(now=0, max=0)
    s = load_scheduler({'name': 'probe', 'tools': [{'name': 'probe', 'impl': f'{__name__}:probe'}],
                        'observation': {'role': 'user', 'one_message_per_call': False}})
    calls = lambda u: ''.join(f'<tool_call>{{"name": "probe", "arguments": {{"i": {u * 2 + k}}}}}</tool_call>'
                              for k in range(2))
    script = {str(u): [calls(u), 'done'] for u in range(8)}
    res = run(s, script, [req(str(u)) for u in range(8)])
    assert _ACTIVE['max'] == 16  # every call of every request was in flight at once
    for u, o in enumerate(res.outputs):
        assert o.messages[2] == {'role': 'user', 'content': f'probe {u * 2}\nprobe {u * 2 + 1}'}
    assert res.finish_reasons == ['stop_rule:no_tool_call'] * 8


# ---- math_tip_trick: inline tip, truncation, once ---------------------------------------------
M1 = '<think>3+4=8</think><answer>8</answer>'
M2 = ' Let me recheck: 3+4=7. <answer>7</answer>'
TIP = 'But wait... It seems I made a mistake,'


def test_math_tip_trick_inline_tip_with_truncation():
    s = load_scheduler(schedulers.path('math_tip_trick'), tokenizer=tok())
    res = run(s, {'a': [M1, M2]}, [req('a', data_dict={'solution': '7'})])
    o = res.outputs[0]
    kept = '<think>3+4=8'
    assert res.finish_reasons == ['stop_rule:correct_answer']
    assert o.messages[-1] == {'role': 'assistant', 'content': kept + TIP + M2}
    n = len(ids_of(kept))
    assert ids_of(M1)[:n] == ids_of(kept)
    assert o.response_token_ids == [ids_of(M1)[:n] + ids_of(TIP) + ids_of(M2)]
    assert o.response_loss_mask == [[1] * n + [0] * len(ids_of(TIP)) + [1] * len(ids_of(M2))]
    assert o.rollout_logprobs == [lp(M1)[:n] + lp(M2)]
    assert o.rollout_infos == {'answer': '7', 'answer_correct': True, 'tips_given': {'recheck': 1},
                               'stop_rule': 'stop_rule:correct_answer', 'num_turns': 2}


def test_math_tip_trick_tip_once_then_stop_and_right_first_time():
    s = load_scheduler(schedulers.path('math_tip_trick'), tokenizer=tok())
    res = run(s, {'a': [M1, ' still <answer>8</answer>'], 'b': ['<answer>7</answer>']},
              [req('a', data_dict={'solution': '7'}), req('b', data_dict={'solution': 7})])
    assert res.finish_reasons == ['stop_rule:tips_exhausted', 'stop_rule:correct_answer']
    assert res.outputs[0].messages[-1]['content'].count(TIP) == 1
    assert res.outputs[1].response_loss_mask == [[1] * len(ids_of('<answer>7</answer>'))]


@pytest.mark.parametrize('script', [[M1, M2], [M1, ' no <answer>9</answer>'], ['<answer>7</answer>'],
                                    ['no answer at all', 'and again', 'x']])
def test_math_tip_trick_python_equals_yaml(script):
    a = run(load_scheduler(schedulers.path('math_tip_trick'), tokenizer=tok()), {'a': script},
            [req('a', data_dict={'solution': '7'})])
    b = run(MathTipTrickScheduler(max_turns=3, tokenizer=tok()), {'a': script}, [req('a', data_dict={'solution': '7'})])
    assert a.finish_reasons == b.finish_reasons
    oa, ob = a.outputs[0], b.outputs[0]
    assert (oa.messages, oa.response_token_ids, oa.response_loss_mask, oa.rollout_logprobs, oa.rollout_infos) == (
        ob.messages, ob.response_token_ids, ob.response_loss_mask, ob.rollout_logprobs, ob.rollout_infos)


# ---- thinking_tips: tip as a user message -------------------------------------------------------
def test_thinking_tips_user_message():
    s = load_scheduler(schedulers.path('thinking_tips'), tokenizer=tok())
    w, r = 'So \\boxed{8}', 'Again: \\boxed{7}'
    res = run(s, {'a': [w, r]}, [req('a', data_dict={'solution': '7'})])
    o = res.outputs[0]
    assert res.finish_reasons == ['stop_rule:correct_answer']
    assert [m['role'] for m in o.messages] == ['user', 'assistant', 'user', 'assistant']
    assert o.messages[2]['content'].startswith('Your answer is not correct.')
    assert o.response_token_ids == [ids_of(w), ids_of(r)]
    assert o.response_loss_mask == [[1] * len(ids_of(w)), [1] * len(ids_of(r))]
    assert o.rollout_logprobs == [lp(w), lp(r)]
    assert o.rollout_infos['tips_given'] == {'rethink': 1}


# ---- gym: guess the number ----------------------------------------------------------------------
CLOSED = []


class RecordingEnv(GuessNumberEnv):
    def close(self):
        CLOSED.append(self.target)
        super().close()


register_env('recording_guess_number', RecordingEnv)


def gym_scheduler(**kw):
    cfg = {'name': 'g', 'env': {'impl': 'recording_guess_number', 'kwargs': {'max_guesses': 6}}, 'max_turns': 6}
    cfg.update(kw)
    return load_scheduler(cfg, tokenizer=tok())


def test_guess_number_several_turns_whatever_the_model_says():
    s = load_scheduler(schedulers.path('guess_number'), tokenizer=tok())
    replies = ['I think it is 50', 'hmm, not sure', 'Then 25?', 'My guess: 42']
    cut = [model_out('no idea', finish_reason='length') for _ in range(6)]  # a weak model hitting max_tokens
    res = run(s, {'a': replies, 'b': cut},
              [req('a', {'role': 'user', 'content': 'Play.'}, data_dict={'target': 42}),
               req('b', {'role': 'user', 'content': 'Play.'}, data_dict={'target': 7})])
    a, b = res.outputs
    assert res.finish_reasons == ['stop_rule:env_done', 'stop_rule:env_done']
    assert a.messages[0]['role'] == 'system' and 'between 1 and 100' in a.messages[0]['content']
    assert [m['content'] for m in a.messages[3::2]] == [
        '50 is too high. Guess lower.', 'Please answer with a number between 1 and 100.',
        '25 is too low. Guess higher.']
    assert a.rollout_infos['reward'] == 1.0 and a.rollout_infos['rewards'] == [0.0, 0.0, 0.0, 1.0]
    assert a.rollout_infos['num_turns'] == 4
    assert a.response_token_ids == [ids_of(t) for t in replies]
    assert a.response_loss_mask == [[1] * len(ids_of(t)) for t in replies]
    assert a.rollout_logprobs == [lp(t) for t in replies]
    assert b.rollout_infos['reward'] == 0.0 and b.rollout_infos['num_turns'] == 6
    assert len(b.messages) == 2 + 6 + 5


def test_guess_number_target_from_uuid_is_deterministic():
    e1, e2 = GuessNumberEnv(), GuessNumberEnv()
    assert e1.reset(req('x')) and e1.target == (e2.reset(req('x')) and e2.target)
    assert 1 <= e1.target <= 100


def test_envs_closed_on_every_finish_path():
    CLOSED.clear()
    s = gym_scheduler()
    calls = {'n': 0}

    def rollout(requests, config):
        calls['n'] += 1
        outs = []
        for r in requests:
            if r.uuid == 'err' and calls['n'] == 2:
                outs.append(object())  # not an output: applying it fails for this request only
            else:
                outs.append(model_out('5' if r.uuid == 'win' else 'no number'))
        return outs

    res = Executor(s, rollout, max_turns=3, on_error='return').run(
        [req('win', data_dict={'target': 5}), req('long', data_dict={'target': 6}),
         req('err', data_dict={'target': 7})])
    assert res.finish_reasons == ['stop_rule:env_done', 'max_turns', 'error']
    assert sorted(CLOSED) == [5, 6, 7]
    assert s._states == {}


def test_gym_python_equals_yaml():
    script = {'a': ['50', 'x', '42'], 'b': ['1'] * 6}
    reqs = lambda: [req('a', {'role': 'user', 'content': 'Play.'}, data_dict={'target': 42}),
                    req('b', {'role': 'user', 'content': 'Play.'})]
    y = load_scheduler(schedulers.path('guess_number'), tokenizer=tok())
    p = GymScheduler(env_factory=lambda: GuessNumberEnv(1, 100, 6, 0), max_turns=6,
                     system_prompt=y.config.system_prompt)
    ra, rb = run(y, copy.deepcopy(script), reqs()), run(p, copy.deepcopy(script), reqs())
    assert ra.finish_reasons == rb.finish_reasons
    for oa, ob in zip(ra.outputs, rb.outputs):
        assert (oa.messages, oa.response_token_ids, oa.response_loss_mask, oa.rollout_logprobs, oa.rollout_infos) == (
            ob.messages, ob.response_token_ids, ob.response_loss_mask, ob.rollout_logprobs, ob.rollout_infos)


def test_scheduler_reports_its_stop_rules():
    s = load_scheduler(schedulers.path('react_calculator'))
    assert s.finish_reasons == ('stop_rule:final_answer', 'stop_rule:no_tool_call')
    assert load_scheduler(schedulers.path('guess_number')).finish_reasons == ('stop_rule:env_done', )
    assert 'stop_rule:final_answer' in Executor(s, lambda r, c: []).settings.graph.finish_reasons
