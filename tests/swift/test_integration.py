"""mtflow inside ms-swift 4.6.0: conversions, mtflow schedulers registered through the plugin and
run by ms-swift's own driver, ``on_request_finished`` under ms-swift, and ``install()``."""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import swift.infer_engine.protocol as sp
from swift.rollout.agent_loop import invoke_async_hook
from swift.rollout.multi_turn import MultiTurnScheduler, multi_turns

import mtflow
from mtflow.core import protocol as mp
from mtflow.integrations import swift as integ
from mtflow.integrations.swift import FINISH_REASON_KEY, from_swift, register, to_swift
from mtflow.accounting.segments import ContractAccounting
from tests.swift.swift_helpers import ScriptedSwift, assert_same, dump, run_both, sreq
from tests.tiny_model import make_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOK = make_tokenizer()


# ---- conversions -------------------------------------------------------------------------------


def _mtflow_objects() -> List[Any]:
    tool_call = mp.ChatCompletionMessageToolCall(function=mp.Function(name='calc', arguments='{"x": 1}'), id='t1')
    choice = mp.ChatCompletionResponseChoice(
        index=0,
        message=mp.ChatMessage(role='assistant', content='hi', tool_calls=[tool_call], reasoning_content='r'),
        finish_reason='length',
        logprobs={'content': [{'token': 'hi', 'logprob': -0.5}]},
        token_ids=[5, 6],
        routed_experts=[[1, 2]])  # an extra: kept
    response = mp.ChatCompletionResponse(model='m', choices=[choice], usage=mp.UsageInfo(prompt_tokens=3,
                                                                                        completion_tokens=2,
                                                                                        total_tokens=5),
                                         id='c1', created=7, prompt_token_ids=[1, 2, 3], images_size=[(4, 4)])
    return [
        mp.RolloutInferRequest(messages=[{'role': 'user', 'content': 'q'}], images=['a.png'], tools=[{'x': 1}],
                               objects={'o': 1}, chat_template_kwargs={'enable_thinking': False},
                               data_dict={'solution': '1'}, uuid='u1', add_eos='auto'),
        mp.RequestConfig(max_tokens=5, temperature=0.3, stop=None, logprobs=True, top_logprobs=2, seed=3),
        choice,
        response,
        mp.RolloutOutput(response=response, messages=[{'role': 'user', 'content': 'q'}], response_token_ids=[[5, 6]],
                         response_loss_mask=[[1, 0]], rollout_infos={'k': 'v'}, rollout_logprobs=[[-0.5]],
                         prompt_logprobs=[None]),
    ]


def test_mtflow_to_swift_and_back_loses_nothing() -> None:
    for obj in _mtflow_objects():
        s = to_swift(obj)
        assert type(s).__module__.startswith('swift.'), type(s)
        back = from_swift(s)
        assert type(back) is type(obj)
        assert back.model_dump() == obj.model_dump(), type(obj).__name__
    cfg = from_swift(sp.RequestConfig(stop=['</answer>'], top_k=-1, return_details=True))
    assert isinstance(cfg, mp.RequestConfig) and (cfg.stop, cfg.top_k, cfg.return_details) == (['</answer>'], -1, True)
    assert to_swift(_mtflow_objects()[0]).add_eos == 'auto'  # an ms-swift field mtflow does not declare


def test_swift_to_mtflow_and_back_loses_nothing() -> None:
    for obj in _mtflow_objects():
        s = to_swift(obj)
        again = to_swift(from_swift(s))
        assert type(again) is type(s)
        if dataclasses.is_dataclass(s):
            assert dataclasses.asdict(again) == dataclasses.asdict(s)
            assert vars(again).keys() == vars(s).keys()
        else:
            assert again.model_dump() == s.model_dump()
    req = sp.RolloutInferRequest(messages=[{'role': 'user', 'content': 'q'}], uuid='u', add_eos=True)
    req.custom_note = 'kept'  # an attribute ms-swift's class does not declare
    m = from_swift(req)
    assert m.add_eos is True and m.custom_note == 'kept'
    assert to_swift(m).custom_note == 'kept'
    with pytest.raises(TypeError, match='not one of'):
        to_swift(object())


