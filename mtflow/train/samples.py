"""Training samples: one per exact-token segment of a trajectory, straight from the accounting.

A trajectory (a ``RolloutOutput``, a line of ``trajectories.jsonl``, a member of a
``StreamGroup``) holds the ids every turn was generated from, but in the driver's layout: one
segment per assistant message, the template's glue between them in
``rollout_infos['token_record']``, earlier context segments (compactions) in
``rollout_infos['context_segments']``. :func:`samples_from_output` turns each context segment into
one :class:`Sample` (the segments and their flattening are the accounting's own,
:func:`mtflow.accounting.segments_split.segments_of` and ``flat_sample``), so that ``prompt_ids + completion_ids`` is exactly the sequence the model was
conditioned on and ``loss_mask`` is exactly the accounting's.

What cannot be trained on exactly is refused, never patched: a segment without prompt ids (the
backend kept no token record), one whose ids were re-rendered from text after a turn, a mask or
logprobs that do not line up with the ids, a NaN or infinite reward (:func:`finite_reward`). :class:`SampleError` names the request and the turn.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from mtflow.accounting.segments_split import flat_sample, segments_of
from mtflow.accounting.token_record import RESTART_KEY
from mtflow.core.machine import FAILURE_REASONS
from mtflow.data.sources import group_of
from mtflow.run.trajectories import Trajectory, iter_trajectories, reward_of
from mtflow.train.errors import SampleError
from mtflow.train.token_turns import token_turns, token_versions

#: the ``rollout_infos`` key of the per-turn environment-state fingerprints
STATE_KEYS = 'state_keys'

__all__ = ['STATE_KEYS', 'Sample', 'SampleError', 'finite_reward', 'check_rewards', 'samples_from_output', 'samples_from_trajectory', 'samples_from_result',
           'samples_from_group', 'read_samples']


@dataclass
class Sample:
    """One exact-token training sample: a context segment of one trajectory.

    ``completion_ids`` are the segment's assistant messages with the template's glue (tool and
    user messages, turn separators) between them; ``loss_mask`` is aligned with them (1: a sampled
    token to train, 0: glue, observations, or what the scheduler masked). ``logprobs`` and
    ``versions`` are aligned with ``completion_ids`` too: the rollout's logprob and the policy
    version that sampled each trained token (``0.0`` / ``None`` elsewhere); ``logprobs`` is
    ``None`` when the rollout asked for none, ``versions`` when no versions were stamped."""
    uuid: str
    group: str
    reward: float
    prompt_ids: List[int]
    completion_ids: List[int]
    loss_mask: List[int]
    logprobs: Optional[List[float]] = None
    versions: Optional[List[Optional[int]]] = None
    #: aligned with ``completion_ids``: the turn that sampled each token (``None`` on glue; ``None``
    #: altogether when the turns cannot be placed: :func:`mtflow.train.token_turns.token_turns`)
    token_turns: Optional[List[Optional[int]]] = None
    #: the per-turn rewards of the segment's turns (``rollout_infos['turn_rewards']``, summed per turn)
    turn_rewards: Dict[int, float] = field(default_factory=dict)
    #: the environment-state fingerprint each turn was generated from, where the scheduler or env
    #: supplies one (``rollout_infos['state_keys']``: ``[{'turn': t, 'key': str}]``; GiGPO's anchors)
    state_keys: Dict[int, str] = field(default_factory=dict)
    segment: int = 0
    segments: int = 1
    turns: Tuple[int, int] = (1, 1)
    #: set by a stale policy (:mod:`mtflow.train.staleness`): tokens masked out of the loss as stale
    withheld_tokens: int = 0
    #: set by :func:`mtflow.train.advantages.assign_advantages`
    advantage: Optional[float] = None
    #: per-token advantages aligned with ``completion_ids`` (:func:`mtflow.train.advantages.assign_turn_advantages`);
    #: when set, packing uses them instead of ``advantage``
    token_advantages: Optional[List[float]] = None

    @property
    def input_ids(self) -> List[int]:
        """The whole sequence the model saw: prompt then completion."""
        return self.prompt_ids + self.completion_ids

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def withheld(self) -> bool:
        return self.withheld_tokens > 0

    def masked(self, keep: Sequence[int], withheld: int) -> 'Sample':
        """A copy with ``loss_mask`` replaced by ``keep`` (``withheld`` tokens it took out)."""
        return replace(self, loss_mask=list(keep), withheld_tokens=self.withheld_tokens + withheld)


def finite_reward(value: Any, uuid: str, turn: Optional[int] = None, field: str = 'reward') -> float:
    """``value`` as a float, or :class:`SampleError` naming the request (and turn) when it is NaN or
    infinite: one such reward makes its whole group's mean, std and so every advantage of the
    group NaN (and the next step's weights with them), so it is refused before any is computed."""
    reward = float(value)
    if not math.isfinite(reward):
        raise SampleError(f'the reward is {reward}: a NaN or infinite reward would make every advantage of its '
                          'group NaN; fix the reward function (or leave the request out)', uuid=uuid, turn=turn,
                          field=field)
    return reward


def check_rewards(samples: Sequence['Sample']) -> None:
    """:func:`finite_reward` on every sample's reward and per-turn rewards (samples built by hand
    too), before advantages are computed from them."""
    for sample in samples:
        finite_reward(sample.reward, sample.uuid)
        for turn, reward in sample.turn_rewards.items():
            finite_reward(reward, sample.uuid, turn, 'turn_rewards')


def _get(output: Any, name: str) -> Any:
    return output.get(name) if isinstance(output, dict) else getattr(output, name, None)


def _first_bad_turn(flat: Dict[str, Any], infos: Dict[str, Any], last: bool) -> int:
    """The turn where a segment stopped being exact: the first one rendered from text."""
    start = flat['turns'][0]
    summary = (infos.get('token_record') or {}) if last else {}
    bad = list(summary.get('rendered_turns') or []) + list(summary.get('template_unstable_turns') or [])
    return start + min(bad) - 1 if bad else start


def _check_exact(flat: Dict[str, Any], uuid: str, infos: Dict[str, Any], last: bool) -> None:
    start = flat['turns'][0]
    if not flat['response_ids']:
        raise SampleError('no token ids: the backend returned none (exact samples need a backend that keeps a '
                          'token record: hf, vllm, openai in token mode)', uuid=uuid, turn=start,
                          field='response_token_ids')
    restart = infos.get(RESTART_KEY) if last else None
    if restart and (flat['prompt_ids'] is None or not flat['exact']):
        raise SampleError(f"this turn's prompt was rendered from text ({restart.get('why')}): "
                          f"{restart.get('changed')}; the turns before it and after it are not one sequence the "
                          'model saw, so they cannot be one exact sample (keep the history as the model saw it, or '
                          "start a new segment: a step's new_segment)", uuid=uuid, turn=int(restart.get('turn', start)),
                          field='messages')
    if flat['prompt_ids'] is None:
        raise SampleError("no prompt ids: the segment's ids were not kept from a token record (a backend without "
                          "one, or an accounting other than the record's), so prompt + response is not a sequence "
                          'the model saw', uuid=uuid, turn=start, field='prompt_ids')
    if not flat['exact']:
        raise SampleError('the prompt of this turn was rendered from text instead of extending the ids before it '
                          '(the history was edited, or the template rewrites it): prompt + response is not one '
                          'sequence the model saw', uuid=uuid, turn=_first_bad_turn(flat, infos, last),
                          field='token_record')
    if len(flat['loss_mask']) != len(flat['response_ids']):
        raise SampleError(f"loss mask has {len(flat['loss_mask'])} values for {len(flat['response_ids'])} ids",
                          uuid=uuid, turn=start, field='response_loss_mask')


def _aligned_logprobs(flat: Dict[str, Any], uuid: str) -> Optional[List[float]]:
    """The rollout logprobs placed on the trained tokens (the contract: they cover exactly the
    mask's 1s), ``0.0`` elsewhere; ``None`` without logprobs."""
    values = flat['logprobs']
    if not values:
        return None
    mask = flat['loss_mask']
    if len(values) != sum(mask):
        raise SampleError(f'{len(values)} rollout logprobs for {sum(mask)} trained tokens: they cannot be paired '
                          'with their tokens', uuid=uuid, turn=flat['turns'][0], field='rollout_logprobs')
    it = iter(values)
    return [float(next(it)) if m else 0.0 for m in mask]


def _turn_rewards(infos: Dict[str, Any], turns: Tuple[int, int], uuid: str) -> Dict[int, float]:
    out: Dict[int, float] = {}
    for entry in infos.get('turn_rewards') or ():
        turn = int(entry.get('turn', 0))
        if turns[0] <= turn <= turns[1]:
            out[turn] = out.get(turn, 0.0) + finite_reward(entry['reward'], uuid, turn, 'turn_rewards')
    return out


FAILED = ('raise', 'skip')


def _state_keys(infos: Dict[str, Any], turns: Tuple[int, int]) -> Dict[int, str]:
    return {int(e['turn']): str(e['key']) for e in infos.get(STATE_KEYS) or ()
            if turns[0] <= int(e['turn']) <= turns[1]}


def _failed(uuid: str, reason: Optional[str], failed: str) -> bool:
    """Whether a request that finished with ``reason`` is left out (``failed='skip'``); a failed
    one is an error with ``failed='raise'``."""
    if failed not in FAILED:
        raise ValueError(f'failed must be one of {FAILED}, not {failed!r}')
    if reason not in FAILURE_REASONS:
        return False
    if failed == 'skip':
        return True
    raise SampleError(f"the request failed (finish reason {reason!r}): its output is partial, not a trajectory to "
                      "train on (pass failed='skip' to leave failed requests out)", uuid=uuid, field='finish_reason')


def samples_from_output(output: Any, uuid: Optional[str] = None, *, group: Optional[str] = None,
                        reward: Optional[float] = None, finish_reason: Optional[str] = None) -> List[Sample]:
    """Every context segment of one trajectory as a :class:`Sample` (all share its reward and
    group). ``output`` is a ``RolloutOutput`` (by attribute) or a trajectory line (a dict);
    ``reward`` and ``group`` default to the line's, else ``rollout_infos['reward']`` and the uuid
    without its ``#k`` copy suffix; ``finish_reason`` (default: the line's) of a failed request
    (``error``, ``timeout``) is refused. Raises :class:`SampleError` for what is not exact."""
    uuid = uuid if uuid is not None else _get(output, 'uuid')
    if uuid is None:
        raise SampleError('a trajectory without a uuid: pass uuid=', field='uuid')
    uuid = str(uuid)
    reason = finish_reason if finish_reason is not None else (_get(output, 'finish_reason')
                                                              if isinstance(output, dict) else None)
    _failed(uuid, reason, 'raise')
    infos = _get(output, 'rollout_infos') or {}
    if reward is None:
        reward = _get(output, 'reward') if isinstance(output, dict) else None
        reward = reward if reward is not None else reward_of(infos)
    if reward is None or isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise SampleError(f'no numeric reward (rollout_infos reward is {infos.get("reward")!r}); pass reward=',
                          uuid=uuid, field='reward')
    reward = finite_reward(reward, uuid)
    group = group if group is not None else (_get(output, 'group') if isinstance(output, dict) else None)
    group = str(group) if group is not None else group_of(uuid)
    segments = segments_of(output)
    samples = []
    for k, segment in enumerate(segments):
        flat = flat_sample(segment)
        _check_exact(flat, uuid, infos, k == len(segments) - 1)
        turns = (int(flat['turns'][0]), int(flat['turns'][1] or flat['turns'][0]))
        placed = token_turns(segment, flat['loss_mask'], turns)
        versions = token_versions(segment, flat['loss_mask'], infos, uuid, turns, placed)
        samples.append(Sample(uuid=uuid, group=group, reward=float(reward), prompt_ids=list(flat['prompt_ids']),
                              completion_ids=list(flat['response_ids']), loss_mask=[int(m) for m in flat['loss_mask']],
                              logprobs=_aligned_logprobs(flat, uuid), versions=versions, segment=flat['segment'],
                              segments=len(segments), turns=turns, token_turns=placed,
                              turn_rewards=_turn_rewards(infos, turns, uuid), state_keys=_state_keys(infos, turns)))
    return samples


def samples_from_trajectory(line: Union[Trajectory, Dict[str, Any]], failed: str = 'raise') -> List[Sample]:
    """The samples of one ``trajectories.jsonl`` line (a dict or a :class:`Trajectory`); a failed
    request's line is an error, or ``[]`` with ``failed='skip'``."""
    d = line.to_dict() if isinstance(line, Trajectory) else line
    if _failed(str(d.get('uuid')), d.get('finish_reason'), failed):
        return []
    return samples_from_output(d)


def samples_from_result(result: Any, requests: Sequence[Any], failed: str = 'raise') -> List[Sample]:
    """The samples of an ``Executor.run`` result; ``requests`` (the input, same order) give the
    uuids and, from their ``data_dict``, the groups; failed requests are an error, or left out with
    ``failed='skip'``."""
    if len(requests) != len(result.outputs):
        raise ValueError(f'{len(result.outputs)} outputs but {len(requests)} requests')
    out: List[Sample] = []
    for request, output, reason in zip(requests, result.outputs, result.finish_reasons):
        uuid = str(getattr(request, 'uuid'))
        if _failed(uuid, reason, failed):
            continue
        data = getattr(request, 'data_dict', None)
        out += samples_from_output(output, uuid, group=group_of(uuid, data if isinstance(data, dict) else None),
                                   finish_reason=reason)
    return out


def samples_from_group(group: Any, reward: Optional[Sequence[float]] = None, failed: str = 'raise') -> List[Sample]:
    """The samples of a ``StreamGroup`` (``Executor.stream``): one group id for all its members
    (the first member's), ``reward[k]`` for member ``k`` when given; a failed member is an error,
    or left out with ``failed='skip'``."""
    if not group.uuids:
        return []
    data = getattr(group.requests[0], 'data_dict', None) if group.requests else None
    name = group_of(str(group.uuids[0]), data if isinstance(data, dict) else None)
    out: List[Sample] = []
    for k, (uuid, output, reason) in enumerate(zip(group.uuids, group.outputs, group.finish_reasons)):
        if _failed(str(uuid), reason, failed):
            continue
        out += samples_from_output(output, str(uuid), group=name, reward=None if reward is None else reward[k],
                                   finish_reason=reason)
    return out


def read_samples(path: Union[str, Path], failed: str = 'raise') -> Iterator[Sample]:
    """The samples of every line of a run's ``trajectories.jsonl``, in file order (``failed``: as
    :func:`samples_from_trajectory`)."""
    for traj in iter_trajectories(path):
        yield from samples_from_trajectory(traj, failed)
