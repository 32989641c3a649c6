"""verl (0.9) driven by mtflow: an ``AgentLoop`` whose episode is an mtflow scheduler's machine,
generating through verl's own server manager, and whose output is mtflow's exact sample.

verl runs multi-turn rollouts as agent loops: for every sample of a batch its
``AgentLoopWorker`` instantiates the loop registered under the sample's ``agent_name`` and awaits
``run(sampling_params, **dataset_fields)``, which must return an ``AgentLoopOutput``
(``prompt_ids``, ``response_ids`` with the tool tokens between the turns, ``response_mask``,
``response_logprobs``, ``reward_score``, ``num_turns``); the worker pads it and the trainer
computes advantages and the loss from it. :class:`MtflowAgentLoop` (registered as ``mtflow``)
runs one mtflow request through ``Executor.arun``: any scheduler (YAML or Python), multi-turn,
with tools, stop rules and observations as ``mtflow run`` would run it; every model call goes to
``server_manager.generate(request_id, prompt_ids=..., sampling_params=...)`` with the prompt ids
of mtflow's token record (:class:`VerlServerBackend`: never a re-rendered conversation), and the
output is the trajectory's one :class:`~mtflow.train.samples.Sample`
(:func:`agent_loop_output`): its prompt ids, completion ids (template glue and tool messages
included), loss mask, rollout logprobs (0.0 on untrained tokens, as verl pads them), reward, and
the per-turn rewards as ``extra_fields['turn_scores']`` (verl's tool agent loop's key).

In verl's config (``actor_rollout_ref.rollout.agent.agent_loop_config_path``)::

    - name: mtflow
      _target_: mtflow.train.verl_agent_loop.MtflowAgentLoop
      scheduler: schedulers/tool_use.yaml       # or module:Class
      max_turns: 4
      request_config: {max_tokens: 256}

and ``agent_name: mtflow`` in the dataset (or ``agent.default_agent_loop: mtflow``). This module
imports verl; it is left out of :mod:`mtflow.train`'s face.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Dict, List, Optional, Sequence
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from mtflow.backends.base import Backend, BackendError, SamplingOptions, build_output
from mtflow.backends.tokens import TokenPrompter, commit_outputs
from mtflow.core.protocol import RequestConfig, RolloutInferRequest
from mtflow.engine.executor import Executor
from mtflow.train.errors import SampleError
from mtflow.train.samples import Sample, samples_from_output
from mtflow.train.scheduler_spec import make_scheduler

__all__ = ['AGENT_NAME', 'VerlServerBackend', 'MtflowAgentLoop', 'agent_loop_output', 'turn_scores']

#: the name the loop is registered under (``agent_name`` in verl's data)
AGENT_NAME = 'mtflow'
logger = logging.getLogger(__name__)


class VerlServerBackend(Backend):
    """An mtflow backend whose model is verl's server manager (``LLMServerClient`` or anything with
    its ``generate``): each turn's prompt ids come from mtflow's :class:`TokenPrompter` (the
    previous prompt, the sampled ids, the template's delta), and the call runs on ``loop``, the
    event loop verl's agent loop runs in (the executor's driver runs in a thread of its own).
    ``sampling_params`` are verl's (the trainer's temperature, top-p, logprobs); the request
    config's ``max_tokens`` is added per turn, and logprobs are asked for when either asks."""
    name = 'verl'

    def __init__(self, server_manager: Any, tokenizer: Any, loop: asyncio.AbstractEventLoop,
                 sampling_params: Optional[Dict[str, Any]] = None, request_id: Optional[str] = None) -> None:
        super().__init__()
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.loop = loop
        self.sampling_params = dict(sampling_params or {})
        self.request_id = request_id or uuid4().hex
        self.prompter = TokenPrompter(tokenizer)
        self.calls = 0

    def _params(self, options: SamplingOptions) -> Dict[str, Any]:
        params = dict(self.sampling_params)
        params['max_tokens'] = options.max_tokens
        params['logprobs'] = bool(params.get('logprobs')) or options.logprobs
        return params

    async def _one(self, prompt_ids: List[int], params: Dict[str, Any]) -> Any:
        return await self.server_manager.generate(request_id=self.request_id, prompt_ids=prompt_ids,
                                                  sampling_params=params)

    def generate(self, requests: List[Any], options: SamplingOptions) -> List[Any]:
        plans = [self.prompter.plan(r) for r in requests]
        params = self._params(options)
        futures = [asyncio.run_coroutine_threadsafe(self._one(list(p.ids), params), self.loop) for p in plans]
        outputs = []
        for request, plan, future in zip(requests, plans, futures):
            got = future.result()
            if getattr(got, 'stop_reason', None) == 'aborted':  # verl cut it for a weight sync: not one turn's ids
                raise BackendError(f'request {getattr(request, "uuid", None)!r}: verl aborted the generation (a weight '
                                   'sync in flight); MtflowAgentLoop does not resume partial turns')
            ids = [int(t) for t in got.token_ids]
            logprobs = [float(v) for v in got.log_probs] if got.log_probs else None
            eos = self.tokenizer.eos_token_id
            finish = 'stop' if ids and ids[-1] == eos else ('length' if len(ids) >= options.max_tokens else 'stop')
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            outputs.append(build_output(text, ids, finish, logprobs=logprobs, prompt_tokens=len(plan.ids),
                                        prompt_token_ids=list(plan.ids)))
        self.calls += len(requests)
        commit_outputs(self.prompter, requests, plans, outputs)
        return outputs


