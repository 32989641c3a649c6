"""The YAML-driven scheduler: a :class:`mtflow.Scheduler` configured by a :class:`SchedulerConfig`.

Per turn, for each request:

``on_turn_end`` (decides): steps the environment, checks the answer, parses tool calls and applies
the stop rules in order (``env_done``, ``correct_answer``, regex rules, ``stop_tool``, ``length``,
``predicate``, then, when nothing continues the request, ``no_tool_call`` (``tips_exhausted`` or
``no_action`` for schedulers without tools), then ``max_turns``). A
rule that fires returns ``{'done': True, 'finish_reason': 'stop_rule:<name>'}`` (``length`` and
``max_turns`` use the core reasons). Otherwise it remembers what ``step`` must do: a tip, an
environment observation, or tool calls.

``step`` (async, so the executor runs all requests' steps concurrently) runs the tool calls of
the request concurrently (see :mod:`mtflow.tools.runner`), renders the observations and returns
the next request with the token accounting:

- the model's own ``token_ids`` from the choice are kept **exactly** (mask 1) with their logprobs;
- inline text (observations, inline tips) is encoded separately with
  ``tokenizer.encode(text, add_special_tokens=False)`` and appended with mask 0; logprobs are
  not extended (they align with the mask-1 tokens, so the contract's logprob check passes).

Because BPE merges across boundaries, ``encode(a) + encode(b)`` may differ from
``encode(a + b)``: the trajectory's ids are then not what re-tokenizing the final text would give.
That is deliberate: the trained tokens must be the ones the model sampled (re-tokenizing would
change them and misalign logprobs), and the observation tokens are masked out, so their exact
split never enters the loss. Without a tokenizer, inline text cannot be encoded: when the model's
ids are there (they would be dropped or misaligned), the step raises a :class:`RequestError`
naming the request, the turn and ``observation.mode``; a backend that returns no ids stays text only.
"""
from __future__ import annotations

import asyncio
import copy
from typing import Any, Callable, Dict, List, Optional, Tuple

from mtflow.core.errors import RequestError
from mtflow.core.images import place_images
from mtflow.core.machine import MAX_TURNS
from mtflow.core.protocol import extract_logprobs
from mtflow.core.registry import resolve_reference
from mtflow.core.scheduler import Scheduler
from mtflow.core.stop import turn_limit_reached
from mtflow.core.validate import check_reward
from mtflow.declarative.answers import AnswerCheck
from mtflow.declarative.env_sessions import EnvSessions
from mtflow.declarative.envs import make_env_factory
from mtflow.declarative.images import (ResultImages, add_images, limits_of, normalize_all, split_observation,
                                       tip_images, tool_images)
from mtflow.declarative.observations import add_observations, render_result
from mtflow.declarative.parsers import ToolCall, get_parser
from mtflow.declarative.policy import INFO_KEY as POLICY_INFO_KEY, FinishPolicy, apply_policy
from mtflow.declarative.reasoning import Split, opens_thinking, reasoning_parser, split_messages, split_reasoning
from mtflow.declarative.request_state import RequestState, maybe_await
from mtflow.declarative.schema import SchedulerConfig
from mtflow.declarative.stop_rules import StopRules
from mtflow.declarative.tips import TipRules, cut_before_markers
from mtflow.declarative.tool_calls import build_tool, read_calls, run_calls, server_calls
from mtflow.declarative.turn_rewards import TurnRewards
from mtflow.engine.admission import Admission
from mtflow.declarative.templates import render
from mtflow.tools.runner import ERROR_INFO_CHARS, ToolResult, ToolRunner
from mtflow.tools.tool import Tool

__all__ = ['YamlScheduler', 'ToolCallError', 'token_accounting']


class ToolCallError(RequestError):
    """A tool call failed and the config says ``tool_errors: finish``."""