# ---- the plugin: YAML schedulers in ms-swift's registry -----------------------------------------


def load_plugin(monkeypatch: pytest.MonkeyPatch, **env: str) -> Any:
    """Import schedulers/swift_plugin.py exactly as ``--external_plugins`` does."""
    from swift.utils import import_external_file
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    path = str(ROOT / 'schedulers' / 'swift_plugin.py')
    for name in [n for n in sys.modules if n.startswith('_swift_external_')]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, 'path', list(sys.path))
    return import_external_file(path)


def act(expr: str) -> str:
    return f'Thought: I will compute.\nAction: calculator\nAction Input: {{"expression": "{expr}"}}'


REACT_SCRIPT = {
    'y0': [act('2 + 3 * 4'), ' Final Answer: 14'],
    'y1': [act('(1 + 2) * 3'), ' Thought: check.\nAction: calculator\nAction Input: {"expression": "9 / 0"}',
           ' Final Answer: 9'],
    'y2': ['Final Answer: 42'],
    'y3': [act('1'), act('2'), act('3'), act('4'), act('5'), act('6')],
}


def yaml_requests() -> List[Any]:
    return [sreq(f'y{i}', {'role': 'user', 'content': f'compute task {i}'}) for i in range(4)]


def start(scheduler: Any, requests: List[Any]) -> None:
    invoke_async_hook(scheduler.on_trajectory_start(requests))


def test_plugin_registers_yaml_schedulers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules['swift.rollout.multi_turn'], 'multi_turns', multi_turns)
    before = dict(multi_turns)
    try:
        plugin = load_plugin(monkeypatch, MTFLOW_SWIFT_SCHEDULERS='my_react=react_calculator.yaml')
        assert 'mtflow_react_calculator' in multi_turns and 'my_react' in multi_turns
        assert set(plugin.REGISTERED) <= set(multi_turns)
        cls = multi_turns['mtflow_react_calculator']
        assert issubclass(cls, MultiTurnScheduler)
        # built the way ms-swift's trainer builds it (_prepare_scheduler)
        sched = cls(max_turns=None, tokenizer=TOK, template=None)
        assert sched.max_turns == 5 and 'stop_rule:final_answer' in sched.finish_reasons
        assert cls(max_turns=2, tokenizer=TOK, template=None).max_turns == 2  # --max_turns wins
    finally:
        multi_turns.clear()
        multi_turns.update(before)


@pytest.fixture
def react_yaml(monkeypatch: pytest.MonkeyPatch) -> Any:
    before = dict(multi_turns)
    load_plugin(monkeypatch)
    yield multi_turns['mtflow_react_calculator']
    multi_turns.clear()
    multi_turns.update(before)


def test_yaml_scheduler_under_swift_driver_equals_mtflow_executor(react_yaml: Any) -> None:
    """The plugin-registered YAML scheduler: ms-swift's own driver and mtflow's executor give the
    same outputs (ms-swift 4.6 accounting in both)."""
    res = run_both(lambda: react_yaml(max_turns=None, tokenizer=TOK, template=None), yaml_requests, REACT_SCRIPT,
                   prepare=start)
    assert_same(res)
    outs = res['swift']['outputs']
    reasons = [o.rollout_infos[FINISH_REASON_KEY] for o in outs]
    assert reasons == ['stop_rule:final_answer', 'stop_rule:final_answer', 'stop_rule:final_answer', 'max_turns']
    # the observation went inline and is masked out of the loss
    assert 0 in outs[0].response_loss_mask[0] and 1 in outs[0].response_loss_mask[0]


