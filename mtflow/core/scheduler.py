"""The Python scheduler API, and how the executor calls a scheduler's hooks.

:class:`Scheduler` has the hooks and signatures of ms-swift's ``MultiTurnScheduler``
(``step``, ``check_finished``, ``on_turn_end``, ``on_trajectory_start``), so a scheduler written
for ms-swift runs unchanged, and an ms-swift subclass (or any object with a ``step`` method) can
be handed to the executor directly: the executor never requires this base class.

:data:`HOOKS` declares every hook the executor calls (name and arguments): :class:`HookSet`
inspects a scheduler once, when an executor is built, against it: an ``on_*`` method that is not a
hook, or a hook that cannot take its arguments, is a :class:`HookError` naming the closest hook;
then which hooks it really overrides (the base implementations are no-ops and are skipped, so they cost nothing per request)
and which are ``async def`` (those run concurrently across the requests of a turn).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from mtflow.core.calls import is_async_callable
from mtflow.core.images import ImageLimits, with_stored_images
from mtflow.core.keys import closest_key
from mtflow.core.machine import FINISH_REASONS, StateGraph
from mtflow.core.stop import default_check

StepResult = Dict[str, Any]

#: every hook the executor calls on a scheduler, with the arguments it passes (by position): the
#: one table the preflight checks a Python scheduler's methods against (``inspect.signature``)
HOOK_ARGS: Dict[str, tuple] = {
    'step': ('infer_request', 'response_choice', 'current_turn'),
    'check_finished': ('infer_request', 'response_choice', 'current_turn'),
    'on_turn_end': ('infer_request', 'response_choice', 'current_turn'),
    'on_trajectory_start': ('requests', ),
    'on_trajectory_end': ('requests', 'error'),
    'on_request_finished': ('infer_request', 'reason', 'turn'),
    'turn_reward': ('infer_request', 'response_choice', 'current_turn'),
    'finalize_output': ('output', 'finish_reason', 'turn'),
    'on_fork': ('infer_request', 'children', 'current_turn'),
}


#: the keywords :class:`Scheduler` takes through ``**kwargs``: those ms-swift 4.6 passes every
#: scheduler it builds (its trainers' ``_prepare_scheduler``: ``tokenizer``, ``template``, and
#: ``gym_env`` with a gym environment; its rollout server's ``get_rollout_engine_type``:
#: ``tokenizer``, ``use_gym_env``, ``gym_env``), so an ms-swift-style subclass that forwards
#: ``**kwargs`` keeps working; any other keyword that reaches the base class is refused
SWIFT_KEYWORDS: Tuple[str, ...] = ('tokenizer', 'template', 'gym_env', 'use_gym_env')


class UnknownSchedulerArgument(TypeError):
    """A keyword no class of the scheduler takes reached :class:`Scheduler` (``keyword``; ``known``:
    every keyword its classes take, :func:`scheduler_keywords`)."""

    def __init__(self, owner: str, keyword: str, known: List[str]) -> None:
        self.keyword, self.known = keyword, known
        close = closest_key(keyword, known)
        super().__init__(f'{owner}() got an unexpected keyword argument {keyword!r}'
                         + (f'; did you mean {close!r}?' if close else '') + f' (known: {", ".join(known)})')


def scheduler_keywords(cls: type) -> List[str]:
    """Every keyword the ``__init__`` methods of ``cls`` and its bases name (``self``,
    ``*args``, ``**kwargs`` aside), then :data:`SWIFT_KEYWORDS`: what a scheduler class may be
    given."""
    names: List[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get('__init__')
        if init is None or klass is object:
            continue
        try:
            params = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):  # a builtin or C initialiser: nothing to read
            continue
        names += [p.name for p in params if p.name != 'self' and p.name not in names
                  and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    return names + [k for k in SWIFT_KEYWORDS if k not in names]


def check_scheduler_arguments(cls: type, args: Sequence[Any], kwargs: Dict[str, Any]) -> None:
    """What reached :class:`Scheduler`'s ``__init__`` beyond its own arguments: refused unless it
    is one of :data:`SWIFT_KEYWORDS` (see :class:`UnknownSchedulerArgument`)."""
    if args:
        raise TypeError(f'{cls.__name__}() takes infer_engine and max_turns as positional arguments of the base '
                        f'scheduler, and got {len(args)} more ({", ".join(repr(a)[:40] for a in args)}): pass them '
                        'by keyword')
    for key in kwargs:
        if key not in SWIFT_KEYWORDS:
            raise UnknownSchedulerArgument(cls.__name__, str(key), scheduler_keywords(cls))


class Scheduler:
    """Base class for Python schedulers (compatible with ms-swift's ``MultiTurnScheduler``).

    Override :meth:`step` (required) and, as needed, :meth:`check_finished`, :meth:`on_turn_end`
    and :meth:`on_trajectory_start`. Each may be ``def`` or ``async def``.

    ``finish_reasons`` lists any extra finish reasons the scheduler reports (for the state graph).
    """
    finish_reasons: Sequence[str] = ()
    #: set to True when the scheduler keys per-request state by ``uuid``: the executor then fails
    #: every later copy of a duplicate uuid before the first turn (``Executor(unique_uuids=)``)
    requires_unique_uuids: bool = False
    #: limits on the images of one request (:class:`mtflow.core.images.ImageLimits`), checked by
    #: the executor after every ``step``; ``None``: images are only checked to be readable
    image_limits: Optional[ImageLimits] = None
    #: set to True when a request may start with no messages and get its first ones from its
    #: ``step`` (called with ``response_choice=None`` before the first turn): such a request goes
    #: from ``pending`` into ``tool_step`` (``run_step``) instead of the model's turn. A role of a
    #: multi-agent episode that waits for the others before it acts opens so (``docs/multi-agent.md``)
    opens_in_step: bool = False

    def __init__(self, infer_engine: Any = None, max_turns: Optional[int] = None, *args: Any, **kwargs: Any) -> None:
        """``tokenizer`` and ``template`` may be given as keywords (as ms-swift gives them);
        ``gym_env``/``use_gym_env`` are taken and ignored (ms-swift's trainers pass them to every
        scheduler they build, :data:`SWIFT_KEYWORDS`). Any other keyword, or a third positional
        argument, is a :class:`UnknownSchedulerArgument` naming it and the closest keyword the
        scheduler's classes take: a typo in ``scheduler_args`` must not be ignored."""
        check_scheduler_arguments(type(self), args, kwargs)
        self.infer_engine = infer_engine
        self.max_turns = max_turns
        self._tokenizer = kwargs.get('tokenizer')
        self._template = kwargs.get('template')

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is not None:
            return self._tokenizer
        engine = self.infer_engine
        return getattr(engine, 'tokenizer', None) if engine is not None else None

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> StepResult:
        """Prepare the next turn. Return ``{'infer_request': <next request>}`` and optionally
        ``response_token_ids``, ``response_loss_mask`` (same length as the ids),
        ``rollout_logprobs`` and ``rollout_infos``."""
        raise NotImplementedError(f'{type(self).__name__} must implement step()')

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        """Default stop rule (as ms-swift's): the output hit the length limit, or ``max_turns``
        (:func:`mtflow.core.stop.default_check`)."""
        return default_check(response_choice.finish_reason, current_turn, self.max_turns)[0]

    async def on_turn_end(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        """Called after the output is applied, before the stop decision. May return ``done``
        (overrides ``check_finished``) and ``rollout_infos`` (merged into the request's infos)."""
        return {}

    async def on_trajectory_start(self, requests: List[Any]) -> None:
        """Called once before the first turn is generated (native API only), e.g. to reset environments."""
        return None

    async def on_trajectory_end(self, requests: List[Any], error: Optional[BaseException]) -> None:
        """Called once after the batch, on every path (as newer ms-swift does), so that
        environments can close: ``requests`` are the batch's last requests (input order),
        ``error`` the exception the run is about to raise (``MultiTurnRolloutError``,
        ``RolloutInterrupted``, ...) or ``None``. Sync or async."""
        return None

    def on_request_finished(self, infer_request: Any, reason: str, turn: int) -> None:
        """mtflow extension: called once for every request when it finishes, on every path
        (stop, ``max_turns``, error, timeout, interrupted), e.g. to close an environment. Sync or async."""
        return None

    def turn_reward(self, infer_request: Any, response_choice: Any, current_turn: int) -> Optional[float]:
        """mtflow extension: the reward of this turn's reply, or ``None`` for none. Called after
        ``on_turn_end``, before the stop decision, for every applied turn; each number is recorded
        in ``rollout_infos['turn_rewards']`` as ``{'turn', 'reward', 'source': 'turn_reward'}``
        with the turn's token span, as the YAML ``turn_reward:`` hook's are (``docs/streaming.md``).
        Anything else fails the request (field ``turn_reward``). Sync or async."""
        return None

    def finalize_output(self, output: Any, finish_reason: str, turn: int) -> Any:
        """mtflow extension: called once per request right after its output is built, before
        ``on_request_finished``; return a replacement output, or ``None`` to keep it (e.g. a
        finish-reason policy that edits ``rollout_infos``). Sync or async. A failure in it fails
        that request only."""
        return None

    def on_fork(self, infer_request: Any, children: List[Any], current_turn: int) -> None:
        """mtflow extension: ``infer_request`` is being forked (``docs/branching.md``) into
        ``children``, copies of it under their own uuids (messages, images, token record shared
        exactly). A scheduler that keeps per-request state (by uuid) copies it to each child here;
        raise :class:`mtflow.core.errors.ForkRefused` when it cannot (e.g. an environment that
        cannot be copied), and the request fails at that state. Sync or async."""
        return None


def is_default_hook(fn: Any, name: str) -> bool:
    """True when ``fn`` is mtflow's or ms-swift's no-op/default implementation of hook ``name``.

    ms-swift is recognised by qualified name and module, without importing it."""
    func = getattr(fn, '__func__', fn)
    if func is getattr(Scheduler, name, None):
        return True
    qual = getattr(func, '__qualname__', '')
    module = getattr(func, '__module__', '') or ''
    return module.startswith('swift.') and qual in {
        f'RolloutScheduler.{name}', f'MultiTurnScheduler.{name}'
    } and name != 'step'


@dataclass(frozen=True)
class Hook:
    """One hook the executor calls on a scheduler: its name and the arguments it is called with."""
    name: str
    params: Tuple[str, ...]

    def call_shape(self) -> str:
        return f'{self.name}({", ".join(self.params)})'


#: every hook the executor calls, the one declaration of the contract: :class:`HookSet` reads
#: exactly these, rejects an ``on_*`` method that is not among them and a hook that cannot take
#: these arguments, when the executor is built
HOOKS: Tuple[Hook, ...] = (
    Hook('step', ('infer_request', 'response_choice', 'current_turn')),
    Hook('check_finished', ('infer_request', 'response_choice', 'current_turn')),
    Hook('on_turn_end', ('infer_request', 'response_choice', 'current_turn')),
    Hook('on_trajectory_start', ('requests', )),
    Hook('on_trajectory_end', ('requests', 'error')),
    Hook('on_request_finished', ('infer_request', 'reason', 'turn')),
    Hook('turn_reward', ('infer_request', 'response_choice', 'current_turn')),
    Hook('finalize_output', ('output', 'finish_reason', 'turn')),
    Hook('on_fork', ('infer_request', 'children', 'current_turn')),
)
HOOK_NAMES = tuple(h.name for h in HOOKS)


class HookError(TypeError):
    """A scheduler whose hooks do not fit the contract (:data:`HOOKS`): raised when the executor
    is built, so a misspelled or mis-declared hook is never silently skipped."""


def _check_arity(owner: str, hook: Hook, fn: Any) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return
    try:
        sig.bind(*hook.params)
    except TypeError as exc:
        raise HookError(f'scheduler {owner!r}: {hook.name}{sig} cannot be called as {hook.call_shape()} ({exc})') \
            from None


def _check_unknown_hooks(scheduler: Any, owner: str) -> None:
    """An ``on_*`` method that is not a hook is a typo the executor would never call."""
    for name in dir(type(scheduler)):
        if not name.startswith('on_') or name in HOOK_NAMES:
            continue
        attr = getattr(type(scheduler), name, None)
        module = getattr(attr, '__module__', '') or ''
        if not callable(attr) or module.startswith('swift.'):  # ms-swift's own base methods are its business
            continue
        close = closest_key(name, HOOK_NAMES)
        hint = f'; did you mean {close!r}?' if close else ''
        raise HookError(f'scheduler {owner!r} defines {name}(), which is not a hook mtflow calls{hint} '
                        f'(hooks: {", ".join(HOOK_NAMES)})')


class HookSet:
    """A scheduler's hooks, resolved once from :data:`HOOKS`: the bound methods to call, ``None``
    for those to skip (absent, or the no-op default), and which ones are coroutines
    (``<name>_is_async``)."""

    def __init__(self, scheduler: Any, turn_reward: Optional[Callable[..., Any]] = None,
                 image_store: Optional[Callable[[Any], Any]] = None) -> None:
        """``turn_reward``: ``Executor(turn_reward=fn)``, which takes the place of the scheduler's own;
        ``image_store``: where each image a step adds goes as the step returns."""
        owner = type(scheduler).__name__
        step = getattr(scheduler, 'step', None)
        if not callable(step):
            raise TypeError(f'scheduler {owner!r} has no step(infer_request, response_choice, '
                            f'current_turn) method')
        _check_unknown_hooks(scheduler, owner)
        self.scheduler = scheduler
        given = {'turn_reward': turn_reward} if turn_reward is not None else {}
        for hook in HOOKS:
            fn = given.get(hook.name) or getattr(scheduler, hook.name, None)
            if not callable(fn) or (hook.name != 'step' and hook.name not in given and is_default_hook(fn, hook.name)):
                fn = None
            if fn is not None:
                _check_arity(owner, hook, fn)
            setattr(self, hook.name, fn)
            setattr(self, f'{hook.name}_is_async', fn is not None and is_async_callable(fn))
        if image_store is not None:  # each step's new images go to the store as it returns
            self.step = with_stored_images(self.step, self.step_is_async, image_store,
                                           getattr(scheduler, 'image_limits', None))

        #: whether a request with no messages opens in its step (:attr:`Scheduler.opens_in_step`)
        self.opens_in_step = getattr(scheduler, 'opens_in_step', False) is True
        extra = tuple(getattr(scheduler, 'finish_reasons', ()) or ())
        self.finish_reasons = tuple(dict.fromkeys(FINISH_REASONS + extra))

    def graph(self) -> StateGraph:
        """The state graph an executor drives this scheduler with: the core reasons plus its own."""
        return StateGraph(self.finish_reasons, name=type(self.scheduler).__name__)

    @property
    def default_max_turns(self) -> Optional[int]:
        """The scheduler's own ``max_turns`` (used by the inline default stop rule)."""
        return getattr(self.scheduler, 'max_turns', None)
