"""Run by ``tests/train/test_skyrl.py`` in the SkyRL venv (``.extras/skyrl-venv``, scripts/test.sh):
multi-turn tool-use rollouts of the tiny model (HF backend, two groups of three, three turns with
a tool message between them) as SkyRL's ``GeneratorOutput`` (``mtflow.train.skyrl_data``),
through SkyRL's own builders: ``validate_generator_output``, ``concatenate_generator_outputs`` (two stream-like groups into one
batch, with its rollout metrics), ``convert_prompts_responses_to_batch_tensors`` (what its
trainer's ``convert_to_training_input`` calls) and ``compute_grpo_outcome_advantage``; each row
checked against the token record. Prints one JSON line; asserts exit non-zero."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from skyrl_train.dataset.preprocess import convert_prompts_responses_to_batch_tensors
    from skyrl_train.generators.utils import concatenate_generator_outputs
    from skyrl_train.utils.ppo_utils import compute_grpo_outcome_advantage
    from skyrl_train.utils.trainer_utils import validate_generator_output

    from mtflow.train import grpo, samples_from_result
    from mtflow.train.skyrl_data import generator_output
    from tests.train.helpers import record_mask, tiny_backend, tool_run

    backend = tiny_backend()
    result, requests = tool_run(backend, groups=2, size=3, max_turns=3)
    samples = samples_from_result(result, requests)
    parts = [generator_output([s for s in samples if s.group == g], rewards='token') for g in ('p0', 'p1')]
    out = concatenate_generator_outputs(parts)
    assert out['rollout_metrics'] is not None
    validate_generator_output(len(samples), out)  # SkyRL's own check of a generator's output
    sequences, attention, response_mask, rewards, loss_masks, logprobs = convert_prompts_responses_to_batch_tensors(
        backend.tokenizer, out['prompt_token_ids'], out['response_ids'], out['rewards'], out['loss_masks'],
        out['rollout_logprobs'])
    width = max(len(s.prompt_ids) for s in samples)
    for r, request in enumerate(requests):
        record = request.token_record
        keep = attention[r].bool()
        assert sequences[r][keep].tolist() == record.sequence()  # exactly what the model saw, glue included
        n = int(response_mask[r].sum())
        mask = [0] * len(record.prompt_ids) + [int(v) for v in loss_masks[r][:n].tolist()]
        assert mask == record_mask(record)
        trained = loss_masks[r][:n].bool()
        got = logprobs[r][:n][trained].tolist()
        want = [v for turn in record.turns for v in turn.logprobs]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6 and len(got) == len(want)
        sample = samples[r]
        assert abs(float(rewards[r].sum()) - (sample.reward + sum(sample.turn_rewards.values()))) < 1e-6
        assert sequences.shape[1] == width + response_mask.shape[1]
    uids = np.array([t.instance_id for t in out['trajectory_ids']])
    advantages, _ = compute_grpo_outcome_advantage(rewards, response_mask, uids)
    totals = rewards.sum(-1).tolist()
    expected = grpo(totals, list(uids), eps=1e-6)
    for r in range(len(samples)):
        got = advantages[r][response_mask[r].bool()]
        assert float((got - expected[r]).abs().max()) < 1e-4
    print(json.dumps({'rows': len(samples), 'trained': [int(m.sum()) for m in loss_masks],
                      'advantages': [round(a, 4) for a in expected],
                      'trajectory_ids': [t.to_string() for t in out['trajectory_ids']]}))
    return 0


if __name__ == '__main__':
    sys.exit(main())
