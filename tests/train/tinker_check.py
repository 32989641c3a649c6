"""Run by ``tests/train/test_tinker.py`` in the Tinker venv (``.extras/tinker-venv``,
scripts/test.sh): multi-turn tool-use rollouts of the tiny model (HF backend, two groups of three,
three turns with a tool message between them), converted by ``mtflow.train.tinker_data``, against
the cookbook's own builders on the same rollout (``compute_advantages`` and
``assemble_training_data`` over :func:`to_trajectory`'s trajectories). Prints one JSON line;
asserts exit non-zero."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def arrays(datum):
    return {k: v.to_torch().tolist() for k, v in datum.loss_fn_inputs.items()}


def main() -> int:
    import tinker
    from tinker_cookbook.rl.data_processing import assemble_training_data, compute_advantages

    from mtflow.train import samples_from_result
    from mtflow.train.tinker_data import datums, to_trajectory, trajectory_group
    from tests.train.helpers import tiny_backend, tool_run

    result, requests = tool_run(tiny_backend(), groups=2, size=3, max_turns=3)
    samples = samples_from_result(result, requests)
    mine = datums(samples)
    # the trajectories are the rollout's: each turn's observation is exactly the prompt that turn was generated from
    for sample, request in zip(samples, requests):
        record = request.token_record
        trajectory = to_trajectory(sample)
        sequence = record.sequence()
        assert [t.ob.to_ints() for t in trajectory.transitions] == [sequence[:turn.prompt_len] for turn in record.turns]
        assert [t.ac.tokens for t in trajectory.transitions] == [turn.sampled for turn in record.turns]
        assert [t.ac.logprobs for t in trajectory.transitions] == [turn.logprobs for turn in record.turns]
    groups = [trajectory_group([s for s in samples if s.group == g]) for g in ('p0', 'p1')]
    theirs, meta = assemble_training_data(groups, compute_advantages(groups), include_provenance=False)
    assert len(theirs) == len(mine) == 6 and [m['group_idx'] for m in meta] == [0, 0, 0, 1, 1, 1]
    for a, b in zip(mine, theirs):
        assert a.model_input.to_ints() == b.model_input.to_ints()
        ours, cookbook = arrays(a), arrays(b)
        assert ours.keys() == cookbook.keys()
        for key in ours:
            assert max(abs(x - y) for x, y in zip(ours[key], cookbook[key])) < 1e-6, key
            assert len(ours[key]) == len(cookbook[key]) == a.model_input.length
    # the wire dtypes Tinker's training client sends
    assert {k: str(v.dtype) for k, v in mine[0].loss_fn_inputs.items()} == \
        {k: str(v.dtype) for k, v in theirs[0].loss_fn_inputs.items()}
    assert isinstance(mine[0], tinker.Datum)
    print(json.dumps({'datums': len(mine), 'tokens': [d.model_input.length for d in mine],
                      'trained': [int(sum(arrays(d)['mask'])) for d in mine],
                      'advantages': sorted({round(max(arrays(d)['advantages'], key=abs), 4) for d in mine})}))
    return 0


if __name__ == '__main__':
    sys.exit(main())
