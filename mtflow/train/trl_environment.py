"""TRL's ``environment_factory`` (TRL 1.16): an mtflow scheduler as a TRL environment, each
example's episode one mtflow request, trained on mtflow's exact ids, masks and logprobs.

TRL 1.16 builds one environment instance per rollout from ``environment_factory`` (a callable, or
a dict of them selected per example by its ``environment`` column), calls ``reset(**example)``
before generation, exposes the instance's public methods as tools to its own generation loop,
and, when the class has ``get_reward``, scores each rollout with it. TRL's own loop would then
generate, parse tool calls with the chat template's response schema and append tool messages
rendered from a dummy conversation: the ids are TRL's, not what an mtflow scheduler (its tool-call
parsers, observations, stop rules, environments) would have produced. So the episode is run by
mtflow: :class:`MtflowEpisode` has no public tool method (TRL's tool loop stays off), ``reset``
turns the example into an mtflow request, and :meth:`TRLEnvironment.rollout_func` runs every
episode of a generation batch through its scheduler's executor (any scheduler, YAML or Python,
multi-turn, with tools) and hands TRL, per rollout, the exact sample (as
:class:`~mtflow.train.trl_rollout.TRLRollout` does); ``get_reward`` is the scheduler's reward
(logged by TRL under the class's name). TRL 1.16 passes ``rollout_func`` to the trainer beside
the factory::

    env = TRLEnvironment(executor)                       # or a dict name -> TRLEnvironment
    GRPOTrainer(model, args=args, train_dataset=data, **env.trainer_kwargs())

A dict of environments (``TRLEnvironment.several({'tools': a, 'game': b})``) routes each example
by its ``environment`` column to its own scheduler and executor, as TRL routes its own
environments. TRL is imported by the trainer, never here.

This is the exact-token path, and it needs ``rollout_func``: an :class:`MtflowEpisode` passed as
``environment_factory`` alone exposes no tool, so TRL would generate one reply itself and
``get_reward`` stops training with a line saying what to pass. For TRL's own tool loop with
``environment_factory`` alone (the ids then TRL's), see :mod:`mtflow.train.trl_native`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

from mtflow.core.protocol import RolloutInferRequest
from mtflow.train.samples import Sample
from mtflow.train.trl_rollout import TRLRuns, prompt_messages, run_for_trl

__all__ = ['MtflowEpisode', 'TRLEnvironment', 'ENVIRONMENT_KEY']

#: TRL's column that picks an example's environment when ``environment_factory`` is a dict
ENVIRONMENT_KEY = 'environment'
#: the example's columns that are TRL's, not the episode's data
_TRL_COLUMNS = ('prompt', ENVIRONMENT_KEY)


class MtflowEpisode:
    """One rollout's environment: an mtflow request (``reset``) and, once the batch has run, its
    trajectory's sample (``get_reward``). Its methods are private or TRL's (``reset``,
    ``get_reward``), so TRL exposes no tool of its own: the scheduler's tools run inside mtflow."""

    def __init__(self, owner: 'TRLEnvironment') -> None:
        self._owner = owner
        self._request: Optional[RolloutInferRequest] = None
        self._sample: Optional[Sample] = None

    def reset(self, **example: Any) -> None:
        """A new episode from ``example`` (TRL's dataset row): its ``prompt`` as the messages,
        every other column as the request's ``data_dict`` (a YAML scheduler's answer check reads
        it); appends nothing to the prompt."""
        if 'prompt' not in example:
            raise ValueError(f'an mtflow episode needs a "prompt" column; the example has {sorted(example)}')
        data = {k: v for k, v in example.items() if k not in _TRL_COLUMNS}
        self._request = RolloutInferRequest(messages=prompt_messages(example['prompt']), uuid='pending',
                                            data_dict=data)
        self._sample = None

    def get_reward(self) -> float:
        """The scheduler's reward for this rollout (its trajectory's ``reward``)."""
        if self._sample is None:
            raise RuntimeError('get_reward before the episode ran: an MtflowEpisode is run by rollout_func='
                               'TRLEnvironment.rollout_func (TRLEnvironment.trainer_kwargs() gives both); for TRL\'s '
                               'own tool loop with environment_factory alone, pass '
                               'mtflow.train.trl_tool_environment(scheduler, args)')
        return self._sample.reward

    @property
    def _ready(self) -> RolloutInferRequest:
        if self._request is None:
            raise RuntimeError('an mtflow episode was not reset before generation')
        return self._request