def test_yaml_scheduler_in_swift_matches_plain_mtflow(react_yaml: Any) -> None:
    """The same YAML file run natively by mtflow (contract accounting, text messages) and through
    ms-swift's driver (exact ids, id-backed messages): same ids, masks, logprobs, and the same
    conversation once ms-swift's id-backed messages are decoded."""
    from mtflow.declarative import load_scheduler
    from swift.rollout.agent_loop import run_multi_turn as swift_run

    # through ms-swift
    sched = react_yaml(max_turns=None, tokenizer=TOK, template=None)
    reqs = yaml_requests()
    start(sched, reqs)
    rollout = ScriptedSwift(copy.deepcopy(REACT_SCRIPT), tokenizer=TOK)
    swift_outs = swift_run(reqs, rollout.first(reqs), sched, rollout, None)
    # plain mtflow
    plain = load_scheduler(str(ROOT / 'schedulers' / 'react_calculator.yaml'), tokenizer=TOK)
    reqs2 = yaml_requests()
    rollout2 = ScriptedSwift(copy.deepcopy(REACT_SCRIPT), tokenizer=TOK)
    result = mtflow.Executor(plain, rollout2).run(reqs2)
    assert isinstance(mtflow.Executor(plain, rollout2).settings.accounting, ContractAccounting)

    for s, m, reason in zip(swift_outs, result.outputs, result.finish_reasons):
        assert s.response_token_ids == m.response_token_ids
        assert s.response_loss_mask == m.response_loss_mask
        assert s.rollout_logprobs == m.rollout_logprobs
        infos = dict(s.rollout_infos)
        assert infos.pop(FINISH_REASON_KEY) == reason
        assert infos == m.rollout_infos
        decoded = [{**msg, 'content': TOK.decode(msg['content'])} if isinstance(msg['content'], list) else msg
                   for msg in s.messages]
        assert decoded == m.messages
    # ms-swift sent the continuations as exact ids; mtflow as text (same tokens here: byte-level BPE)
    assert any(isinstance(m[-1]['content'], list) for batch in rollout.sent for m in batch)
    assert not any(isinstance(m[-1]['content'], list) for batch in rollout2.sent for m in batch)


# ---- on_request_finished under ms-swift's driver -------------------------------------------------


class Closing(mtflow.Scheduler):
    """An mtflow scheduler that opens a resource per request and must close it on every path."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.closed: List[tuple] = []

    async def on_turn_end(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        if 'DONE' in response_choice.message.content:
            return {'done': True, 'finish_reason': 'stop_rule:done_word', 'rollout_infos': {'saw_done': True}}
        return {}

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        if 'BOOM' in response_choice.message.content:
            raise RuntimeError('tool crashed')
        infer_request.messages.append({'role': 'user', 'content': f'go on ({current_turn})'})
        return {'infer_request': infer_request}

    def on_request_finished(self, infer_request: Any, reason: str, turn: int) -> None:
        self.closed.append((infer_request.uuid, reason, turn))


CLOSING_SCRIPT = {'c0': ['DONE'], 'c1': ['a', 'b', 'DONE'], 'c2': ['a', 'b', 'c', 'd'], 'c3': [('a b', 'length')]}


def closing_requests() -> List[Any]:
    return [sreq(f'c{i}') for i in range(4)]


def test_on_request_finished_runs_once_under_both_drivers() -> None:
    Adapter = integ.as_swift_scheduler(Closing)
    res = run_both(lambda: Adapter(max_turns=3, tokenizer=TOK), closing_requests, CLOSING_SCRIPT, max_turns=3)
    assert_same(res)
    expected = [('c0', 'stop_rule:done_word', 1), ('c3', 'length', 1), ('c1', 'stop_rule:done_word', 3),
                ('c2', 'max_turns', 3)]
    for name in ('swift', 'mtflow'):
        assert sorted(res[name]['scheduler'].inner.closed) == sorted(expected), name


class CountingChecks(Closing):
    """Counts check_finished calls: the adapter must call it once per request and turn, as
    ms-swift's driver does, though it decides inside on_turn_end."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checks: List[tuple] = []

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        self.checks.append((infer_request.uuid, current_turn))
        return current_turn >= 2


def test_check_finished_once_per_request_and_turn() -> None:
    Adapter = integ.as_swift_scheduler(CountingChecks)
    script = {'c0': ['DONE'], 'c1': ['a', 'b'], 'c2': ['a', 'b']}
    res = run_both(lambda: Adapter(tokenizer=TOK), lambda: [sreq(f'c{i}') for i in range(3)], script)
    assert_same(res)
    for name in ('swift', 'mtflow'):
        inner = res[name]['scheduler'].inner
        assert sorted(inner.checks) == [('c0', 1), ('c1', 1), ('c1', 2), ('c2', 1), ('c2', 2)], name
        assert not res[name]['scheduler']._decided  # every decision was consumed
        assert sorted(inner.closed) == [('c0', 'stop_rule:done_word', 1), ('c1', 'check_finished', 2),
                                        ('c2', 'check_finished', 2)]


