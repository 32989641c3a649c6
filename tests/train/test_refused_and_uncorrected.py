"""Training on what a rollout really gave (issue 47, item 13): a NaN or infinite reward is refused
naming its request before it turns its whole group's advantages (and the next weights) into NaN;
a sample without rollout logprobs (the contract clears them, or the rollout asked for none) is
trained without the importance correction, counted, never weighted against the 0.0 its packed
row holds (``exp(logp - 0)``: truncated IS scaled each token by its own probability, masked IS
dropped every token), or the step is refused when asked."""
from __future__ import annotations

import json
import math

import pytest

from mtflow import Executor, RequestConfig
from mtflow.train import SampleError, assign_advantages, grpo, samples_from_output, samples_from_result
from mtflow.train.loop import policy_loss, reference_loop, token_logprobs, train_step
from mtflow.train.packing import pack, to_tensors

from tests.train.helpers import ToolEveryTurn, prompts, tiny_backend

torch = pytest.importorskip('torch')


class NanFor(ToolEveryTurn):
    """:class:`ToolEveryTurn` whose reward (or one turn's reward) is ``value`` for one request."""

    def __init__(self, uuid, value, per_turn=False, **kwargs):
        super().__init__(**kwargs)
        self.uuid, self.value, self.per_turn = uuid, value, per_turn

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        result = await super().on_turn_end(infer_request, response_choice, current_turn)
        if infer_request.uuid == self.uuid and not self.per_turn:
            result['rollout_infos']['reward'] = self.value
        return result

    def turn_reward(self, infer_request, response_choice, current_turn):
        if infer_request.uuid == self.uuid and self.per_turn and current_turn == 2:
            return self.value
        return super().turn_reward(infer_request, response_choice, current_turn)


def _run(scheduler, logprobs=True, groups=2, size=3):
    backend = tiny_backend(seed=0)
    requests = prompts(groups, size)
    executor = Executor(scheduler, backend, RequestConfig(max_tokens=5, temperature=1.0, logprobs=logprobs))
    result = executor.run(requests)
    assert result.ok, result.failures
    return result, requests, backend, executor


@pytest.mark.parametrize('value', [math.nan, math.inf, -math.inf], ids=['nan', 'inf', '-inf'])
def test_a_nan_or_infinite_reward_is_refused_naming_the_request(value):
    result, requests, _, _ = _run(NanFor('p1#2', value, max_turns=2))
    with pytest.raises(SampleError) as err:
        samples_from_result(result, requests)
    assert (err.value.uuid, err.value.field) == ('p1#2', 'reward')
    assert str(err.value).startswith(f"request p1#2, field 'reward': the reward is {float(value)}: a NaN or infinite "
                                     'reward would make every advantage of its group NaN')


def test_a_nan_reward_in_a_trajectory_line_and_in_a_turn_is_refused():
    line = {'uuid': 'q#0', 'reward': float('nan'), 'response_token_ids': [[7, 8]], 'response_loss_mask': [[1, 1]],
            'rollout_logprobs': [[-0.5, -0.25]],
            'rollout_infos': {'num_turns': 1, 'token_record': {'prompt_ids': [1, 2], 'glue_ids': [], 'exact': True}}}
    line = json.loads(json.dumps(line))  # NaN as json writes it in trajectories.jsonl
    with pytest.raises(SampleError, match=r"request q#0, field 'reward': the reward is nan"):
        samples_from_output(line)
    result, requests, _, _ = _run(NanFor('p0#1', math.inf, per_turn=True, max_turns=3))
    with pytest.raises(SampleError) as err:
        samples_from_result(result, requests)
    assert (err.value.uuid, err.value.turn, err.value.field) == ('p0#1', 2, 'turn_rewards')


def test_hand_made_samples_and_plain_rewards_with_a_nan_are_refused_before_any_advantage():
    result, requests, _, _ = _run(ToolEveryTurn(max_turns=2))
    samples = samples_from_result(result, requests)
    samples[4].reward = float('nan')
    with pytest.raises(SampleError, match=f"request {samples[4].uuid}, field 'reward': the reward is nan"):
        assign_advantages(samples)
    assert all(s.advantage is None for s in samples)
    with pytest.raises(ValueError, match=r'rewards\[1\] is inf'):
        grpo([0.0, math.inf, 1.0], ['g', 'g', 'g'])


def test_the_reference_loop_stops_at_a_nan_reward_before_the_weights_move():
    backend = tiny_backend(seed=0)
    model = backend.model
    executor = Executor(NanFor('p1#0', math.nan, max_turns=2), backend,
                        RequestConfig(max_tokens=5, temperature=1.0, logprobs=True))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(SampleError, match="request p1#0, field 'reward'"):
        reference_loop(executor, model, torch.optim.SGD(model.parameters(), lr=0.1), [prompts(2, 2)], row_len=256,
                       tis_cap=2.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _without_logprobs():
    """Samples of a real run whose rollout asked for no logprobs (``Sample.logprobs`` is None),
    packed, with the tiny model's logprobs of their tokens."""
    result, requests, backend, _ = _run(ToolEveryTurn(max_turns=2), logprobs=False, groups=1, size=2)
    samples = assign_advantages(samples_from_result(result, requests))
    samples[0].advantage, samples[1].advantage = 1.0, -0.5  # advantages that move the loss
    assert all(s.logprobs is None for s in samples)
    batch = to_tensors(pack(samples, 256))
    return backend.model, samples, batch, token_logprobs(backend.model, batch)


def test_samples_without_rollout_logprobs_get_no_correction_instead_of_their_own_probability():
    _, _, batch, logp = _without_logprobs()
    assert not batch['has_logprobs'].any() and batch['logprobs'].abs().sum() == 0
    plain = policy_loss(logp, batch).item()
    assert plain != 0
    # before: w = min(exp(logp - 0), cap) = the token's probability; masked IS dropped every token (loss 0)
    assert policy_loss(logp, batch, tis_cap=2.0).item() == pytest.approx(plain, rel=1e-6)
    assert policy_loss(logp, batch, mask_outside=2.0).item() == pytest.approx(plain, rel=1e-6)
    assert policy_loss(logp, batch, sequence_weight=True).item() == pytest.approx(plain, rel=1e-6)


def test_train_step_counts_the_uncorrected_samples_or_refuses_the_step():
    model, samples, _, _ = _without_logprobs()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    done = train_step(model, optimizer, samples, row_len=256, tis_cap=2.0)
    assert done['uncorrected_samples'] == 2 and done['max_logprob_gap'] is None
    with pytest.raises(SampleError) as err:
        train_step(model, optimizer, samples, row_len=256, tis_cap=2.0, missing_logprobs='refuse')
    assert (err.value.uuid, err.value.field) == (samples[0].uuid, 'rollout_logprobs')
    assert 'no rollout logprobs (2 of 2 samples have none)' in str(err.value)
    # no correction asked: nothing to refuse
    assert train_step(model, optimizer, samples, row_len=256, missing_logprobs='refuse')['uncorrected_samples'] == 2
