"""Differential tests: mtflow's executor against the installed ms-swift 4.6.0 driver
(``swift.rollout.agent_loop.run_multi_turn``), same inputs, same scripted model, real tokenizer.
Every output field, the final requests, and every rollout_fn call must be identical."""
from __future__ import annotations

import json
import re
from typing import Any, Dict, List

import pytest
from swift.rollout.agent_loop import invoke_async_hook
from swift.rollout.multi_turn import GYMScheduler, MathTipsScheduler, MultiTurnScheduler

from mtflow.engine.executor import Executor
from mtflow.accounting.swift46 import Swift46Accounting
from tests.ranks import run_ranks
from tests.swift.swift_helpers import assert_same, dump, run_both, sreq
from tests.tiny_model import make_tokenizer

TOK = make_tokenizer()
TIPS = MathTipsScheduler.tips_prompt


def math_requests() -> List[Any]:
    return [sreq(f'm{i}', {'role': 'user', 'content': f'What is 2 + 3 * 4? (case {i})'},
                 data_dict={'solution': '<answer>14</answer>'}) for i in range(5)]


MATH_SCRIPT = {
    'm0': ['I think <answer>14</answer>'],  # right at once
    'm1': ['<think>compute 2 + 3 * 4 = 20</think><answer>20</answer>', ' let me check again. <answer>14</answer>'],
    'm2': ['The answer is 7', ' Yes, 7.'],  # wrong, tip, continued (no tags: nothing truncated)
    'm3': [('The quick brown fox jumps over', 'length')],  # hit the length limit
    'm4': ['<answer>3</answer>', ' no, <answer>4</answer>'],
}


def test_accounting_is_chosen_for_swift_46_schedulers() -> None:
    ex = Executor(MathTipsScheduler(tokenizer=TOK), lambda r, c: [])
    assert isinstance(ex.settings.accounting, Swift46Accounting)


@pytest.mark.parametrize('max_turns', [None, 1, 3])
def test_math_tips_scheduler(max_turns: Any) -> None:
    res = run_both(lambda: MathTipsScheduler(tokenizer=TOK, max_turns=max_turns), math_requests, MATH_SCRIPT,
                   max_turns=max_turns)
    assert_same(res)
    outs = res['mtflow']['outputs']
    if max_turns is None:
        # the id-backed continuation really happened: turn 2 was sent the tip as exact ids
        sent_turn2 = res['mtflow']['sent'][0]
        assert any(isinstance(m[-1]['content'], list) for m in sent_turn2)
        assert [o.rollout_infos['num_turns'] for o in outs] == [1, 2, 2, 1, 2]
        # tips are masked out of the loss, and the logprobs cover exactly the trained tokens
        m1 = outs[1]
        assert 0 in m1.response_loss_mask[0] and m1.rollout_logprobs
        assert sum(map(len, m1.rollout_logprobs)) == sum(map(sum, m1.response_loss_mask))


def test_math_tips_without_logprobs() -> None:
    res = run_both(lambda: MathTipsScheduler(tokenizer=TOK), math_requests, MATH_SCRIPT, logprobs=False)
    assert_same(res)
    assert all(o.rollout_logprobs == [] for o in res['mtflow']['outputs'])


# ---- GYMScheduler with ms-swift's built-in math environment --------------------------------


@pytest.fixture
def offline_gym(monkeypatch: pytest.MonkeyPatch) -> None:
    """``SimpleMathEnv.step`` counts tokens with Qwen2.5-3B's tokenizer fetched from ModelScope
    (about 20 s of retries offline, then "not over the limit"); count with the tiny tokenizer."""
    import swift.rollout.gym_env as gym_env

    def count_tokens(messages: List[Dict[str, Any]], max_tokens: int = 2048) -> Any:
        text = TOK.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        n = len(TOK.encode(text))
        return n, n >= max_tokens

    monkeypatch.setattr(gym_env, 'count_qwen_tokens', count_tokens)


def gym_requests() -> List[Any]:
    return [sreq(f'g{i}', {'role': 'user', 'content': '<placeholder>'},
                 data_dict={'problem': f'What is 2 + 3 * 4? ({i})', 'solution': '<answer>14</answer>',
                            'env_config': {'name': 'math_env'}}) for i in range(4)]


GYM_SCRIPT = {
    'g0': ['<think>easy</think><answer>14</answer>'],
    'g1': ['<answer>20</answer>', '<answer>14</answer>'],
    'g2': ['<answer>1</answer>', '<answer>2</answer>', '<answer>3</answer>', '<answer>4</answer>'],
    'g3': [('The quick brown', 'length'), '<answer>14</answer>'],
}


