"""The ``env:`` section of a YAML scheduler: one environment session per request.

A session is opened by ``on_trajectory_start`` (all resets of a batch at once), stepped with
each completion in ``on_turn_end``, and closed when its request finishes or the scheduler closes.
Each open session is counted by the run's ``admission.env_sessions`` gate
(:mod:`mtflow.engine.admission`), which bounds the requests started and not finished. A reset
that fails fails its own request only, at its first turn (kept in ``RequestState.env_error``).
:class:`EnvSessions` is :class:`~mtflow.declarative.scheduler.YamlScheduler`'s collaborator for it.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any, Callable, Dict, Iterable, List, Optional

from mtflow.core.errors import ForkRefused
from mtflow.declarative.envs import normalize_step
from mtflow.declarative.images import add_images, split_observation
from mtflow.declarative.request_state import RequestState, maybe_await
from mtflow.declarative.turn_rewards import TurnRewards
from mtflow.engine.admission import Admission

__all__ = ['EnvSessions']

#: what a fork copies deeply from a request's state (the rest is shared or set apart)
_COPIED = ('error_kinds', 'tips_given', 'calls', 'rewards', 'turn_rewards', 'env_actions')


class EnvSessions:
    """The environment factory (``None`` without ``env:``) and the sessions it opens."""

    def __init__(self, factory: Optional[Callable[[], Any]], image_limits: Any, turn_rewards: TurnRewards) -> None:
        self.factory = factory
        self.image_limits = image_limits
        self.turn_rewards = turn_rewards
        self.admission: Optional[Admission] = None  # the run's, given by use_admission

    def replace_factory(self, factory: Callable[[], Any]) -> None:
        """Use ``factory`` instead (a replay's recorded environment): the configured one is closed
        unused (it is cheap and starts nothing until called)."""
        self.close_factory()
        self.factory = factory

    def _opened(self) -> None:
        if self.admission is not None:
            self.admission.env_sessions.opened()

    def _closed(self) -> None:
        if self.admission is not None:
            self.admission.env_sessions.closed()

    async def start(self, request: Any, state: RequestState) -> None:
        """Open ``request``'s session and reset it; an opening observation becomes the first user
        message when the request has none. A failure is kept for the request's first turn."""
        try:
            state.env = self.factory()
            self._opened()
            if getattr(state.env, 'replayable', False):  # kept as it was reset: a fork replays from it
                state.env_reset = copy.deepcopy(request)
            opening = await maybe_await(state.env.reset(request))
        except Exception as error:
            state.env_error = error
            return
        if opening and not any(m.get('role') == 'user' for m in request.messages):
            try:
                text, images = split_observation(opening, self.image_limits, request.uuid, 1,
                                                 'the environment reset observation')
            except Exception as error:
                state.env_error = error
                return
            request.messages.append({'role': 'user', 'content': text})
            add_images(request, images, None)

    async def _ensure(self, request: Any, state: RequestState) -> Any:
        """The request's environment, opened and reset now when ``on_trajectory_start`` did not
        (a request whose first turn was generated outside mtflow)."""
        if state.env is None and self.factory is not None:
            state.env = self.factory()
            self._opened()
            await maybe_await(state.env.reset(request))
        return state.env

    async def step(self, request: Any, state: RequestState, completion: str, infos: Dict[str, Any],
                   turn: int) -> Optional[str]:
        """Step the request's environment with the completion: ``stop_rule:env_done`` or
        ``stop_rule:env_truncated`` when the episode ended, else its observation for ``step``."""
        if state.env_error is not None:
            error, state.env_error = state.env_error, None
            raise error
        env = await self._ensure(request, state)
        out = normalize_step(await maybe_await(env.step(completion)))
        if state.env_reset is not None:
            state.env_actions.append((completion, out.observation))
        state.rewards.append(out.reward)
        self.turn_rewards.env(state, turn, out.reward)
        infos.update(env_steps=len(state.rewards), rewards=list(state.rewards), reward=float(sum(state.rewards)),
                     env_info=out.info)
        if out.terminated:
            return 'stop_rule:env_done'
        if out.truncated:
            return 'stop_rule:env_truncated'
        state.env_obs = out.observation
        return None

    async def fork(self, state: RequestState, request: Any, copies: int, turn: int) -> List[RequestState]:
        """The states of ``copies`` children of ``request`` (``docs/branching.md``): copies of
        ``state``, each with its own environment session: ``env.fork()`` (an independent copy in
        the same state), else, for an environment that declares ``replayable = True``, a new one
        reset as ``request``'s was and stepped with its actions (each observation checked against
        the one recorded); else the fork is refused (:class:`ForkRefused`, naming the environment).
        A refusal closes the sessions opened for the children before it."""
        made: List[RequestState] = []
        try:
            for _ in range(copies):
                made.append(await self._fork_one(state, request, turn))
        except BaseException:
            for forked in made:
                await self.close_session(forked)
            raise
        return made

    async def _fork_one(self, state: RequestState, request: Any, turn: int) -> RequestState:
        env = state.env
        forked = dataclasses.replace(state, env=None, **{f: copy.deepcopy(getattr(state, f)) for f in _COPIED})
        if env is None:
            return forked
        uuid = getattr(request, 'uuid', None)
        name = type(env).__name__
        fork = getattr(env, 'fork', None)
        if callable(fork):
            forked.env = await maybe_await(fork())
        elif getattr(env, 'replayable', False) and state.env_reset is not None:
            forked.env = await self._replay(state, name, uuid, turn)
        else:
            raise ForkRefused(f'environment {name} can be neither copied (no fork() method) nor replayed (no '
                              '`replayable = True`), so this request cannot fork here', uuid=uuid, turn=turn,
                              field='env')
        self._opened()
        return forked

    async def _replay(self, state: RequestState, name: str, uuid: Any, turn: int) -> Any:
        """A new environment reset as the parent's was and stepped with its actions."""
        env = self.factory()
        try:
            await maybe_await(env.reset(copy.deepcopy(state.env_reset)))
            for k, (action, seen) in enumerate(state.env_actions, 1):
                out = normalize_step(await maybe_await(env.step(action)))
                if out.observation != seen:
                    raise ForkRefused(f'environment {name} replayed differently at its step {k} ({out.observation!r} '
                                      f'instead of {seen!r}): it is not replayable, so this request cannot fork here',
                                      uuid=uuid, turn=turn, field='env')
        except BaseException:
            close = env.close()
            if inspect.isawaitable(close):
                await close
            raise
        return env

    async def close_session(self, state: RequestState) -> None:
        """The request finished: close its session (counted closed even when closing raises)."""
        if state.env is not None:
            env, state.env = state.env, None
            try:
                await maybe_await(env.close())
            finally:
                self._closed()

    def abandon(self, states: Iterable[RequestState]) -> None:
        """The scheduler closes with sessions still open: each is abandoned (an async env whose
        close needs the executor's loop) or closed without a loop."""
        for state in states:
            if state.env is not None:
                self._closed()
                abandon = getattr(state.env, 'abandon', None)
                if callable(abandon):
                    abandon()
                    continue
                close = state.env.close()
                if inspect.isawaitable(close):
                    close.close()

    def close_factory(self) -> None:
        """Release what the factory holds (e.g. the OpenEnv servers it launched)."""
        close = getattr(self.factory, 'close', None)
        if callable(close):
            close()