def test_step_error_closes_the_request_under_swift_driver() -> None:
    from swift.rollout.agent_loop import run_multi_turn as swift_run
    sched = integ.as_swift_scheduler(Closing)(tokenizer=TOK)
    reqs = [sreq('e0'), sreq('e1')]
    rollout = ScriptedSwift({'e0': ['BOOM'], 'e1': ['DONE']}, tokenizer=TOK)
    with pytest.raises(RuntimeError, match='tool crashed'):
        swift_run(reqs, rollout.first(reqs), sched, rollout, None)
    assert ('e0', 'error', 1) in sched.inner.closed
    # mtflow's executor: the other request is finished normally, the failing one named
    sched2 = integ.as_swift_scheduler(Closing)(tokenizer=TOK)
    reqs2 = [sreq('e0'), sreq('e1')]
    rollout2 = ScriptedSwift({'e0': ['BOOM'], 'e1': ['DONE']}, tokenizer=TOK)
    with pytest.raises(mtflow.MultiTurnRolloutError, match='e0') as info:
        mtflow.run_multi_turn(reqs2, rollout2.first(reqs2), sched2, rollout2, None)
    assert info.value.outputs[1].rollout_infos['saw_done'] is True
    assert sorted(sched2.inner.closed) == [('e0', 'error', 1), ('e1', 'stop_rule:done_word', 1)]


# ---- install(): ms-swift's trainers on mtflow's executor -----------------------------------------


def test_install_replaces_every_binding_and_uninstall_restores() -> None:
    import swift.rlhf_trainers.rollout_mixin as mixin
    import swift.rollout as rollout_pkg
    import swift.rollout.agent_loop as agent_loop
    original = agent_loop.run_multi_turn
    state = integ.install()
    try:
        for module in (agent_loop, rollout_pkg, mixin):
            assert module.run_multi_turn is integ.mtflow_run_multi_turn, module.__name__
        assert integ.install() is integ.installed()  # idempotent
        assert integ.installed().originals['swift.rollout.agent_loop'] is original
    finally:
        integ.uninstall()
    for module in (agent_loop, rollout_pkg, mixin):
        assert module.run_multi_turn is original, module.__name__
    assert integ.installed() is None
    assert state.runs == 0


def test_installed_driver_gives_swift_outputs_and_traces(tmp_path: Path) -> None:
    """After install(), the name ms-swift's trainer calls runs mtflow: same outputs as ms-swift's
    own driver, plus a trace per run (in memory and as JSONL)."""
    from swift.rollout.multi_turn import MathTipsScheduler

    from tests.swift.test_differential import MATH_SCRIPT, math_requests
    expected = run_both(lambda: MathTipsScheduler(tokenizer=TOK), math_requests, MATH_SCRIPT)['swift']
    traces: List[Any] = []
    integ.install(on_trace=traces.append, trace_dir=tmp_path)
    try:
        import swift.rlhf_trainers.rollout_mixin as mixin
        reqs = math_requests()
        rollout = ScriptedSwift(copy.deepcopy(MATH_SCRIPT), tokenizer=TOK)
        outs = mixin.run_multi_turn(requests=reqs, first_turn_outputs=rollout.first(reqs),
                                    scheduler=MathTipsScheduler(tokenizer=TOK), rollout_fn=rollout,
                                    request_config=None, max_turns=None, gather_fn=lambda x: list(x))
        state = integ.installed()
    finally:
        integ.uninstall()
    assert dump(outs) == dump(expected['outputs'])
    assert all(type(o) is sp.RolloutOutput for o in outs)
    assert state.runs == 1 and len(traces) == 1
    assert traces[0].finish_reasons()['check_finished'] == 5
    files = list(tmp_path.glob('*.jsonl'))
    assert len(files) == 1 and mtflow.Trace.read_jsonl(files[0]) == traces[0]