def start_gym(scheduler: Any, requests: List[Any]) -> None:
    # the trainer calls this before generating the first turn (rollout_mixin._infer_single_or_multi_turn)
    invoke_async_hook(scheduler.on_trajectory_start(requests))


@pytest.mark.parametrize('max_turns', [3, None])
def test_gym_scheduler_math_env(offline_gym: None, max_turns: Any) -> None:
    script = dict(GYM_SCRIPT)
    if max_turns is None:
        script['g2'] = script['g2'][:3] + ['<answer>14</answer>']
    res = run_both(lambda: GYMScheduler(tokenizer=TOK, max_turns=max_turns), gym_requests, script,
                   max_turns=max_turns, prepare=start_gym)
    assert_same(res)
    outs = res['mtflow']['outputs']
    assert outs[0].rollout_infos['total_reward'] == 1.0 and outs[0].messages[0]['role'] == 'system'
    assert outs[1].rollout_infos['step_rewards'] == [0.0, 1.0]
    # envs close on done only: a request stopped by max_turns leaks its env under both drivers
    leaked = {'g2'} if max_turns == 3 else set()
    assert set(res['mtflow']['scheduler']._envs) == set(res['swift']['scheduler']._envs) == leaked
    if max_turns == 3:
        assert outs[2].rollout_infos['num_turns'] == 3 and outs[2].rollout_infos['gym_done'] is False


# ---- a ReAct tool-calling scheduler written here ---------------------------------------------

ACTION = re.compile(r'Action: calculator\s*Action Input: (\{.*?\})', re.S)


