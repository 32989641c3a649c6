"""The ready schedulers with a real (tiny, random) transformers model through the HF backend:
free-form text from a model that knows nothing still runs guess_number for several turns, and
ReAct's inline observations keep the contract's ids/mask/logprob invariants."""
from __future__ import annotations

import pytest

import schedulers
from mtflow import Executor, RequestConfig
from mtflow.declarative import load_scheduler
from tests.helpers import req

pytest.importorskip('torch')
pytest.importorskip('transformers')
pytestmark = pytest.mark.hf


@pytest.fixture(scope='module')
def backend():
    from mtflow.backends.hf import HFBackend
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    return HFBackend(make_model(tok), tok, default_max_tokens=12, seed=0)


def check_invariants(o):
    assert len(o.response_token_ids) == len(o.response_loss_mask)
    for ids, mask in zip(o.response_token_ids, o.response_loss_mask):
        assert len(ids) == len(mask)
    assert sum(map(len, o.rollout_logprobs)) == sum(map(sum, o.response_loss_mask))  # the contract's check passed


def test_guess_number_with_a_random_model(backend):
    s = load_scheduler(schedulers.path('guess_number'), tokenizer=backend.tokenizer)
    requests = [req(f'g{i}', {'role': 'user', 'content': 'Guess the number.'}, data_dict={'target': 37})
                for i in range(3)]
    res = Executor(s, backend, RequestConfig(max_tokens=12, temperature=1.0, logprobs=True, seed=1)).run(requests)
    for o, reason in zip(res.outputs, res.finish_reasons):
        assert reason in ('stop_rule:env_done', 'max_turns')
        assert o.rollout_infos['num_turns'] >= 2  # several turns whatever the model says
        assert o.rollout_infos['env_steps'] == o.rollout_infos['num_turns']
        assert 'reward' in o.rollout_infos
        check_invariants(o)
    assert s._states == {}  # every environment closed


def test_react_calculator_with_a_random_model_and_a_forced_call(backend):
    """The first turn is given (a real tool call); later turns are the model's own text."""
    from mtflow.core.protocol import RolloutOutput, make_choice, make_response

    tok = backend.tokenizer
    s = load_scheduler(schedulers.path('react_calculator'), tokenizer=tok)
    text = 'Action: calculator\nAction Input: {"expression": "6*7"}'
    ids = tok.encode(text, add_special_tokens=False)
    first = [RolloutOutput(response=make_response(make_choice(text, ids, [-1.0] * len(ids))))]
    requests = [s.prepare(req('r', {'role': 'user', 'content': 'What is 6*7?'}))]
    res = Executor(s, backend, RequestConfig(max_tokens=12, logprobs=True, seed=2)).run(requests, first)
    o = res.outputs[0]
    assert '\nObservation: 42' in o.messages[-1]['content']
    assert 0 in o.response_loss_mask[0]
    check_invariants(o)
