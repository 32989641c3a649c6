"""TRL's own tool loop over an mtflow scheduler: ``GRPOTrainer(environment_factory=...)`` with no
``rollout_func``.

:func:`trl_tool_environment` makes, for one YAML scheduler, a :class:`TRLToolEnvironment`
subclass that TRL 1.16 takes as its ``environment_factory`` (a class is a factory). Each of the
scheduler's tools is a method whose signature and docstring are built from the tool's JSON schema
(:mod:`mtflow.tools.signature`), so transformers' ``get_json_schema`` reads the schema back and
TRL renders it in the prompt and types the parsed arguments by it; a call runs through the
scheduler's own :class:`~mtflow.tools.runner.ToolRunner` (its argument check, timeouts and
concurrency bounds) and is answered with the scheduler's observation (``template``,
``error_template``, ``prefix``/``suffix``, each tool's ``max_observation``). ``get_reward`` is the
scheduler's ``reward``. Everything of one episode (its request, counters, the calls and results it
saw) lives on its instance, which TRL makes per rollout and reuses after ``reset``.

What TRL's loop cannot run (stop rules, tips, continuations, an environment that reads every
reply, per-turn rewards, ...) is refused when the class is made, one line naming each feature
(:mod:`.trl_native_checks`). The scheduler's ``max_turns`` becomes the trainer's
``max_tool_calling_iterations`` (``max_turns - 1`` rounds of tool calls): TRL's trainer, not its
environment, ends an episode. TRL is imported by the trainer, never here; transformers (which
TRL brings) is asked once per tool to read its schema back.
"""
from __future__ import annotations

import itertools
import json
from typing import Any, Callable, ClassVar, Dict, List, Optional, Type

from mtflow.core.calls import is_async_callable
from mtflow.core.errors import RequestError
from mtflow.core.protocol import RolloutInferRequest
from mtflow.core.validate import check_reward
from mtflow.declarative.observations import render_result
from mtflow.declarative.request_state import RequestState
from mtflow.tools.signature import SchemaNotCarried, ToolSignature, tool_signature
from mtflow.tools.tool import Tool
from mtflow.train.errors import NotExpressibleInTRL
from mtflow.train.trl_native_checks import problems
from mtflow.train.trl_rollout import prompt_messages

__all__ = ['TRLToolEnvironment', 'trl_tool_environment']


class TRLToolEnvironment:
    """One rollout's environment in TRL's own tool loop, for the scheduler
    :func:`trl_tool_environment` made its subclass from: its public methods are the scheduler's
    tools, ``reset(**row)`` starts an episode (appending nothing to the prompt) and, when the
    scheduler has a ``reward``, ``get_reward()`` is it.

    **The ids are TRL's, not mtflow's.** TRL generates, renders the prompt and the tools with its
    chat template, parses the calls with its response parser and tokenizes each tool message from
    a dummy conversation; the loss mask is its ``tool_mask``. mtflow runs the tools, writes the
    observations and gives the reward. For mtflow's exact ids, masks and logprobs (the token
    record, every scheduler feature), use :class:`~mtflow.train.trl_environment.TRLEnvironment`
    (``environment_factory`` and ``rollout_func`` together).

    ``reward(infer_request, rollout_infos)`` sees the episode as the environment saw it: the
    prompt's messages, and per call an assistant message holding that call (``content`` None: TRL
    hands an environment no text) and its ``tool`` message; ``data_dict`` the row's other columns;
    ``rollout_infos`` the call counters (``tool_calls``, ``tool_errors``, ``tool_error_kinds``)."""
    _scheduler: ClassVar[Any] = None
    _episodes: ClassVar[Any] = None
    _reward_field: ClassVar[str] = 'reward'

    def __init__(self) -> None:
        self._request: Optional[RolloutInferRequest] = None
        self._state = RequestState()
        self._fault: Optional[BaseException] = None

    def reset(self, **example: Any) -> None:
        """A new episode from ``example`` (TRL's dataset row): its ``prompt`` as the messages the
        reward sees, every other column as ``data_dict``. Appends nothing to the prompt."""
        self._raise_fault()
        data = {k: v for k, v in example.items() if k != 'prompt'}
        messages = prompt_messages(example['prompt']) if 'prompt' in example else []
        self._request = RolloutInferRequest(messages=messages, data_dict=data,
                                            uuid=f'{type(self).__name__}-{next(type(self)._episodes)}')
        self._state = RequestState()

    async def _call(self, name: str, arguments: Dict[str, Any]) -> str:
        """One tool call from TRL's loop, run by the scheduler's runner; the tool message's text."""
        request = self._ready()
        scheduler = type(self)._scheduler
        result = await scheduler.runner.call(name, arguments)
        self._state.count_calls([result])
        if result.images and self._fault is None:
            self._fault = RequestError(f'tool {name!r} returned {len(result.images)} image(s), which the tool message '
                                       'of TRL\'s loop does not carry here', uuid=request.uuid, field='tools')
        obs = scheduler.config.observation
        text = obs.prefix + render_result(obs, scheduler.runner.tools, scheduler.tokenizer, result, 1) + obs.suffix
        call = {'type': 'function', 'function': {'name': name, 'arguments': json.dumps(arguments, ensure_ascii=False,
                                                                                        default=str)}}
        request.messages += [{'role': 'assistant', 'content': None, 'tool_calls': [call]},
                             {'role': 'tool', 'name': name, 'content': text}]
        return text

    def _ready(self) -> RolloutInferRequest:
        if self._request is None:
            raise RuntimeError(f'{type(self).__name__}: a tool was called before reset()')
        return self._request

    def _raise_fault(self) -> None:
        fault, self._fault = self._fault, None
        if fault is not None:
            raise fault

    def _reward_args(self) -> tuple:
        self._raise_fault()
        return self._ready(), self._state.counters()

    def _checked(self, value: Any) -> float:
        return check_reward(value, self._ready().uuid, None, type(self)._reward_field)


