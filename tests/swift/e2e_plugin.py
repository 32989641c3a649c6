"""Second ``--external_plugins`` file of the end-to-end GRPO test: a reward with variance for a
random model (so advantages, loss and gradients are non-zero) that also checks what the trainer
hands rewards from an mtflow scheduler's rollouts."""
from typing import Any, List

from swift.rewards import ORM, orms


class DistinctChars(ORM):
    """Share of distinct characters in the completion: differs between random samples."""

    def __call__(self, completions: List[str], **kwargs: Any) -> List[float]:
        infos = kwargs.get('rollout_infos') or [{}] * len(completions)
        assert all('num_turns' in (i or {}) for i in infos), infos  # mtflow's outputs reached the reward
        return [len(set(c)) / max(len(c), 1) for c in completions]


orms['mtflow_e2e_distinct'] = DistinctChars
