"""ms-swift's TransformersEngine (a tiny random Qwen2 saved to a temp dir, real BPE tokenizer,
real generation on CPU) as mtflow's rollout_fn, and as the engine of the adapter's server-mode
``run`` (what ``swift rollout`` calls per request)."""
from __future__ import annotations

import asyncio
import copy
import dataclasses
from pathlib import Path
from typing import Any, Dict, List

import pytest
import swift.infer_engine.protocol as sp

import mtflow
from mtflow.backends import make_backend
from mtflow.backends.base import BackendError
from mtflow.backends.swift_engine import SwiftBackend
from mtflow.integrations import swift as integ
from tests.swift.swift_helpers import dump, sreq
from tests.tiny_model import make_model, make_tokenizer


@pytest.fixture(scope='module')
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from swift.infer_engine import TransformersEngine
    path: Path = tmp_path_factory.mktemp('tiny_qwen2')
    tok = make_tokenizer()
    make_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    engine = TransformersEngine(str(path), model_type='qwen2', template_type='qwen2_5', max_batch_size=0)
    engine.tiny_path = str(path)
    return engine


def config(**kw: Any) -> mtflow.RequestConfig:
    return mtflow.RequestConfig(**{'max_tokens': 5, 'temperature': 0.0, 'logprobs': True, **kw})


class Nudge(mtflow.Scheduler):
    """Three turns whatever the model says: odd turns add a user message, even turns continue the
    assistant message. The length limit (5 tokens) does not stop it."""

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        return bool(self.max_turns and current_turn >= self.max_turns)

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        ids = list(response_choice.token_ids)
        if current_turn % 2:
            infer_request.messages.append({'role': 'user', 'content': f'and then? ({current_turn})'})
            return {'infer_request': infer_request, 'response_token_ids': ids, 'response_loss_mask': [1] * len(ids)}
        infer_request.messages[-1]['content'] += SO
        so = self.tokenizer.encode(SO, add_special_tokens=False)
        return {'infer_request': infer_request, 'response_token_ids': ids + so,
                'response_loss_mask': [1] * len(ids) + [0] * len(so)}


SO = ' So'
N_SO = len(make_tokenizer().encode(SO, add_special_tokens=False))


def test_backend_runs_multi_turn_rollouts(engine: Any) -> None:
    backend = SwiftBackend(engine, config())
    requests = [mtflow.RolloutInferRequest(messages=[{'role': 'user', 'content': f'What is {i} + 1?'}],
                                           uuid=f'q{i}') for i in range(3)]
    result = mtflow.Executor(Nudge(max_turns=3, tokenizer=engine.tokenizer), backend).run(requests)
    assert result.ok and result.finish_reasons == ['check_finished'] * 3
    assert backend.calls == 3  # one batched engine call per turn
    tok = engine.tokenizer
    for out in result.outputs:
        assert isinstance(out, mtflow.RolloutOutput)
        assert out.rollout_infos['num_turns'] == 3
        # turns 1 and 2+3 (2 continued into 3): two segments; the inserted ' So' is masked out and
        # every trained token has its logprob
        assert [len(s) for s in out.response_token_ids] == [5, 10 + N_SO]
        assert out.response_loss_mask[1] == [1] * 5 + [0] * N_SO + [1] * 5
        assert out.rollout_logprobs and [len(s) for s in out.rollout_logprobs] == [5, 10]
        choice = out.response.choices[0]
        assert choice.finish_reason == 'length' and len(choice.token_ids) == 5
        assert tok.decode(out.response_token_ids[0]) == out.messages[1]['content']
        assert [m['role'] for m in out.messages] == ['user', 'assistant', 'user', 'assistant']


def test_backend_swift_outputs_and_errors(engine: Any) -> None:
    backend = make_backend('swift', engine=engine, output='swift', request_config=config(max_tokens=3))
    outs = backend([sreq('s0')], None)
    assert type(outs[0]) is sp.RolloutOutput and len(outs[0].response.choices[0].token_ids) == 3
    assert backend([], None) == []
    with pytest.raises(BackendError, match='n must be 1'):
        backend([sreq('s1')], config(n=2))
    with pytest.raises(BackendError, match='no infer'):
        SwiftBackend(object())
    with pytest.raises(BackendError, match='give engine='):
        SwiftBackend()


def test_backend_from_a_model_path(engine: Any) -> None:
    """``make_backend('swift', model=<path>)`` (what ``mtflow run --backend swift`` does) builds
    a TransformersEngine; greedy outputs equal those of the engine built directly."""
    backend = make_backend('swift', model=engine.tiny_path, model_type='qwen2', template_type='qwen2_5',
                           request_config=config(max_tokens=4))
    direct = SwiftBackend(engine, config(max_tokens=4))
    a, b = backend([sreq('p0')], None)[0], direct([sreq('p0')], None)[0]
    assert a.response.choices[0].token_ids == b.response.choices[0].token_ids
    assert a.response.choices[0].message.content == b.response.choices[0].message.content


