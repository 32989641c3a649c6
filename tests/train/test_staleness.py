"""``stale='withhold'``: a sample whose tokens are too many versions behind stays in its group's
baseline with its tokens masked out of the loss; by hand on a small batch, then over a real stream
(tiny model, ``Executor.stream``) with a simulated trainer that moves the weights two versions per
step against a bound of 1."""
from __future__ import annotations

import statistics

import pytest

from mtflow import Executor, RequestConfig
from mtflow.train import Sample, SampleError, assign_advantages, grpo, samples_from_group
from mtflow.train.packing import pack
from mtflow.train.staleness import StalePolicy

from tests.train.helpers import ToolEveryTurn, prompts, tiny_backend


def _s(uuid, reward, versions, mask=None):
    mask = mask or [1 if v is not None else 0 for v in versions]
    return Sample(uuid=uuid, group='g', reward=reward, prompt_ids=[1], completion_ids=list(range(len(versions))),
                  loss_mask=mask, versions=versions)


def test_withhold_keeps_the_reward_in_the_baseline_and_the_tokens_out_of_the_loss():
    batch = [_s('a', 1.0, [1, 1]), _s('b', 0.0, [2, None, 2]), _s('c', 0.0, [3]), _s('d', 1.0, [3, 3])]
    policy = StalePolicy(max_staleness=1, stale='withhold')
    out = assign_advantages(policy.apply(batch, current_version=3))
    assert [s.loss_mask for s in out] == [[0, 0], [1, 0, 1], [1], [1, 1]]  # a is 2 versions behind
    assert [s.withheld_tokens for s in out] == [2, 0, 0, 0]
    assert batch[0].loss_mask == [1, 1]  # the input is not changed
    # a's reward 1.0 is in the baseline: mean 0.5, unbiased std sqrt(1/3), as if nothing were stale
    sd = (1 / 3) ** 0.5
    assert [s.advantage for s in out] == pytest.approx([0.5 / (sd + 1e-4), -0.5 / (sd + 1e-4), -0.5 / (sd + 1e-4),
                                                        0.5 / (sd + 1e-4)])
    assert policy.counts.to_dict() == {'samples': 4, 'stale_samples': 1, 'withheld_samples': 1,
                                       'withheld_tokens': 2, 'dropped_samples': 0, 'dropped_tokens': 0,
                                       'kept_stale_samples': 0}


def test_drop_takes_the_reward_out_of_the_baseline_and_keep_trains_it():
    batch = [_s('a', 1.0, [1, 1]), _s('b', 0.0, [2]), _s('c', 0.0, [3]), _s('d', 1.0, [3])]
    dropped = StalePolicy(1, stale='drop')
    out = assign_advantages(dropped.apply(batch, 3))
    assert [s.uuid for s in out] == ['b', 'c', 'd']
    # baseline over 0, 0, 1: mean 1/3, std sqrt(1/3)
    assert out[2].advantage == pytest.approx((2 / 3) / ((1 / 3) ** 0.5 + 1e-4))
    assert (dropped.counts.dropped_samples, dropped.counts.dropped_tokens) == (1, 2)
    kept = StalePolicy(1, stale='keep')
    assert kept.apply(batch, 3) == batch and kept.counts.kept_stale_samples == 1


def test_token_granularity_withholds_only_the_stale_turns():
    policy = StalePolicy(1, stale='withhold', granularity='token')
    (s, ) = policy.apply([_s('a', 1.0, [1, 1, None, 3, 3], mask=[1, 1, 0, 1, 1])], current_version=3)
    assert s.loss_mask == [0, 0, 0, 1, 1] and s.withheld_tokens == 2
    with pytest.raises(ValueError, match="granularity='token' is for stale='withhold'"):
        StalePolicy(1, stale='drop', granularity='token')
    with pytest.raises(SampleError, match="request x, turn 1, field 'policy_versions': no policy versions"):
        policy.apply([Sample('x', 'g', 0.0, [1], [2], [1])], 3)


class UnevenTurns(ToolEveryTurn):
    """Member ``k`` of a group (uuid ``p<g>#<k>``) has ``k + 1`` turns."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return current_turn >= 1 + int(infer_request.uuid.rpartition('#')[2])


def _source():
    g = 0
    while True:
        yield prompts(1, 3, start=g)
        g += 1


def test_withhold_over_a_stream_with_a_simulated_trainer():
    pytest.importorskip('torch')
    executor = Executor(UnevenTurns(max_turns=3), tiny_backend(max_tokens=4),
                        RequestConfig(max_tokens=4, temperature=1.0, logprobs=True))
    executor.set_policy_version(0)
    policy = StalePolicy(max_staleness=1, stale='withhold')
    version, seen, withheld, withheld_tokens, trained = 0, 0, 0, 0, 0
    with executor.stream(_source(), max_concurrency=6, buffer=2, until={'groups': 6}) as stream:
        for group in stream:  # the simulated trainer: one step per group, two versions per step
            samples = samples_from_group(group)
            batch = assign_advantages(policy.apply(samples, current_version=version))
            assert len(batch) == len(samples) == len(group.outputs) == 3
            rewards = [s.reward for s in samples]
            mean, sd = statistics.mean(rewards), statistics.stdev(rewards)
            for before, s, stamps in zip(samples, batch, group.versions):
                stale = version - min(stamps) > 1  # the stream's own per-turn stamps say which are stale
                assert s.withheld == stale
                assert s.loss_mask == ([0] * len(before.loss_mask) if stale else before.loss_mask)
                # every member's reward is in the baseline, withheld or not
                assert s.advantage == pytest.approx((s.reward - mean) / (sd + 1e-4), abs=1e-9)
                withheld += stale
                withheld_tokens += before.trained_tokens if stale else 0
                trained += 0 if stale else before.trained_tokens
            assert [s.advantage for s in batch] == pytest.approx(grpo(rewards, ['g'] * 3))
            rows = pack(batch, row_len=512)  # what the loss receives: withheld tokens are mask 0 there too
            assert sum(sum(r.loss_mask) for r in rows) == sum(s.trained_tokens for s in batch)
            seen += 1
            version += 2
            executor.set_policy_version(version)
    assert seen == 6
    c = policy.counts
    assert (c.samples, c.withheld_samples, c.withheld_tokens) == (18, withheld, withheld_tokens)
    assert c.stale_samples == withheld and c.dropped_samples == 0
    assert withheld > 0 and trained > 0  # both kinds happened: the groups admitted before an update went stale
