"""ms-swift 4.6's GRPO trainer fed by an mtflow stream: :class:`StreamGRPOTrainer`.

ms-swift's ``GRPOTrainer`` generates a batch from inside its training step
(``_generate_completions``) and trains on what comes back. :class:`StreamGRPOTrainer` overrides
that one method: the completions come from an mtflow :meth:`Executor.stream
<mtflow.Executor.stream>` (any mtflow scheduler, YAML or Python, multi-turn, tools), which keeps
generating between the steps, hands groups out as they finish and bounds their staleness
(``max_staleness``; :class:`~mtflow.train.staleness.StalePolicy` withholds stale tokens at
training time). Everything after generation is ms-swift's own: its reward functions, advantages,
old/ref log-probs, loss, logging.

* **Groups**: the stream's source is the training dataset (:meth:`StreamGRPOTrainer.rows`), one
  group of ``num_generations`` copies per row; a step takes as many finished groups as its
  generation batch holds prompts, members consecutive, as ms-swift's advantages expect. The
  dataloader's own rows only pace the steps.
* **Versions**: before each generation batch the executor's policy version is set to the
  trainer's ``global_step`` (the weights after that many updates); every turn is stamped with the
  version that sampled it, and the stream's ``max_staleness`` and the stale policy compare
  against it.
* **Exact tokens**: each trajectory becomes one :class:`mtflow.train.Sample` (the token record's
  ``prompt_ids``, ``completion_ids`` with the tool messages and template glue between the turns,
  the loss mask, the rollout logprobs), and the loss is encoded from it as it is: ms-swift's
  template never re-renders the conversation (:func:`exact_encoding`), the masked tokens get
  label ``-100``, and ``rollout_logprobs`` cover exactly the trained tokens (ms-swift's rollout
  importance sampling reads them). Tokens a stale policy withholds are taken out of the loss's
  ``completion_mask`` once ms-swift has collated the batch (a row must keep labels for ms-swift
  to place its completion).
* **Weights shared with the rollouts**: a backend that generates with the very weights being
  trained (an HF backend over ``trainer.model``) must not run during an update:
  :meth:`StreamGRPOTrainer.locked` wraps its ``rollout_fn`` with the trainer's lock, which the
  trainer holds from the moment it has its batch until it asks for the next one. A backend of
  its own (a vLLM server) needs no lock, and generates while the trainer trains.

The one place mtflow steps into ms-swift's pipeline past ``_generate_completions`` is the
encoding: while ms-swift prepares a batch (``_prepare_batch_inputs``), the template's ``encode``
answers for mtflow's samples with their exact ids and hands everything else to ms-swift's own.

Single process, training only: evaluation, several ranks and ms-swift's own ``async_generate``
are refused with the reason. ms-swift is imported with this module (seconds): nothing else in
mtflow imports it.
"""
from __future__ import annotations

import copy
import random
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Union

from swift.rewards import ORM, orms
from swift.rl_core.data import GRPOSample
from swift.rlhf_trainers import GRPOTrainer
from swift.trainers import TrainerFactory
from swift.utils import remove_response

from mtflow.engine.executor import Executor
from mtflow.integrations.swift.converters import from_swift, to_swift
from mtflow.run.trajectories import reward_of
from mtflow.train.errors import SampleError
from mtflow.train.samples import Sample, finite_reward, samples_from_group
from mtflow.train.staleness import StalePolicy

__all__ = ['StreamGRPOTrainer', 'StreamSample', 'MtflowReward', 'exact_encoding', 'use_stream_trainer',
           'STREAM_OPTIONS', 'EXACT_KEY', 'REWARD_NAME']

#: the options of :meth:`mtflow.Executor.stream` a trainer passes on
STREAM_OPTIONS = ('max_concurrency', 'buffer', 'max_staleness', 'stale', 'on_update')
#: the key under which a sample's template dict carries its exact sample to the encoding
EXACT_KEY = 'mtflow_exact_sample'
#: the ``--reward_funcs`` name of :class:`MtflowReward`
REWARD_NAME = 'mtflow_reward'