class ReActCalculator(MultiTurnScheduler):
    """Thought/Action/Observation: a calculator tool. Odd turns put the observation into the
    assistant message (a continuation, observation ids masked out of the loss); even turns add a
    ``tool`` message. ``Final Answer:`` ends the trajectory through ``on_turn_end``'s ``done``."""

    async def on_turn_end(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        text = response_choice.message.content
        if 'Final Answer:' in text:
            return {'done': True, 'rollout_infos': {'answered': True, 'last': infer_request.messages[-1]['content']}}
        return {'rollout_infos': {f'chars_{current_turn}': len(text)}}

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        if not ACTION.search(response_choice.message.content):
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        text = response_choice.message.content
        expr = json.loads(ACTION.search(text).group(1))['expression']
        assert set(expr) <= set('0123456789+-*/() .'), expr
        observation = f'\nObservation: {eval(expr)}\n'  # noqa: S307 - digits and operators only
        result: Dict[str, Any] = {'infer_request': infer_request, 'rollout_infos': {'tool_calls': current_turn}}
        if current_turn % 2 == 1:
            ids = list(response_choice.token_ids)
            obs_ids = self.tokenizer.encode(observation, add_special_tokens=False)
            infer_request.messages[-1]['content'] += observation
            result['response_token_ids'] = ids + obs_ids
            result['response_loss_mask'] = [1] * len(ids) + [0] * len(obs_ids)
            result['rollout_logprobs'] = [c['logprob'] for c in response_choice.logprobs['content']]
        else:
            infer_request.messages.append({'role': 'tool', 'content': observation.strip()})
        return result


def act(expr: str) -> str:
    return f'Thought: compute. Action: calculator Action Input: {{"expression": "{expr}"}}'


REACT_SCRIPT = {
    'a0': [act('2 + 3 * 4'), 'Final Answer: 14'],
    'a1': [act('1 + 2'), act('(1 + 2) * 3'), ' Final Answer: 9'],
    'a2': ['no tool needed'],
    'a3': [act('1'), act('2'), act('3'), act('4'), act('5')],
}


def react_requests(prefix: str = 'a', n: int = 4) -> List[Any]:
    return [sreq(f'{prefix}{i}', {'role': 'system', 'content': 'Use the calculator.'},
                 {'role': 'user', 'content': f'task {i}'}) for i in range(n)]


@pytest.mark.parametrize('max_turns', [None, 2, 4])
def test_react_tool_scheduler(max_turns: Any) -> None:
    script = dict(REACT_SCRIPT)
    if max_turns is None:
        script['a3'] = script['a3'][:4] + ['Final Answer: done']
    res = run_both(lambda: ReActCalculator(tokenizer=TOK, max_turns=max_turns), react_requests, script,
                   max_turns=max_turns)
    assert_same(res)
    outs = res['mtflow']['outputs']
    if max_turns is None:
        assert outs[0].rollout_infos['answered'] is True
        assert any(m['role'] == 'tool' for m in outs[1].messages)
        assert 0 in outs[0].response_loss_mask[0]


# ---- two simulated ranks -----------------------------------------------------------------------


def tag_accuracy(completions: List[str], solutions: List[str]) -> List[float]:
    def answer(s: str) -> Any:
        m = re.search(r'<answer>(.*?)</answer>', s, re.S)
        return m.group(1).strip() if m else None

    return [float(answer(c) is not None and answer(c) == answer(s)) for c, s in zip(completions, solutions)]


def test_two_ranks_math_and_react(offline_gym: None) -> None:
    """Rank 0 runs ReAct requests that need many turns, rank 1 MathTips requests that finish early
    (so it calls rollout_fn([]) while rank 0 works); each rank compares both drivers."""

    def target(rank: int, gather: Any) -> Any:
        if rank == 0:
            res = run_both(lambda: ReActCalculator(tokenizer=TOK), react_requests,
                           {**REACT_SCRIPT, 'a3': REACT_SCRIPT['a3'][:4] + ['Final Answer: done']}, gather_fn=gather)
        else:
            # math_verify's parser uses signal.alarm (main thread only): use the acc_function hook
            res = run_both(lambda: MathTipsScheduler(tokenizer=TOK, acc_function=tag_accuracy), math_requests,
                           MATH_SCRIPT, gather_fn=gather)
        assert_same(res)
        return res

    results = run_ranks(2, target)
    calls0, calls1 = results[0]['mtflow']['calls'], results[1]['mtflow']['calls']
    assert len(calls0) == len(calls1)  # every rank calls rollout_fn the same number of times
    assert [] in calls1  # rank 1 idled while rank 0 worked
    assert dump(results[1]['swift']['outputs']) == dump(results[1]['mtflow']['outputs'])


# ---- a real ms-swift template with a response prefix -----------------------------------------


@pytest.fixture(scope='module')
def template(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """ms-swift's qwen2_5 template over the tiny tokenizer (built the way ms-swift builds one)."""
    from swift.model import get_processor
    from swift.template import get_template
    path = tmp_path_factory.mktemp('tok')
    TOK.save_pretrained(path)
    (path / 'config.json').write_text(json.dumps({'model_type': 'qwen2', 'architectures': ['Qwen2ForCausalLM'],
                                                  'vocab_size': len(TOK)}))
    return get_template(get_processor(str(path), model_type='qwen2'), template_type='qwen2_5')


PREFIX = '<think>\n'


def with_prefix(make: Any) -> Any:
    """Requests whose even-numbered members ask for a response prefix (chat_template_kwargs)."""

    def build() -> List[Any]:
        reqs = make()
        for i, r in enumerate(reqs):
            if i % 2 == 0:
                r.chat_template_kwargs = {'response_prefix': PREFIX}
        return reqs

    return build


def test_response_prefix_ids_are_masked_identically(template: Any) -> None:
    """get_response_token_data prepends the template's response prefix as masked ids on every
    new assistant message (not on continuations); mtflow must do exactly the same."""
    res = run_both(lambda: MathTipsScheduler(tokenizer=TOK, template=template), with_prefix(math_requests),
                   MATH_SCRIPT)
    assert_same(res)
    prefix_ids = TOK.encode(PREFIX, add_special_tokens=False)
    outs = res['mtflow']['outputs']
    m0, m1 = outs[0], outs[1]
    assert m0.response_token_ids[0][:len(prefix_ids)] == prefix_ids
    assert m0.response_loss_mask[0][:len(prefix_ids)] == [0] * len(prefix_ids)
    assert m1.response_token_ids[0][:len(prefix_ids)] != prefix_ids  # no prefix asked

    script = {**REACT_SCRIPT, 'a3': REACT_SCRIPT['a3'][:4] + ['Final Answer: done']}
    res = run_both(lambda: ReActCalculator(tokenizer=TOK, template=template), with_prefix(react_requests), script)
    assert_same(res)
    a1 = res['mtflow']['outputs'][1]
    assert all(seg[:len(prefix_ids)] != prefix_ids for seg in a1.response_token_ids)
    a2 = res['mtflow']['outputs'][2]
    assert a2.response_token_ids[0][:len(prefix_ids)] == prefix_ids