def _get_reward(self: TRLToolEnvironment) -> float:
    """The scheduler's reward for this episode (see the class docstring for what it sees)."""
    return self._checked(type(self)._scheduler.reward_function(*self._reward_args()))


async def _get_reward_async(self: TRLToolEnvironment) -> float:
    """The scheduler's reward for this episode (see the class docstring for what it sees)."""
    return self._checked(await type(self)._scheduler.reward_function(*self._reward_args()))


def trl_tool_environment(scheduler: Any, args: Any = None, name: Optional[str] = None) -> Type[TRLToolEnvironment]:
    """The :class:`TRLToolEnvironment` subclass for ``scheduler`` (a YAML scheduler, or a
    ``YamlScheduler`` subclass that keeps its per-turn hooks): ``GRPOTrainer(...,
    environment_factory=trl_tool_environment(scheduler, args))`` (or a dict of them). ``args``:
    the trainer's ``GRPOConfig``, needed when the scheduler has ``max_turns`` (it sets
    ``max_tool_calling_iterations = max_turns - 1`` where unset). ``name``: the class's name (TRL
    logs the reward under it; default the scheduler's ``name``). Refused with
    :class:`~mtflow.train.errors.NotExpressibleInTRL`, one line, when TRL's loop cannot run it."""
    if not callable(getattr(scheduler, 'step', None)):
        raise NotExpressibleInTRL(f'trl_tool_environment takes a scheduler (load_scheduler(path_or_dict, tokenizer=...) '
                                  f'makes one), not a {type(scheduler).__name__}')
    found = problems(scheduler, args)
    methods: Dict[str, Callable[..., Any]] = {}
    for tool in getattr(scheduler, 'tools', None) or []:
        try:
            methods[tool.name] = _tool_method(tool)
        except SchemaNotCarried as exc:
            found.append(f'tools: {exc}')
    label = getattr(scheduler, 'name', None) or type(scheduler).__name__
    if found:
        raise NotExpressibleInTRL(f'scheduler {label!r} cannot be a TRL environment without rollout_func: '
                                  + '; '.join(found) + ' (TRLEnvironment(executor).trainer_kwargs() runs it in mtflow)')
    if scheduler.max_turns is not None and args.max_tool_calling_iterations is None:
        args.max_tool_calling_iterations = scheduler.max_turns - 1
    namespace: Dict[str, Any] = dict(methods, _scheduler=scheduler, _episodes=itertools.count(),
                                     __module__=__name__, __doc__=TRLToolEnvironment.__doc__)
    reward = scheduler.reward_function
    if reward is not None:
        namespace['get_reward'] = _get_reward_async if is_async_callable(reward) else _get_reward
        namespace['_reward_field'] = f'reward ({scheduler.config.reward or type(scheduler).__name__})'
    return type(name or label, (TRLToolEnvironment, ), namespace)


def _tool_method(tool: Tool) -> Callable[..., Any]:
    """An ``async`` method calling ``tool`` through the episode, with the signature and docstring
    its schema gives, checked to read back the same (:func:`_read_back`)."""
    sig = tool_signature(tool.name, tool.description, tool.parameters)

    async def method(self: TRLToolEnvironment, **arguments: Any) -> str:
        return await self._call(tool.name, arguments)

    method.__name__ = method.__qualname__ = tool.name
    method.__signature__ = sig.signature  # type: ignore[attr-defined]
    method.__annotations__ = dict(sig.annotations)
    method.__doc__ = sig.doc
    _read_back(method, sig, tool.name)
    return method


def _read_back(method: Callable[..., Any], sig: ToolSignature, name: str) -> None:
    """What transformers' ``get_json_schema`` (TRL's reader) makes of ``method`` must say what the
    tool says: its description and each argument's (a docstring parses back lossily when a text
    holds ``Args:`` or ``Returns:``). Skipped where transformers is not installed (no TRL either)."""
    try:
        from transformers.utils import get_json_schema
    except ImportError:
        return
    try:
        read = get_json_schema(method)['function']
    except Exception as exc:  # transformers' own parsing exceptions
        raise SchemaNotCarried(f'tool {name!r}: transformers cannot read its signature back ({exc})') from None
    got: List[tuple] = [('description', read.get('description'), sig.summary)]
    props = read.get('parameters', {}).get('properties', {})
    got += [(f'argument {arg!r}', props.get(arg, {}).get('description'), text) for arg, text in sig.descriptions.items()]
    for what, seen, meant in got:
        if seen != meant:
            raise SchemaNotCarried(f'tool {name!r}: TRL would read its {what} as {seen!r}, not {meant!r}')