@dataclass
class StreamSample(GRPOSample):
    """ms-swift's GRPO sample with the mtflow sample its loss is encoded from: ``mtflow_sample``
    (its ``loss_mask`` what trains, after a stale policy) and ``rollout_mask`` (the rollout's
    mask before it: the labels, so that every row keeps a completion ms-swift can place; the
    withheld tokens leave the loss's ``completion_mask`` afterwards)."""
    mtflow_sample: Optional[Sample] = None
    rollout_mask: Optional[List[int]] = None

    def to_template_dict(self) -> Dict[str, Any]:
        data = super().to_template_dict()
        if self.mtflow_sample is not None:
            data[EXACT_KEY] = exact_encoded(self.mtflow_sample, self.rollout_mask)
        return data


def exact_encoded(sample: Sample, mask: Optional[Sequence[int]] = None) -> Dict[str, Any]:
    """What ms-swift's template returns for a training row, from an exact sample: ``input_ids``
    ``prompt_ids + completion_ids``, ``labels`` the ids where ``mask`` (default: the sample's
    loss mask) is 1 and ``-100`` elsewhere (the prompt, tool messages, template glue)."""
    mask = sample.loss_mask if mask is None else mask
    ids = list(sample.prompt_ids) + list(sample.completion_ids)
    labels = [-100] * len(sample.prompt_ids) + [t if m else -100 for t, m in zip(sample.completion_ids, mask)]
    return {'input_ids': ids, 'labels': labels, 'length': len(ids), 'lengths': [len(ids)]}


@contextmanager
def exact_encoding(template: Any) -> Iterator[None]:
    """While it lasts, ``template.encode`` returns a :class:`StreamSample`'s exact encoding (its
    template dict carries it: :func:`exact_encoded`) and encodes anything else with ms-swift's own
    ``encode``."""
    own = template.encode
    shadowed = 'encode' in vars(template)

    def encode(inputs: Any, return_template_inputs: bool = False, return_length: bool = False) -> Any:
        exact = inputs.pop(EXACT_KEY, None) if isinstance(inputs, dict) else None
        if exact is None:
            return own(inputs, return_template_inputs=return_template_inputs, return_length=return_length)
        encoded = dict(exact)
        if not return_length:
            encoded.pop('lengths')
        return encoded

    template.encode = encode
    try:
        yield
    finally:
        if shadowed:
            template.encode = own
        else:
            del template.encode


class MtflowReward(ORM):
    """``--reward_funcs mtflow_reward``: the reward mtflow's scheduler gave each trajectory
    (``rollout_infos['reward']``); a trajectory without one is an error naming it."""

    def __call__(self, completions: List[Any], rollout_infos: Optional[List[Dict[str, Any]]] = None,
                 request_id: Optional[List[str]] = None, **kwargs: Any) -> List[float]:
        infos = rollout_infos if rollout_infos is not None else [None] * len(completions)
        rewards = []
        for k, info in enumerate(infos):
            reward = reward_of(info)
            name = request_id[k] if request_id else k
            if reward is None:
                raise ValueError(f"{REWARD_NAME}: trajectory {name!r} has no numeric rollout_infos['reward'] "
                                 f'(the scheduler gave none): use another reward function')
            rewards.append(finite_reward(reward, str(name)))
        return rewards


orms[REWARD_NAME] = MtflowReward

ExecutorSource = Union[Executor, Callable[['StreamGRPOTrainer'], Executor], None]