class TRLEnvironment(TRLRuns):
    """An mtflow executor (its scheduler and backend) as TRL's environment: :attr:`factory` for
    ``environment_factory``, :meth:`rollout_func` for ``rollout_func`` (``trainer_kwargs()``
    gives both). The executor's policy version is set to the trainer's ``global_step`` before
    each batch; with ``keep=True``, ``batches`` and ``requests`` keep each batch's samples and
    requests (checks, logging)."""

    def __init__(self, executor: Any, keep: bool = False, missing_logprobs: str = 'uncorrected') -> None:
        super().__init__(executor, keep, missing_logprobs)
        self._routes: Optional[Dict[str, 'TRLEnvironment']] = None

    def factory(self) -> MtflowEpisode:
        """TRL's ``environment_factory``: a fresh episode of this environment."""
        return MtflowEpisode(self)

    @classmethod
    def several(cls, environments: Mapping[str, 'TRLEnvironment'], keep: bool = False,
                missing_logprobs: str = 'uncorrected') -> 'TRLEnvironment':
        """Environments selected per example by TRL (its ``environment`` column): the result's
        :meth:`trainer_kwargs` give TRL the dict of factories and one ``rollout_func`` that runs
        each episode with the executor of its own environment."""
        router = cls(None, keep=keep, missing_logprobs=missing_logprobs)
        router._routes = dict(environments)
        return router

    def trainer_kwargs(self) -> Dict[str, Any]:
        """``environment_factory`` and ``rollout_func`` for ``GRPOTrainer(...)``."""
        factory: Any = self.factory if self._routes is None else {k: e.factory for k, e in self._routes.items()}
        return {'environment_factory': factory, 'rollout_func': self.rollout_func}

    def rollout_func(self, prompts: Sequence[Any], trainer: Any) -> Dict[str, Any]:
        """Run the batch's episodes (``trainer.environments``, one per prompt: TRL made and reset
        them) through their executors; per rollout its exact sample. A failed episode stops
        training with its error, as :class:`~mtflow.train.trl_rollout.TRLRollout` does."""
        episodes = list(getattr(trainer, 'environments', None) or [])
        if len(episodes) != len(prompts) or not all(isinstance(e, MtflowEpisode) for e in episodes):
            raise ValueError(f'rollout_func got {len(prompts)} prompts and {len(episodes)} mtflow episodes: pass '
                             'environment_factory and rollout_func together (TRLEnvironment.trainer_kwargs())')
        n = int(getattr(trainer, 'num_generations', 1) or 1)
        call, self.calls = self.calls, self.calls + 1
        step = getattr(getattr(trainer, 'state', None), 'global_step', None)
        requests = []
        for i, episode in enumerate(episodes):
            request = episode._ready
            request.uuid = f'trl{call}-{i // n}#{i % n}'
            requests.append(request)
        samples: List[Optional[Sample]] = [None] * len(episodes)
        owners: Dict[int, List[int]] = {}
        for i, episode in enumerate(episodes):
            owners.setdefault(id(episode._owner), []).append(i)
        for indices in owners.values():
            owner = episodes[indices[0]]._owner
            for k, sample in zip(indices, owner._run([requests[k] for k in indices], step)):
                samples[k] = sample
                episodes[k]._sample = sample
        done = [s for s in samples if s is not None]
        self.kept(done, requests)
        return self.fields(done, trainer)

    def _run(self, requests: List[RolloutInferRequest], step: Any) -> List[Sample]:
        if self.executor is None:
            raise ValueError('a TRLEnvironment made by several() runs no episode itself')
        return run_for_trl(self.executor, requests, step)