def turn_scores(sample: Sample) -> List[float]:
    """The per-turn rewards of the sample's turns, in turn order (0.0 for a turn without one)."""
    first, last = sample.turns
    return [float(sample.turn_rewards.get(t, 0.0)) for t in range(first, last + 1)] if sample.turn_rewards else []


def agent_loop_output(sample: Sample, messages: Sequence[Any], *, response_length: Optional[int] = None,
                      prompt_length: Optional[int] = None, reward: bool = True,
                      metrics: Optional[Dict[str, float]] = None) -> AgentLoopOutput:
    """verl's ``AgentLoopOutput`` of one exact sample: ``num_turns`` counts the conversation's
    messages (verl's convention: user, assistant and tool turns); ``reward_score`` is the
    scheduler's reward (``reward=False``: left to verl's reward function). A prompt longer than
    verl's ``prompt_length`` is an error naming the request; a response longer than its
    ``response_length`` is cut there (as verl's own loops cut it: the ids kept are still exactly
    what the model saw), and the cut is logged and kept in ``extra_fields['mtflow']``."""
    if prompt_length is not None and len(sample.prompt_ids) > prompt_length:
        raise SampleError(f'{len(sample.prompt_ids)} prompt ids do not fit verl\'s rollout.prompt_length='
                          f'{prompt_length}', uuid=sample.uuid, turn=1, field='prompt_ids')
    ids, mask = list(sample.completion_ids), list(sample.loss_mask)
    logprobs = list(sample.logprobs) if sample.logprobs is not None else None
    cut = 0
    if response_length is not None and len(ids) > response_length:
        cut = len(ids) - response_length
        logger.warning('request %s: %d response ids cut to verl\'s rollout.response_length=%d', sample.uuid,
                       len(ids), response_length)
        ids, mask = ids[:response_length], mask[:response_length]
        logprobs = logprobs[:response_length] if logprobs is not None else None
    extra = {'turn_scores': turn_scores(sample), 'tool_rewards': [],
             'mtflow': {'uuid': sample.uuid, 'turns': list(sample.turns), 'cut_tokens': cut}}
    return AgentLoopOutput(prompt_ids=list(sample.prompt_ids), response_ids=ids, response_mask=mask,
                           response_logprobs=logprobs, reward_score=float(sample.reward) if reward else None,
                           num_turns=len(messages), metrics=AgentLoopMetrics(**(metrics or {})), extra_fields=extra)


def _plain(value: Any) -> Any:
    """A dataset field as plain Python (verl hands numpy objects)."""
    if hasattr(value, 'tolist'):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@register(AGENT_NAME)
class MtflowAgentLoop(AgentLoopBase):
    """verl's agent loop over an mtflow scheduler (module docstring). ``scheduler``: a scheduler,
    a YAML file or ``module:Class`` (with ``scheduler_args``); ``max_turns`` and
    ``request_config`` (mtflow's, per turn: ``max_tokens`` defaults to verl's
    ``response_length``) as for :class:`mtflow.Executor`; ``reward``: hand verl the scheduler's
    reward (``rollout_infos['reward']``), else verl's reward function scores the trajectory.

    The request: ``raw_prompt`` as its messages; its ``data_dict`` the sample's ``extra_info``
    and ``reward_model`` fields (a YAML scheduler's answer check reads them); its uuid verl's
    ``uid`` (the GRPO group) with a suffix of its own."""

    def __init__(self, *args: Any, scheduler: Any = None, scheduler_args: Optional[Dict[str, Any]] = None,
                 max_turns: Optional[int] = None, request_config: Optional[Dict[str, Any]] = None, reward: bool = True,
                 **kwargs: Any) -> None:
        kwargs.pop('tools', None)  # verl's own tool list: the scheduler has its tools
        super().__init__(*args, **kwargs)
        self.scheduler = make_scheduler(scheduler, tokenizer=self.tokenizer, args=_plain(scheduler_args))
        self.max_turns = max_turns
        self.response_length = int(self.rollout_config.response_length)
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.request_config = {'max_tokens': self.response_length, **dict(_plain(request_config) or {})}
        self.reward = reward

    def request_of(self, kwargs: Dict[str, Any]) -> RolloutInferRequest:
        messages = [dict(m) for m in _plain(kwargs['raw_prompt'])]
        group = str(kwargs.get('uid') or uuid4().hex)
        data = {k: _plain(kwargs[k]) for k in ('extra_info', 'reward_model', 'data_source') if k in kwargs}
        return RolloutInferRequest(messages=messages, uuid=f'{group}#{uuid4().hex[:8]}', data_dict=data)

    async def run(self, sampling_params: Dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        request = self.request_of(kwargs)
        backend = VerlServerBackend(self.server_manager, self.tokenizer, asyncio.get_running_loop(), sampling_params,
                                    request_id=request.uuid)
        executor = Executor(self.scheduler, backend, RequestConfig(**self.request_config), max_turns=self.max_turns)
        result = await executor.arun([request])
        if result.failures:
            raise RuntimeError(f'mtflow agent loop: {result.failures[0]}')
        output = result.outputs[0]
        samples = samples_from_output(output, request.uuid, group=request.uuid.split('#')[0],
                                      finish_reason=result.finish_reasons[0],
                                      reward=None if self.reward else 0.0)
        if len(samples) != 1:
            raise SampleError(f'{len(samples)} context segments cannot be one verl trajectory', uuid=request.uuid,
                              field='context_segments')
        return agent_loop_output(samples[0], output.messages, response_length=self.response_length,
                                 prompt_length=self.prompt_length, reward=self.reward,
                                 metrics={'generate_sequences': backend.stats.generate_s})