class YamlScheduler(Scheduler):
    """A scheduler built from a validated :class:`SchedulerConfig` (see :func:`load_scheduler`).

    Subclass it (and name the subclass in ``scheduler_class``) to override any hook while keeping
    the YAML behaviour for the rest. Each section of the config has its collaborator: the stop
    rules (:mod:`.stop_rules`), the answer check (:mod:`.answers`), the tips (:mod:`.tips`), the
    tool calls (:mod:`.tool_calls`), the observations (:mod:`.observations`) and the environment
    sessions (:mod:`.env_sessions`); the class keeps
    the hooks, the per-request state and the token accounting."""
    requires_unique_uuids = True  # per-request state is keyed by uuid (see _key)

    def __init__(self, config: SchedulerConfig, tokenizer: Any = None, base_dir: Optional[str] = None,
                 infer_engine: Any = None, **kwargs: Any) -> None:
        super().__init__(infer_engine, config.max_turns, tokenizer=tokenizer, **kwargs)
        self.config = config
        self.name = config.name
        self.base_dir = base_dir
        self.parser = get_parser(config.parser, config.parser_options, base_dir)
        #: splits each reply's reasoning from its content (the ``reasoning`` section); whether a
        #: generation prompt opens the thinking is asked of the template per request (``opened_for``)
        self.reasoning = reasoning_parser(config.reasoning.parser, config.parser, None, None,
                                          config.reasoning.opened_in_prompt, base_dir)
        self._opens: Dict[Any, Optional[bool]] = {}
        self.tools: List[Tool] = [build_tool(tc, base_dir) for tc in config.tools]
        self.runner = ToolRunner(self.tools, config.max_threads)
        self.stop_rules = StopRules(config.stop, base_dir)
        self._reward = resolve_reference(config.reward, base_dir) if config.reward else None
        self.turn_rewards = TurnRewards(config, base_dir)
        self.answers = AnswerCheck(config.answer, base_dir) if config.answer else None
        self.tip_rules = TipRules(config.tips, base_dir)
        self._states: Dict[Any, RequestState] = {}
        self.finish_reasons = tuple(self.stop_rules.finish_reasons(config, self.idle_rule))
        self.finish_policy = FinishPolicy(config.finish_policy) if config.finish_policy else None
        self.image_limits = limits_of(config.images)
        #: the ``env:`` section: each request's environment session
        self.envs = EnvSessions(make_env_factory(config.env, base_dir) if config.env else None, self.image_limits,
                                self.turn_rewards)
        images_from = config.observation.images_from
        self.result_images = ResultImages(images_from, base_dir) if images_from is not None else None
        #: each tip's images_impl, resolved once (by the tip's position)
        self._tip_images = {id(t): resolve_reference(t.images_impl, base_dir) for t in config.tips if t.images_impl}
        self.admission: Optional[Admission] = None  # use_admission
        #: where tool results come from instead of running the tools (``use_recorded``)
        self.recorded_tools: Optional[Any] = None
        #: the ``branch:`` section (``docs/branching.md``): the executor forks requests where it says
        self.branch = config.branch.branching(base_dir) if config.branch is not None else None

    def use_recorded(self, recorded: Any) -> None:
        """Take tool and environment results from ``recorded`` instead of calling any tool or
        environment (``mtflow replay --tools recorded``): ``recorded.tool_results(uuid, turn, calls)``
        gives a turn's :class:`ToolResult` list, ``recorded.env_factory()`` an environment that
        answers with the recorded observations. The configured environment factory is closed
        unused (it is cheap and starts nothing until called)."""
        self.recorded_tools = recorded
        if self.envs.factory is not None:
            self.envs.replace_factory(recorded.env_factory())

    @property
    def opens_env_sessions(self) -> bool:
        """Each request holds an environment session from its reset to its close (the drivers
        start requests within ``admission.env_sessions``, :mod:`mtflow.engine.admission`)."""
        return self.envs.factory is not None

    def use_admission(self, admission: Admission) -> None:
        """The run's admission control (the executor calls this): its ``tool_calls`` gate bounds
        the tool calls of all tools in flight; its ``env_sessions`` gate counts the sessions open."""
        self.admission = admission
        self.runner.admission = admission
        self.envs.admission = admission

    @property
    def env_factory(self) -> Optional[Callable[[], Any]]:
        """What makes each request's environment (``None`` without ``env``); for OpenEnv, the
        :class:`~mtflow.declarative.envs.openenv_env.OpenEnvPool` with its servers."""
        return self.envs.factory

    @property
    def reward_function(self) -> Optional[Callable[..., Any]]:
        """The ``reward`` the config names, ``reward(infer_request, infos) -> float`` (``None``
        without one); ``mtflow rescore`` calls it over stored trajectories."""
        return self._reward

    @property
    def idle_rule(self) -> str:
        """The rule that stops a turn with nothing to continue it: ``no_tool_call`` with tools,
        ``tips_exhausted`` with tips only, else ``no_action``."""
        if self.config.tools:
            return 'no_tool_call'
        return 'tips_exhausted' if self.config.tips else 'no_action'

    @property
    def writes_tool_messages(self) -> bool:
        """Whether tool results go to the model as ``tool`` messages, after an assistant message
        that holds the call as its text (what a chat template must render; checked when a run
        loads, :func:`mtflow.backends.chat_templates.template_problems`)."""
        obs = self.config.observation
        return bool(self.tools) and obs.mode == 'message' and obs.role == 'tool'

    @property
    def tool_specs(self) -> List[Dict[str, Any]]:
        """The tools as OpenAI function specs (what ``{tools}`` renders)."""
        return [t.spec() for t in self.tools]

    # ---- per-request state --------------------------------------------------------------------
    @staticmethod
    def _key(infer_request: Any) -> Any:
        """Per-request state is keyed by ``uuid`` (stable when an integration converts request
        objects between turns), else by object identity; uuids must be unique within a batch."""
        return getattr(infer_request, 'uuid', None) or id(infer_request)

    def _state(self, infer_request: Any) -> RequestState:
        key = self._key(infer_request)
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = RequestState()
        return state

    def prepare(self, infer_request: Any) -> Any:
        """Add the system prompt (with the tool list) to a request before its first turn.
        ``on_trajectory_start`` calls this; call it yourself when you generate the first turn
        outside mtflow (``run_multi_turn`` with ``first_turn_outputs``)."""
        prompt = self.config.system_prompt
        if prompt is None:
            return infer_request
        text = render(prompt, tools=self.parser.render_tools(self.tool_specs))
        msgs = infer_request.messages
        has_system = bool(msgs) and msgs[0].get('role') == 'system'
        mode = self.config.system_prompt_mode
        if not has_system:
            msgs.insert(0, {'role': 'system', 'content': text})
        elif mode == 'replace':
            msgs[0]['content'] = text
        elif mode == 'prepend':
            msgs[0]['content'] = f'{text}\n\n{msgs[0]["content"]}'
        return infer_request

    async def on_trajectory_start(self, requests: List[Any]) -> None:
        for request in requests:
            self.prepare(request)
        if self.envs.factory is not None:
            # All resets at once (remote environments open their sessions concurrently). A reset
            # that fails fails its own request only, at its first turn: an exception here would
            # fail the whole batch.
            await asyncio.gather(*[self.envs.start(request, self._state(request)) for request in requests])

    def finalize_output(self, output: Any, finish_reason: str, turn: int) -> Any:
        """Split each assistant message's reasoning into ``reasoning_content`` (the token ids stay
        as they are) and apply ``finish_policy`` (the executor calls this once per request, on
        every finish path: stop rules, ``length``, ``max_turns``, errors, timeouts, interrupts)."""
        if output.messages:
            split = split_messages(output.messages, self.reasoning)
            if any(a is not b for a, b in zip(split, output.messages)):
                output = output.model_copy(update={'messages': split})
        if self.finish_policy is None:
            return {'output': output}
        output = apply_policy(self.finish_policy, output, finish_reason)
        # the same record on the finish event of the trace (``finish_policy`` in its extra)
        return {'output': output, 'trace_info': {'finish_policy': output.rollout_infos.get(POLICY_INFO_KEY)}}

    async def on_fork(self, infer_request: Any, children: List[Any], current_turn: int) -> None:
        """A request is forked (``docs/branching.md``): each child gets a copy of its state (counters,
        tips given, what the next step does, rewards so far) and of its environment session, which
        must copy (``fork()``) or replay (``replayable``; else :class:`~mtflow.core.errors.ForkRefused`)."""
        state = self._states.get(self._key(infer_request))
        if state is not None:
            forked = await self.envs.fork(state, infer_request, len(children), current_turn)
            self._states.update((self._key(child), s) for child, s in zip(children, forked))

    async def on_request_finished(self, infer_request: Any, reason: str, turn: int) -> None:
        state = self._states.pop(self._key(infer_request), None)
        if state is not None:
            await self.envs.close_session(state)

    def close(self) -> None:
        """Release the tool thread pool, any environment still open, and what the environment
        factory holds (e.g. the OpenEnv servers it launched)."""
        self.envs.abandon(self._states.values())
        self._states.clear()
        self.runner.close()
        self.envs.close_factory()

    # ---- deciding -------------------------------------------------------------------------------
    def extract_answer(self, text: str) -> Optional[str]:
        if self.answers is None:
            return None
        return self.answers.extract(text)

    def answer_is_correct(self, answer: Optional[str], infer_request: Any) -> bool:
        if answer is None or self.answers is None:
            return False
        return self.answers.is_correct(answer, infer_request)

    async def on_turn_end(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        state = self._state(infer_request)
        state.calls, state.tip, state.env_obs = [], None, None
        whole = response_choice.message.content or ''
        completion = self.split_reply(whole, state.continued, infer_request).content  # no action, call or answer
        state.continued = False
        infos: Dict[str, Any] = {}
        reason = None if self.envs.factory is None else await self.envs.step(infer_request, state, completion, infos,
                                                                             current_turn)
        answer = correct = None
        if self.answers is not None:
            answer = self.extract_answer(whole if self.config.answer.include_reasoning else completion)
            correct = self.answer_is_correct(answer, infer_request)
            state.answer_correct = correct
            infos.update(answer=answer, answer_correct=correct)
        calls: List[ToolCall] = []
        state.call_ids, state.calls_from = None, {}
        if self.tools or self.config.stop.stop_tools:
            calls = self._turn_calls(infer_request, response_choice, completion, state)
        if reason is None:
            reason = await self.stop_rules.first_match(whole if self.config.stop.include_reasoning else completion,
                                                       calls, correct, infer_request, response_choice, current_turn)
        if reason is None and state.env_obs is None:
            state.tip = self.tip_rules.choose(state.tips_given, completion, calls, answer, correct, infer_request,
                                           response_choice, current_turn)
        if reason is None and state.env_obs is None and state.tip is None and not calls:
            reason = f'stop_rule:{self.idle_rule}'
        if reason is None and turn_limit_reached(current_turn, self.max_turns):  # the bound of mtflow.core.stop
            reason = MAX_TURNS
        state.calls = calls if reason is None and state.tip is None and state.env_obs is None else []
        await self.turn_rewards.hook_reward(state, self.content_view(infer_request), completion, infos, current_turn)
        infos.update(self.turn_rewards.infos(state))
        return await self._turn_result(infer_request, state, reason, infos)

    def split_reply(self, text: str, continued: bool = False, infer_request: Any = None) -> Split:
        """A reply's reasoning and content (the ``reasoning`` section; ``continued``: the turn
        continued the assistant message, so no generation prompt opened a thinking block)."""
        return split_reasoning(text, self.reasoning, continued, self.opened_for(infer_request))

    def opened_for(self, infer_request: Any) -> Optional[bool]:
        """Whether ``infer_request``'s generation prompt opens a thinking block: the config's
        ``opened_in_prompt``, else the tokenizer's template asked with the request's
        ``chat_template_kwargs`` (``enable_thinking: false`` closes it), once per distinct kwargs."""
        if self.config.reasoning.opened_in_prompt is not None or self.reasoning.name == 'none':
            return self.config.reasoning.opened_in_prompt
        kwargs = dict(getattr(infer_request, 'chat_template_kwargs', None) or {})
        key = repr(sorted(kwargs.items()))
        if key not in self._opens:
            self._opens[key] = opens_thinking(self.tokenizer, None, kwargs)
        return self._opens[key]

    def content_view(self, infer_request: Any) -> Any:
        """``infer_request`` as rewards see it: each assistant message's reasoning in
        ``reasoning_content``, its ``content`` what the model said (a copy; the request is unchanged)."""
        messages = getattr(infer_request, 'messages', None)
        if not messages:
            return infer_request
        split = split_messages(messages, self.reasoning, opened=self.opened_for(infer_request))
        if all(a is b for a, b in zip(split, messages)):
            return infer_request
        if hasattr(infer_request, 'model_copy'):
            return infer_request.model_copy(update={'messages': split})
        view = copy.copy(infer_request)
        view.messages = split
        return view

    async def _turn_result(self, infer_request: Any, state: RequestState, reason: Optional[str],
                           infos: Dict[str, Any]) -> Dict[str, Any]:
        if self.tools:
            infos.update(state.counters())
        elif state.tips_given:
            infos['tips_given'] = dict(state.tips_given)
        if reason is not None:
            infos['stop_rule'] = reason
            if self._reward is not None:
                value = await maybe_await(self._reward(self.content_view(infer_request), dict(infos)))
                infos['reward'] = check_reward(value, getattr(infer_request, 'uuid', None), None,
                                               f'reward ({self.config.reward})')
            return {'done': True, 'finish_reason': reason, 'rollout_infos': infos}
        return {'done': False, 'rollout_infos': infos}

    def _turn_calls(self, infer_request: Any, response_choice: Any, completion: str,
                    state: RequestState) -> List[ToolCall]:
        """The turn's calls: the server's structured ``tool_calls`` when it returned some (they win
        over calls in the text, which are not run; the trace says so), put on the assistant message
        in OpenAI's shape for the next turn; else the calls the parser reads in the text."""
        structured = getattr(response_choice.message, 'tool_calls', None)
        if not structured:
            return self.read_calls(completion, response_choice.finish_reason)
        calls, message_calls = server_calls(structured)
        messages = infer_request.messages
        if messages and messages[-1].get('role') == 'assistant':
            messages[-1]['tool_calls'] = message_calls
        state.call_ids = [c['id'] for c in message_calls]
        state.calls_from = {'tool_calls_from': 'server'}
        in_text = [c for c in self.parser.parse(completion) if c.error is None] if completion else []
        if in_text:
            state.calls_from['text_calls_ignored'] = len(in_text)
        return calls

    def read_calls(self, completion: str, finish_reason: Optional[str]) -> List[ToolCall]:
        """The turn's tool calls, made safe to act on:

        - a call that runs to the end of a reply cut by the token limit (``finish_reason ==
          'length'``, no closing delimiter) is truncated: malformed, never run;
        - a reply with no call in the parser's format that looks like a call in another format
          gets one malformed call naming both formats, so the model is told (not silence)."""
        return read_calls(self.parser, [t.name for t in self.tools], completion, finish_reason, self.tool_specs)

    # ---- acting ---------------------------------------------------------------------------------
    async def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        state = self._state(infer_request)
        messages = infer_request.messages
        model_ids = list(response_choice.token_ids) if response_choice.token_ids else None
        logprobs = extract_logprobs(response_choice)
        inline_text = ''
        trace_info: Dict[str, Any] = {}
        if state.tip is not None:
            inline_text, model_ids, logprobs = self._give_tip(state, infer_request, response_choice, current_turn,
                                                              model_ids, logprobs, trace_info)
        elif state.env_obs is not None:
            text, images = split_observation(state.env_obs, self.image_limits, infer_request.uuid, current_turn,
                                             'the environment observation')
            messages.append({'role': self.config.env.observation_role, 'content': text})
            add_images(infer_request, images, trace_info)
            trace_info['env_observation'] = text[:200]
        else:
            results = await self._run_calls(state, infer_request, current_turn)
            if self.result_images is not None and self.recorded_tools is None:  # recorded: already read
                results = self.result_images.apply(results, infer_request.uuid, current_turn)
            self.turn_rewards.tools(state, current_turn, results)
            rendered = [render_result(self.config.observation, self.runner.tools, self.tokenizer, r, i + 1)
                        for i, r in enumerate(results)]
            trace_info['calls'] = [call_info(r, view.cut) for r, view in zip(results, rendered)]
            trace_info.update(state.calls_from)
            # what a replay needs beside it: each call's arguments and its result text (as kept)
            trace_info['tool_io'] = [tool_io(r) for r in results]
            images = tool_images(results, self.config.observation.mode, self.image_limits, infer_request.uuid,
                                 current_turn)
            inline_text = add_observations(self.config.observation, messages, results,
                                           [view.text for view in rendered], state.call_ids)
            add_images(infer_request, images, trace_info)
        state.continued = bool(inline_text)  # the next turn continues this assistant message
        counters = state.counters() if self.tools else (
            {'tips_given': dict(state.tips_given)} if state.tips_given else {})
        trace_info.update(counters)
        infos = {**counters, **self.turn_rewards.infos(state)}
        result: Dict[str, Any] = {'infer_request': infer_request, 'rollout_infos': infos, 'trace_info': trace_info}
        if model_ids is not None:
            result.update(token_accounting(self.tokenizer, infer_request, current_turn, model_ids, logprobs,
                                           inline_text))
        return result

    def _give_tip(self, state: RequestState, infer_request: Any, response_choice: Any, turn: int,
                  model_ids: Optional[List[int]], logprobs: List[float],
                  trace_info: Dict[str, Any]) -> Tuple[str, Optional[List[int]], List[float]]:
        """Give the turn's tip: a user message (with the tip's images), or (``inline``) appended
        to the completion cut before its markers; ``(inline text, model ids, logprobs)`` after the cut."""
        tip = state.tip
        messages = infer_request.messages
        state.tips_given[tip.name] = state.tips_given.get(tip.name, 0) + 1
        trace_info['tip'] = tip.name
        if tip.placement != 'inline':
            images = tip_images(tip, self._tip_images.get(id(tip)), self.base_dir, infer_request, response_choice,
                                turn)
            images = normalize_all(images, self.image_limits, infer_request.uuid, turn, f'tip {tip.name!r}')
            messages.append({'role': 'user', 'content': place_images(tip.text, len(images))})
            add_images(infer_request, images, trace_info)
            return '', model_ids, logprobs
        completion = response_choice.message.content or ''
        kept, model_ids, logprobs = cut_before_markers(self.tokenizer, completion, model_ids, logprobs,
                                                       tip.truncate_before)
        content = messages[-1]['content']
        messages[-1]['content'] = content[:len(content) - len(completion)] + kept + tip.text
        return tip.text, model_ids, logprobs

    async def _run_calls(self, state: RequestState, infer_request: Any, turn: int) -> List[ToolResult]:
        calls, cfg = state.calls, self.config
        state.calls = []
        if self.recorded_tools is not None:
            results = list(self.recorded_tools.tool_results(getattr(infer_request, 'uuid', None), turn, calls))
        else:
            # a malformed structured call's error names no text format (the server wrote the call)
            parser = None if state.call_ids is not None else self.parser
            results = await run_calls(self.runner, parser, calls, cfg.max_tool_calls_per_turn)
        failed = state.count_calls(results)
        if failed and cfg.tool_errors == 'finish':
            raise ToolCallError(f'{len(failed)} tool call(s) failed: ' + '; '.join(r.error for r in failed),
                                uuid=getattr(infer_request, 'uuid', None), turn=turn, field='tool_calls')
        return results


def call_info(result: ToolResult, cut: Any) -> Dict[str, Any]:
    """A call's entry in the step's trace ``calls``: ``ToolResult.to_info``, and ``cut`` when its
    observation was bounded (``max_observation``: counted in the summary)."""
    info = result.to_info()
    if cut is not None:
        info['cut'] = cut.to_info()
    return info


def tool_io(result: ToolResult) -> Dict[str, Any]:
    """What a replay needs of a call beside its ``calls`` entry (``ToolResult.to_info``): the
    arguments, the result text as the runner kept it (with ``output_chars``, its length before,
    when it kept a window: :mod:`mtflow.tools.bounds`), and the whole error when ``calls`` holds
    it cut."""
    io: Dict[str, Any] = {'arguments': result.arguments, 'output': result.output}
    if result.output_chars is not None:
        io['output_chars'] = result.output_chars
    if not result.ok and len(result.error) > ERROR_INFO_CHARS:
        io['error'] = result.error
    return io


def token_accounting(tokenizer: Any, infer_request: Any, turn: int, model_ids: List[int], logprobs: List[float],
                     inline_text: str) -> Dict[str, Any]:
    """A step's ids: the model's kept exactly (mask 1, with their logprobs), the inline text encoded
    after them (mask 0); see the module docstring for why they are not re-tokenized together."""
    extra: List[int] = []
    if inline_text:
        if tokenizer is None:
            raise RequestError(
                'inline text (an inline observation or tip) joins token ids the model produced, but this '
                'scheduler has no tokenizer to encode it with loss mask 0; without one the earlier turns\' '
                'ids would be lost or misaligned. Give load_scheduler(..., tokenizer=...) (mtflow run passes '
                "the backend's), or use observation.mode: message / tip placement: user",
                uuid=getattr(infer_request, 'uuid', None), turn=turn, field='observation.mode')
        extra = list(tokenizer.encode(inline_text, add_special_tokens=False))
    out: Dict[str, Any] = {'response_token_ids': model_ids + extra,
                           'response_loss_mask': [1] * len(model_ids) + [0] * len(extra)}
    if logprobs:
        out['rollout_logprobs'] = logprobs
    return out