def test_real_engine_same_under_both_drivers(engine: Any) -> None:
    """Greedy decoding with the real engine: ms-swift's driver and mtflow's executor, fed the same
    first turn, produce the same trajectories (the engine also sees id-backed messages)."""
    from swift.rollout.agent_loop import run_multi_turn as swift_run
    from swift.rollout.multi_turn import MathTipsScheduler

    class TipsDespiteLength(MathTipsScheduler):
        # the random model never says <|im_end|>: every turn hits max_tokens; tip anyway
        def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
            return super().check_finished(infer_request, dataclasses.replace(response_choice, finish_reason='stop'),
                                          current_turn)

    backend = SwiftBackend(engine, config(max_tokens=6), output='swift')
    base = [sreq(f'e{i}', {'role': 'user', 'content': f'What is {i} * 2?'}, data_dict={'solution': '<answer>0</answer>'})
            for i in range(2)]
    first = backend(copy.deepcopy(base), None)
    results = {}
    for name, driver in (('swift', swift_run), ('mtflow', mtflow.run_multi_turn)):
        reqs = copy.deepcopy(base)
        sched = TipsDespiteLength(tokenizer=engine.tokenizer, max_turns=3)
        results[name] = driver(reqs, copy.deepcopy(first), sched, backend, None, 3)
    for o in results['swift'] + results['mtflow']:
        o.response.id, o.response.created = 'x', 0
    assert dump(results['mtflow']) == dump(results['swift'])
    for o in results['swift']:
        assert o.rollout_infos['num_turns'] == 2  # tip given, continued, stop
        assert MathTipsScheduler.tips_prompt in o.messages[-1]['content']
        assert len(o.response_token_ids) == 1 and 0 in o.response_loss_mask[0]


def test_adapter_server_mode_run(engine: Any) -> None:
    """``swift rollout`` builds the scheduler with the engine and awaits ``run`` per request."""
    Adapter = integ.as_swift_scheduler(Nudge)
    adapter = Adapter(infer_engine=engine, max_turns=3, tokenizer=engine.tokenizer)
    cfg = integ.to_swift(config(return_details=True))  # as the GRPO trainer's request_config

    async def serve() -> List[Any]:
        return await asyncio.gather(*[adapter.run(sreq(f'r{i}'), cfg) for i in range(2)])

    outs = asyncio.run(serve())
    for out in outs:
        assert type(out) is sp.RolloutOutput
        assert out.rollout_infos == {'num_turns': 3, integ.FINISH_REASON_KEY: 'check_finished'}
        assert [len(s) for s in out.response_token_ids] == [5, 10 + N_SO]
        assert sum(map(sum, out.response_loss_mask)) == 15 and [len(s) for s in out.rollout_logprobs] == [5, 10]
    assert not adapter._notified  # nothing left behind per request


def test_swift_46_schedulers_generate_from_exact_ids(engine: Any) -> None:
    """ms-swift's own exact-id path: a 4.6 scheduler freezes each assistant message as its token
    ids, and the engine's ``prompt_token_ids`` (``return_details``) show turn t+1 generated from
    turn t's prompt + the ids sampled at turn t."""
    from swift.rollout.multi_turn import MultiTurnScheduler

    class AskAgain(MultiTurnScheduler):
        def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
            return current_turn >= 3

        def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
            infer_request.messages.append({'role': 'user', 'content': f'and é? ({current_turn})'})
            return {'infer_request': infer_request}

    backend = SwiftBackend(engine, config(max_tokens=5, temperature=1.0, seed=0))
    seen: List[Any] = []

    def probe(requests: List[Any], request_config: Any = None) -> List[Any]:
        outs = backend(requests, request_config)
        seen.extend((r.uuid, o.response.prompt_token_ids, o.response.choices[0].token_ids) for r, o in zip(requests, outs))
        return outs

    requests = [sreq(f'x{i}', {'role': 'user', 'content': f'What is {i} + 1?'}) for i in range(2)]
    executor = mtflow.Executor(AskAgain(tokenizer=engine.tokenizer), probe)
    assert executor.settings.accounting.name == 'swift46'
    result = executor.run(requests)
    assert result.ok
    for uuid in ('x0', 'x1'):
        turns = [(p, s) for u, p, s in seen if u == uuid]
        assert len(turns) == 3 and all(p for p, _ in turns), 'the engine reports the exact prompt ids'
        for (p0, s0), (p1, _) in zip(turns, turns[1:]):
            assert p1[:len(p0) + len(s0)] == p0 + s0
