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
import inspect
import re
from dataclasses import dataclass, field
from dataclasses import replace as dc_replace
from typing import Any, Callable, Dict, List, Optional, Tuple

from mtflow.core.errors import RequestError
from mtflow.core.machine import MAX_TURNS
from mtflow.core.stop import turn_limit_reached
from mtflow.core.protocol import extract_logprobs
from mtflow.core.scheduler import Scheduler
from mtflow.tools.registry import Tool, make_builtin, resolve_ref, tool_from_callable
from mtflow.tools.runner import ToolResult, ToolRunner, truncate
from mtflow.declarative.envs import make_env_factory, normalize_step
from mtflow.declarative.parsers import ToolCall, foreign_format, get_parser
from mtflow.declarative.policy import INFO_KEY as POLICY_INFO_KEY, FinishPolicy, apply_policy
from mtflow.declarative.schema import SchedulerConfig, TipConfig
from mtflow.declarative.templates import render


class ToolCallError(RequestError):
    """A tool call failed and the config says ``tool_errors: finish``."""


@dataclass
class _State:
    """What the scheduler remembers about one request between hooks."""
    tool_calls: int = 0
    tool_errors: int = 0
    error_kinds: Dict[str, int] = field(default_factory=dict)
    tips_given: Dict[str, int] = field(default_factory=dict)
    calls: List[ToolCall] = field(default_factory=list)
    tip: Optional[TipConfig] = None
    env: Any = None
    env_obs: Optional[str] = None
    env_error: Optional[BaseException] = None
    rewards: List[float] = field(default_factory=list)
    answer_correct: Optional[bool] = None

    def counters(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {'tool_calls': self.tool_calls, 'tool_errors': self.tool_errors}
        if self.error_kinds:
            out['tool_error_kinds'] = dict(self.error_kinds)
        if self.tips_given:
            out['tips_given'] = dict(self.tips_given)
        return out


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value




def _number(text: str) -> Optional[float]:
    cleaned = re.sub(r'[\s,$%]', '', str(text)).rstrip('.')
    try:
        return float(cleaned)
    except ValueError:
        return None


class YamlScheduler(Scheduler):
    """A scheduler built from a validated :class:`SchedulerConfig` (see :func:`load_scheduler`).

    Subclass it (and name the subclass in ``scheduler_class``) to override any hook while keeping
    the YAML behaviour for the rest."""
    requires_unique_uuids = True  # per-request state is keyed by uuid (see _key)

    def __init__(self, config: SchedulerConfig, tokenizer: Any = None, base_dir: Optional[str] = None,
                 infer_engine: Any = None, **kwargs: Any) -> None:
        super().__init__(infer_engine, config.max_turns, tokenizer=tokenizer, **kwargs)
        self.config = config
        self.name = config.name
        self.base_dir = base_dir
        self.parser = get_parser(config.parser, config.parser_options, base_dir)
        self.tools: List[Tool] = [self._build_tool(tc) for tc in config.tools]
        self.runner = ToolRunner(self.tools, config.max_threads)
        stop = config.stop
        self._regex = [(name, re.compile(p)) for name, p in stop.regex.items()]
        self._predicate = resolve_ref(stop.predicate, base_dir) if stop.predicate else None
        self._reward = resolve_ref(config.reward, base_dir) if config.reward else None
        self._answer_re = re.compile(config.answer.pattern, re.DOTALL) if config.answer else None
        self._compare: Optional[Callable[[str, Any], bool]] = None
        if config.answer and config.answer.compare not in ('exact', 'numeric'):
            self._compare = resolve_ref(config.answer.compare, base_dir)
        self._tip_checks = [(tip, re.compile(tip.regex) if tip.regex else None,
                             resolve_ref(tip.predicate, base_dir) if tip.predicate else None) for tip in config.tips]
        self._env_factory = make_env_factory(config.env, base_dir) if config.env else None
        self._states: Dict[Any, _State] = {}
        self.finish_reasons = tuple(self._finish_reasons())
        self.finish_policy = FinishPolicy(config.finish_policy) if config.finish_policy else None

    # ---- construction ---------------------------------------------------------------------------
    def _build_tool(self, tc: Any) -> Tool:
        fn = resolve_ref(tc.impl, self.base_dir) if tc.impl else make_builtin(tc.builtin, tc.options)
        return tool_from_callable(fn, tc.name, description=tc.description, parameters=tc.parameters,
                                  timeout_s=tc.timeout_s, max_concurrency=tc.max_concurrency,
                                  max_observation=tc.max_observation, truncate_side=tc.truncate_side)

    def _finish_reasons(self) -> List[str]:
        c, stop = self.config, self.config.stop
        reasons = []
        if c.env:
            reasons.append('stop_rule:env_done')
            if c.env.gym is not None:  # Gymnasium's truncated (an impl env may return it too)
                reasons.append('stop_rule:env_truncated')
        if stop.correct_answer:
            reasons.append('stop_rule:correct_answer')
        reasons += [f'stop_rule:{name}' for name, _ in self._regex]
        if stop.stop_tools:
            reasons.append('stop_rule:stop_tool')
        if stop.predicate:
            reasons.append('stop_rule:predicate')
        if not c.env:
            reasons.append(f'stop_rule:{self.idle_rule}')
        return reasons

    @property
    def env_factory(self) -> Optional[Callable[[], Any]]:
        """What makes each request's environment (``None`` without ``env``); for OpenEnv, the
        :class:`~mtflow.declarative.envs.openenv_env.OpenEnvPool` with its servers."""
        return self._env_factory

    @property
    def idle_rule(self) -> str:
        """The rule that stops a turn with nothing to continue it: ``no_tool_call`` with tools,
        ``tips_exhausted`` with tips only, else ``no_action``."""
        if self.config.tools:
            return 'no_tool_call'
        return 'tips_exhausted' if self.config.tips else 'no_action'

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

    def _state(self, infer_request: Any) -> _State:
        key = self._key(infer_request)
        st = self._states.get(key)
        if st is None:
            st = self._states[key] = _State()
        return st

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

    async def _ensure_env(self, infer_request: Any, st: _State) -> Any:
        if st.env is None and self._env_factory is not None:
            st.env = self._env_factory()
            await _maybe_await(st.env.reset(infer_request))
        return st.env

    async def on_trajectory_start(self, requests: List[Any]) -> None:
        for request in requests:
            self.prepare(request)
        if self._env_factory is not None:
            # All resets at once (remote environments open their sessions concurrently). A reset
            # that fails fails its own request only, at its first turn: an exception here would
            # fail the whole batch.
            await asyncio.gather(*[self._start_env(request) for request in requests])

    async def _start_env(self, request: Any) -> None:
        st = self._state(request)
        try:
            st.env = self._env_factory()
            opening = await _maybe_await(st.env.reset(request))
        except Exception as exc:
            st.env_error = exc
            return
        if opening and not any(m.get('role') == 'user' for m in request.messages):
            request.messages.append({'role': 'user', 'content': opening})

    def finalize_output(self, output: Any, finish_reason: str, turn: int) -> Any:
        """Apply ``finish_policy`` (the executor calls this once per request, on every finish path:
        stop rules, ``length``, ``max_turns``, errors, timeouts, interrupts)."""
        if self.finish_policy is None:
            return None
        output = apply_policy(self.finish_policy, output, finish_reason)
        # the same record on the finish event of the trace (``finish_policy`` in its extra)
        return {'output': output, 'trace_info': {'finish_policy': output.rollout_infos.get(POLICY_INFO_KEY)}}

    async def on_request_finished(self, infer_request: Any, reason: str, turn: int) -> None:
        st = self._states.pop(self._key(infer_request), None)
        if st is not None and st.env is not None:
            env, st.env = st.env, None
            await _maybe_await(env.close())

    def close(self) -> None:
        """Release the tool thread pool, any environment still open, and what the environment
        factory holds (e.g. the OpenEnv servers it launched)."""
        for st in self._states.values():
            if st.env is not None:
                abandon = getattr(st.env, 'abandon', None)
                if callable(abandon):  # an async env whose close needs the executor's loop
                    abandon()
                    continue
                close = st.env.close()
                if inspect.isawaitable(close):
                    close.close()
        self._states.clear()
        self.runner.close()
        close_factory = getattr(self._env_factory, 'close', None)
        if callable(close_factory):
            close_factory()

    # ---- deciding -------------------------------------------------------------------------------
    def extract_answer(self, text: str) -> Optional[str]:
        if self._answer_re is None:
            return None
        found = None
        for m in self._answer_re.finditer(text or ''):
            groups = [g for g in m.groups() if g] if m.groups() else [m.group(0)]
            if groups:
                found = groups[0].strip()
        return found

    def answer_is_correct(self, answer: Optional[str], infer_request: Any) -> bool:
        if answer is None or self.config.answer is None:
            return False
        data = getattr(infer_request, 'data_dict', None) or {}
        if self.config.answer.field not in data:
            raise KeyError(f'data_dict has no {self.config.answer.field!r} (answer.field) to check the answer against')
        reference = data[self.config.answer.field]
        if self._compare is not None:
            return bool(self._compare(answer, reference))
        if self.config.answer.compare == 'numeric':
            a, b = _number(answer), _number(str(reference))
            if a is not None and b is not None:
                return abs(a - b) <= 1e-6 * max(1.0, abs(b))
        return answer.strip() == str(reference).strip()

    def _tip_applies(self, tip: TipConfig, regex: Any, predicate: Any, completion: str, calls: List[ToolCall],
                     answer: Optional[str], correct: Optional[bool], request: Any, choice: Any, turn: int) -> bool:
        when = tip.when
        if when == 'always':
            return True
        if when == 'wrong_answer':
            return not correct
        if when == 'no_answer':
            return answer is None
        if when == 'no_tool_call':
            return not calls
        if when == 'regex':
            return bool(regex.search(completion))
        return bool(predicate(request, choice, turn))

    async def on_turn_end(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        st = self._state(infer_request)
        st.calls, st.tip, st.env_obs = [], None, None
        completion = response_choice.message.content or ''
        cfg, stop = self.config, self.config.stop
        infos: Dict[str, Any] = {}
        reason: Optional[str] = None
        calls: List[ToolCall] = []

        if self._env_factory is not None:
            if st.env_error is not None:
                exc, st.env_error = st.env_error, None
                raise exc
            env = await self._ensure_env(infer_request, st)
            out = normalize_step(await _maybe_await(env.step(completion)))
            st.rewards.append(out.reward)
            infos.update(env_steps=len(st.rewards), rewards=list(st.rewards), reward=float(sum(st.rewards)),
                         env_info=out.info)
            if out.terminated:
                reason = 'stop_rule:env_done'
            elif out.truncated:
                reason = 'stop_rule:env_truncated'
            else:
                st.env_obs = out.observation

        answer = correct = None
        if self._answer_re is not None:
            answer = self.extract_answer(completion)
            correct = self.answer_is_correct(answer, infer_request)
            st.answer_correct = correct
            infos.update(answer=answer, answer_correct=correct)
            if reason is None and stop.correct_answer and correct:
                reason = 'stop_rule:correct_answer'
        if reason is None:
            for name, rx in self._regex:
                if rx.search(completion):
                    reason = f'stop_rule:{name}'
                    break
        if self.tools or cfg.stop.stop_tools:
            calls = self.read_calls(completion, response_choice.finish_reason)
        if reason is None and stop.stop_tools and any(c.name in stop.stop_tools for c in calls):
            reason = 'stop_rule:stop_tool'
        if reason is None and stop.on_length and response_choice.finish_reason == 'length':
            reason = 'length'
        if reason is None and self._predicate is not None:
            verdict = await _maybe_await(self._predicate(infer_request, response_choice, current_turn))
            if verdict:
                reason = f'stop_rule:{verdict}' if isinstance(verdict, str) else 'stop_rule:predicate'
        if reason is None and st.env_obs is None:
            for tip, rx, pred in self._tip_checks:
                if st.tips_given.get(tip.name, 0) >= tip.max_times:
                    continue
                if self._tip_applies(tip, rx, pred, completion, calls, answer, correct, infer_request,
                                     response_choice, current_turn):
                    st.tip = tip
                    break
        if reason is None and st.env_obs is None and st.tip is None and not calls:
            reason = f'stop_rule:{self.idle_rule}'
        if reason is None and turn_limit_reached(current_turn, self.max_turns):  # the bound of mtflow.core.stop
            reason = MAX_TURNS
        st.calls = calls if reason is None and st.tip is None and st.env_obs is None else []

        if self.tools:
            infos.update(st.counters())
        elif st.tips_given:
            infos['tips_given'] = dict(st.tips_given)
        if reason is not None:
            infos['stop_rule'] = reason
            if self._reward is not None:
                infos['reward'] = float(await _maybe_await(self._reward(infer_request, dict(infos))))
            return {'done': True, 'finish_reason': reason, 'rollout_infos': infos}
        return {'done': False, 'rollout_infos': infos}

    def read_calls(self, completion: str, finish_reason: Optional[str]) -> List[ToolCall]:
        """The turn's tool calls, made safe to act on:

        - a call that runs to the end of a reply cut by the token limit (``finish_reason ==
          'length'``, no closing delimiter) is truncated: malformed, never run;
        - a reply with no call in the parser's format that looks like a call in another format
          gets one malformed call naming both formats, so the model is told (not silence)."""
        calls = list(self.parser.parse(completion))
        if finish_reason == 'length':
            calls = [c if c.error is not None or getattr(c, 'complete', True) else dc_replace(
                c, error='the reply was cut off by the token limit (finish_reason length) before this call was '
                'complete; it was not run') for c in calls]
        if not calls and self.tools:
            fmt = foreign_format(completion, getattr(self.parser, 'name', ''), [t.name for t in self.tools])
            if fmt is not None:
                calls = [ToolCall('', None, completion[-200:], f'this looks like a {fmt} tool call, but this '
                                  f'scheduler reads the {getattr(self.parser, "name", "configured")} format')]
        return calls

    # ---- acting ---------------------------------------------------------------------------------
    def _encode(self, text: str) -> List[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _truncate_for_tip(self, completion: str, model_ids: Optional[List[int]], logprobs: List[float],
                          markers: List[str]) -> Tuple[str, Optional[List[int]], List[float]]:
        """Cut the completion before the first marker; ids and logprobs are cut to the longest
        token prefix whose text is a prefix of the cut text, and the text is that prefix's
        decoding, so text and ids stay the same string."""
        cut = min((completion.find(m) for m in markers if m in completion), default=-1)
        if cut < 0:
            return completion, model_ids, logprobs
        if not model_ids or self.tokenizer is None:
            return completion[:cut], model_ids, logprobs
        kept_text, n = '', 0
        for i in range(1, len(model_ids) + 1):
            text = self.tokenizer.decode(model_ids[:i])
            if len(text) > cut or not completion.startswith(text):
                break
            kept_text, n = text, i
        return kept_text, model_ids[:n], logprobs[:n]

    async def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        st = self._state(infer_request)
        cfg = self.config
        messages = infer_request.messages
        model_ids = list(response_choice.token_ids) if response_choice.token_ids else None
        logprobs = extract_logprobs(response_choice)
        inline_text = ''
        trace_info: Dict[str, Any] = {}

        if st.tip is not None:
            tip = st.tip
            st.tips_given[tip.name] = st.tips_given.get(tip.name, 0) + 1
            trace_info['tip'] = tip.name
            if tip.placement == 'inline':
                completion = response_choice.message.content or ''
                kept, model_ids, logprobs = self._truncate_for_tip(completion, model_ids, logprobs,
                                                                   tip.truncate_before)
                content = messages[-1]['content']
                messages[-1]['content'] = content[:len(content) - len(completion)] + kept + tip.text
                inline_text = tip.text
            else:
                messages.append({'role': 'user', 'content': tip.text})
        elif st.env_obs is not None:
            messages.append({'role': cfg.env.observation_role, 'content': st.env_obs})
            trace_info['env_observation'] = st.env_obs[:200]
        else:
            results = await self._run_calls(st, infer_request, current_turn)
            trace_info['calls'] = [r.to_info() for r in results]
            texts = [self._render(r, i + 1) for i, r in enumerate(results)]
            obs = cfg.observation
            if obs.mode == 'inline':
                inline_text = obs.prefix + obs.separator.join(texts) + obs.suffix
                messages[-1]['content'] += inline_text
            elif obs.role == 'tool' and obs.one_message_per_call:
                for r, text in zip(results, texts):
                    message = {'role': 'tool', 'content': obs.prefix + text + obs.suffix}
                    if r.name:
                        message['name'] = r.name
                    messages.append(message)
            else:
                messages.append({'role': obs.role, 'content': obs.prefix + obs.separator.join(texts) + obs.suffix})

        counters = st.counters() if self.tools else ({'tips_given': dict(st.tips_given)} if st.tips_given else {})
        trace_info.update(counters)
        result: Dict[str, Any] = {'infer_request': infer_request, 'rollout_infos': counters, 'trace_info': trace_info}
        if model_ids is not None:
            extra: List[int] = []
            if inline_text:
                if self.tokenizer is None:
                    raise RequestError(
                        'inline text (an inline observation or tip) joins token ids the model produced, but this '
                        'scheduler has no tokenizer to encode it with loss mask 0; without one the earlier turns\' '
                        'ids would be lost or misaligned. Give load_scheduler(..., tokenizer=...) (mtflow run passes '
                        "the backend's), or use observation.mode: message / tip placement: user",
                        uuid=getattr(infer_request, 'uuid', None), turn=current_turn, field='observation.mode')
                extra = self._encode(inline_text)
            result['response_token_ids'] = model_ids + extra
            result['response_loss_mask'] = [1] * len(model_ids) + [0] * len(extra)
            if logprobs:
                result['rollout_logprobs'] = logprobs
        return result

    async def _run_calls(self, st: _State, infer_request: Any, turn: int) -> List[ToolResult]:
        calls, cfg = st.calls, self.config
        st.calls = []
        runnable = [(i, c) for i, c in enumerate(calls[:cfg.max_tool_calls_per_turn]) if c.error is None]
        ran = await self.runner.call_all([(c.name, c.arguments) for _, c in runnable])
        by_index = {i: r for (i, _), r in zip(runnable, ran)}
        results: List[ToolResult] = []
        for i, call in enumerate(calls):
            if i in by_index:
                results.append(by_index[i])
            elif call.error is not None:
                results.append(ToolResult(call.name, call.arguments, False, error=self._parse_error(call.error),
                                          error_kind='parse'))
            else:
                results.append(ToolResult(call.name, call.arguments, False, error_kind='too_many_calls',
                                          error=f'more than {cfg.max_tool_calls_per_turn} tool calls in one turn; '
                                          'this one was not run'))
        st.tool_calls += len(results)
        failed = [r for r in results if not r.ok]
        st.tool_errors += len(failed)
        for r in failed:
            st.error_kinds[r.error_kind] = st.error_kinds.get(r.error_kind, 0) + 1
        if failed and cfg.tool_errors == 'finish':
            raise ToolCallError(f'{len(failed)} tool call(s) failed: ' + '; '.join(r.error for r in failed),
                                uuid=getattr(infer_request, 'uuid', None), turn=turn, field='tool_calls')
        return results

    def _parse_error(self, error: str) -> str:
        """A parse error as the model reads it: what went wrong, and the format expected."""
        name = getattr(self.parser, 'name', None)
        expected = getattr(self.parser, 'expected', None)
        hint = f' ({name} format; write calls like: {expected})' if name and expected else ''
        return f'could not parse the tool call: {error}{hint}'

    def _render(self, r: ToolResult, index: int) -> str:
        obs = self.config.observation
        if not r.ok:
            return render(obs.error_template, name=r.name, error=r.error, index=index)
        tool = self.runner.tools.get(r.name)
        text = r.output
        if tool is not None and tool.max_observation:
            text = truncate(text, tool.max_observation, tool.truncate_side, self.tokenizer)
        return render(obs.template, name=r.name, result=text, index=index)