class StreamGRPOTrainer(GRPOTrainer):
    """ms-swift's ``GRPOTrainer`` whose completions come from an mtflow stream (module docstring).

    Keyword arguments, beside ms-swift's (each also a class attribute, for a plugin's subclass
    that ms-swift builds itself; an argument wins):

    * ``executor``: the :class:`mtflow.Executor` to stream through, or a function of the trainer
      returning one (called at the first generation, when ``trainer.model`` is ready); ``None``:
      :meth:`make_executor`;
    * ``stream_options``: :meth:`mtflow.Executor.stream`'s ``max_concurrency``, ``buffer``,
      ``max_staleness``, ``stale``, ``on_update``;
    * ``stale_policy``: a :class:`~mtflow.train.staleness.StalePolicy` applied to every batch
      against the trainer's step (``'withhold'`` or ``'keep'``: ms-swift's advantages need whole
      groups, so a stale sample cannot leave its group);
    * ``rows``: the dataset rows (dicts, as ms-swift's dataset gives them) the stream makes its
      groups from, or a function of the trainer returning them; ``None``: :meth:`rows`;
    * ``keep``: keep every batch taken (:attr:`taken`: the stream groups and their samples) for
      checks and logging.

    The stream starts at the first generation and is closed when :meth:`train` returns or raises
    (:meth:`close_stream`); its groups not taken are then in ``trainer.stream.untaken``, the
    requests in flight in ``trainer.stream.unfinished``. The dataset row of each group pulled is
    kept until the group is taken: with ``stale='drop'`` in ``stream_options``, the rows of the
    groups the stream drops stay until training ends (one row per dropped group).
    """
    sample_cls = StreamSample
    executor_source: ExecutorSource = None
    stream_options: Dict[str, Any] = {}
    stale_policy: Optional[StalePolicy] = None
    row_source: Any = None
    keep: bool = False

    def __init__(self, *args: Any, executor: ExecutorSource = None, stream_options: Optional[Dict[str, Any]] = None,
                 stale_policy: Optional[StalePolicy] = None, rows: Any = None, keep: Optional[bool] = None,
                 **kwargs: Any) -> None:
        self.executor_source = executor if executor is not None else type(self).executor_source
        self.stream_options = dict(stream_options if stream_options is not None else type(self).stream_options)
        self.stale_policy = stale_policy if stale_policy is not None else type(self).stale_policy
        self.row_source = rows if rows is not None else type(self).row_source
        self.keep = bool(keep if keep is not None else type(self).keep)
        self._check_options()
        #: held by the trainer from when it has a batch until it asks for the next (see :meth:`locked`)
        self.rollout_lock = threading.Lock()
        self._holding = False
        #: the mtflow executor (not ``executor``: ms-swift's trainer has a thread pool by that name)
        self.mtflow_executor: Optional[Executor] = None
        self.stream: Any = None
        #: with ``keep``: one dict per batch taken: ``version``, ``groups``, ``samples`` (after the stale policy)
        self.taken: List[Dict[str, Any]] = []
        self._rows: Dict[str, StreamSample] = {}
        super().__init__(*args, **kwargs)
        self._check_trainer()

    # ---- checks -----------------------------------------------------------------------------------
    def _check_options(self) -> None:
        unknown = sorted(set(self.stream_options) - set(STREAM_OPTIONS))
        if unknown:
            raise ValueError(f'StreamGRPOTrainer: stream_options {unknown} are not options of Executor.stream '
                             f'(those are {", ".join(STREAM_OPTIONS)})')
        policy = self.stale_policy
        if policy is not None and not isinstance(policy, StalePolicy):
            raise TypeError(f'StreamGRPOTrainer: stale_policy must be a mtflow.train.StalePolicy, not '
                            f'{type(policy).__name__}')
        if policy is not None and policy.stale == 'drop':
            raise ValueError("StreamGRPOTrainer: stale_policy stale='drop' would take a sample out of its group, and "
                             'ms-swift computes advantages over whole groups of num_generations rows: use '
                             "'withhold', or the stream's own max_staleness with stale='drop' (whole groups)")

    def _check_trainer(self) -> None:
        args = self.args
        evaluation = getattr(args.eval_strategy, 'value', args.eval_strategy)  # transformers' IntervalStrategy
        refusals = [
            (evaluation != 'no', f"eval_strategy={evaluation!r}: evaluation through the stream is not built; set "
                                 "eval_strategy='no'"),
            (self.accelerator.num_processes > 1, f'{self.accelerator.num_processes} processes: one stream per process '
                                                 'is not built; run one process'),
            (bool(args.async_generate), "async_generate: ms-swift's own asynchronous generation; the stream already "
                                        'generates between the steps'),
            (self.multi_turn_scheduler is not None, "multi_turn_scheduler: ms-swift's driver is not used; the "
                                                    "executor's scheduler drives the turns"),
            (self.stale_policy is not None and self.template.padding_free,
             'padding_free with a stale_policy: withholding tokens is built for padded rows'),
        ]
        for refused, why in refusals:
            if refused:
                raise ValueError(f'StreamGRPOTrainer: {why}')

    # ---- what a subclass may override -------------------------------------------------------------
    def make_executor(self) -> Executor:
        """The executor to stream through when none was given (a plugin's subclass overrides it;
        ``self.model`` and ``self.template`` are ready when it is called)."""
        raise ValueError('StreamGRPOTrainer: no executor: pass executor= (an mtflow.Executor, or a function of the '
                         'trainer returning one) or override make_executor()')

    def rows(self) -> Iterable[Dict[str, Any]]:
        """The rows the stream makes its groups from: the training dataset, epoch after epoch,
        each epoch shuffled with ``args.seed + epoch`` when ms-swift shuffles the dataset."""
        data = self.train_dataset
        if data is None:
            raise ValueError('StreamGRPOTrainer: no train_dataset to stream: pass rows=')
        epoch = 0
        while True:
            if not hasattr(data, '__len__') or not hasattr(data, '__getitem__'):
                rows: Iterable[Dict[str, Any]] = data  # an iterable dataset: its own order
            else:
                order = list(range(len(data)))
                if getattr(self, 'shuffle_dataset', True):
                    random.Random(self.args.seed + epoch).shuffle(order)
                rows = (data[i] for i in order)
            count = 0
            for count, row in enumerate(rows, 1):
                yield row
            if not count:
                raise ValueError(f'StreamGRPOTrainer: the train_dataset gave no rows in epoch {epoch}')
            epoch += 1

    def locked(self, rollout_fn: Any) -> Callable[..., Any]:
        """``rollout_fn`` taking the trainer's :attr:`rollout_lock` for each call: for a backend
        that generates with the weights being trained, so that no generation overlaps a step."""
        lock = self.rollout_lock

        def call(requests: List[Any], request_config: Any = None) -> Any:
            with lock:
                return rollout_fn(requests, request_config)

        call.__wrapped__ = rollout_fn  # type: ignore[attr-defined]  # the backend's attributes (forget, budgets)
        return call

    # ---- the stream ---------------------------------------------------------------------------------
    def _open_stream(self) -> Any:
        if self.stream is not None:
            return self.stream
        given = self.executor_source
        executor = given if isinstance(given, Executor) else (given(self) if callable(given) else self.make_executor())
        if not isinstance(executor, Executor):
            raise TypeError(f'StreamGRPOTrainer: the executor must be an mtflow.Executor, not {type(executor).__name__}')
        self.mtflow_executor = executor
        executor.set_policy_version(int(self.state.global_step))
        self.stream = executor.stream(self._source(), **self.stream_options)
        return self.stream

    def _source(self) -> Iterator[List[Any]]:
        """One group of ``num_generations`` requests per row (runs in the stream's thread)."""
        given = self.row_source
        rows = given(self) if callable(given) else (given if given is not None else self.rows())
        size = self.num_generations
        for i, row in enumerate(rows):
            base = self.sample_cls.from_row(dict(row))
            self._set_inputs_system([base])
            remove_response(base.messages)
            key = f'g{i}'
            request = from_swift(base.to_infer_request(include_extra=True))
            self._rows[key] = base
            yield [request.model_copy(deep=True, update={'uuid': f'{key}#{k}'}) for k in range(size)]

    def close_stream(self) -> None:
        """Stop the stream (the lock is let go first, so that a rollout waiting for it ends)."""
        self._release()
        if self.stream is not None:
            self.stream.close()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            self.close_stream()

    def _acquire(self) -> None:
        if not self._holding:
            self.rollout_lock.acquire()
            self._holding = True

    def _release(self) -> None:
        if self._holding:
            self._holding = False
            self.rollout_lock.release()

    # ---- ms-swift's hooks -------------------------------------------------------------------------
    def _generate_completions(self, samples: List[Any]) -> List[Any]:
        size = self.num_generations
        if len(samples) % size:
            raise ValueError(f'StreamGRPOTrainer: a generation batch of {len(samples)} rows is not whole groups of '
                             f'num_generations={size}')
        version, training = int(self.state.global_step), self.model.training
        stream = self._open_stream()
        self.mtflow_executor.set_policy_version(version)
        self.model.eval()  # a backend over these weights generates in eval mode, as ms-swift's engines do
        self._release()  # the stream may generate with the weights of `version` while we wait
        groups = []
        for _ in range(len(samples) // size):
            group = next(stream, None)
            if group is None:
                raise ValueError(f'StreamGRPOTrainer: the stream ended after {stream.stats["delivered_groups"]} '
                                 f'groups (its rows ran out, or it failed) at step {version}')
            groups.append(group)
        self._acquire()
        self.model.train(training)
        return self._swift_samples(groups, version)

    def _prepare_batch_inputs(self, samples: List[Any]) -> List[Dict[str, Any]]:
        with exact_encoding(self.template):
            batches = super()._prepare_batch_inputs(samples)
        if self.stale_policy is not None:
            self._withhold(samples, batches)
        return batches

    def _withhold(self, samples: List[StreamSample], batches: List[Dict[str, Any]]) -> None:
        """Take the tokens the stale policy withheld out of each row's ``completion_mask`` (its
        frame: the last ``logits_to_keep`` positions of the padded rows) and count what is left."""
        for chunk, batch in zip(self.split_by_mini_batches(samples), batches):
            grpo_batch, attention = batch['grpo_batch'], batch['model_inputs']['attention_mask']
            frame = attention.shape[1] - grpo_batch.logits_to_keep  # the first position in the frame
            for r, s in enumerate(chunk):
                exact = s.mtflow_sample
                cut = [j for j, (was, now) in enumerate(zip(s.rollout_mask, exact.loss_mask)) if was and not now]
                if not cut:  # nothing withheld in this row: no position to find, no write
                    continue
                first = int(attention[r].nonzero()[0])  # where the row starts (after left padding)
                offset = first + len(exact.prompt_ids) - frame
                grpo_batch.completion_mask[r, [offset + j for j in cut]] = False  # one write per row
        total = sum(batch['grpo_batch'].completion_mask.sum() for batch in batches)
        for batch in batches:
            batch['grpo_batch'].num_items_in_batch = total

    # ---- groups to ms-swift's samples -------------------------------------------------------------
    def _swift_samples(self, groups: List[Any], version: int) -> List[StreamSample]:
        rolled = [s for group in groups for s in self._exact_samples(group)]
        flat = self.stale_policy.apply(rolled, version) if self.stale_policy is not None else rolled
        out: List[StreamSample] = []
        for n, group in enumerate(groups):
            key = group.uuids[0].rpartition('#')[0]
            base = self._rows.pop(key)
            for k, output in enumerate(group.outputs):
                i = n * self.num_generations + k
                out.append(self._swift_sample(base, output, flat[i], rolled[i].loss_mask, key))
        self._log_stream(groups, flat)
        if self.keep:
            self.taken.append({'version': version, 'groups': groups, 'samples': flat})
        return out

    def _exact_samples(self, group: Any) -> List[Sample]:
        """A stream group's members as exact samples, one each, in order (the scheduler's reward
        where it gave one, 0.0 where ms-swift's reward functions alone score them)."""
        size = self.num_generations
        if len(group.uuids) != size:
            raise ValueError(f'StreamGRPOTrainer: group {group.uuids[0]!r} has {len(group.uuids)} members, not '
                             f'num_generations={size}')
        if group.failures:
            raise RuntimeError(f'StreamGRPOTrainer: {len(group.failures)} of {size} rollouts of group '
                               f'{group.uuids[0]!r} failed; first: {group.failures[0]}')
        # the scheduler's reward where it gave one (a NaN or infinite one is refused, naming the request);
        # where it gave none, ms-swift's reward functions alone score the sample: 0.0 holds its place
        rewards = [0.0 if (r := reward_of(output.rollout_infos)) is None else r for output in group.outputs]
        samples = samples_from_group(group, reward=rewards)
        for s in samples:
            if s.segments != 1:
                raise SampleError(f'{s.segments} context segments cannot be one ms-swift completion', uuid=s.uuid,
                                  turn=s.turns[0], field='context_segments')
        return samples

    def _swift_sample(self, base: StreamSample, output: Any, exact: Sample, rollout_mask: List[int],
                      key: str) -> StreamSample:
        if not any(rollout_mask):
            raise SampleError('no trained token: ms-swift places a completion by its labels, and this one has none',
                              uuid=exact.uuid, turn=exact.turns[0], field='response_loss_mask')
        s = copy.deepcopy(base)
        s.apply_rollout_output(rollout_output=to_swift(output))
        media = [name for name in ('images', 'videos', 'audios') if getattr(s, name)]
        if media:
            raise SampleError(f'{", ".join(media)}: the exact encoding has the token ids only, not the media they '
                              'stand for', uuid=exact.uuid, field=media[0])
        s.mtflow_sample, s.rollout_mask = exact, list(rollout_mask)
        s.response_token_ids = [list(exact.completion_ids)]
        s.response_loss_mask = [list(rollout_mask)]
        s.rollout_logprobs = [] if exact.logprobs is None else [
            [lp for lp, m in zip(exact.logprobs, rollout_mask) if m]]
        s.prompt_id, s.request_id = key, exact.uuid
        return s

    def _log_stream(self, groups: List[Any], samples: List[Sample]) -> None:
        metrics = self._metrics['train' if self.model.training else 'eval']
        metrics['mtflow/age'].append(sum(g.age for g in groups) / len(groups))
        metrics['mtflow/version_span'].append(max(g.version_span for g in groups))
        metrics['mtflow/restarts'].append(sum(g.restarts for g in groups))
        if self.stale_policy is not None:
            metrics['mtflow/withheld_tokens'].append(sum(s.withheld_tokens for s in samples))


def use_stream_trainer(cls: type = StreamGRPOTrainer) -> type:
    """Make ``swift rlhf --rlhf_type grpo`` build ``cls`` (a :class:`StreamGRPOTrainer` subclass,
    defined at the top level of an ``--external_plugins`` file or a module): ms-swift's
    ``TrainerFactory`` maps ``grpo`` to it. Returns ``cls``."""
    if not (isinstance(cls, type) and issubclass(cls, StreamGRPOTrainer)):
        raise TypeError(f'use_stream_trainer: {cls!r} is not a StreamGRPOTrainer subclass')
    if '.' in cls.__qualname__:
        raise ValueError(f'use_stream_trainer: {cls.__qualname__} is not defined at the top level of its module, '
                         "so ms-swift's TrainerFactory cannot import it by name")
    TrainerFactory.TRAINER_MAPPING['grpo'] = f'{cls.__module__}.{cls.__qualname__}'
    return cls
