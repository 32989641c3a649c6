"""The scheduler of multi-agent episodes: every role of every episode is one request it schedules.

An episode is a group of ordinary requests, one per role (:func:`mtflow.roles.requests.episode_requests`),
linked by their ``data_dict['episode']``. :class:`EpisodeScheduler` is the one scheduler the
executor drives them with, through the one table of per-state handlers like any request:

* ``on_trajectory_start``: each new episode's environment is made and reset (one per episode,
  all of a batch's at once); a role request starts with no messages and *opens in its step*
  (``opens_in_step``: ``pending`` -> ``tool_step``);
* ``step`` with no output yet (the opening): the role's system prompt and its opening
  observations when the environment names it to act first, else a
  :class:`~mtflow.core.records.Wait` (it rests in ``tool_step`` until the environment names it);
* ``on_turn_end``: a role with its own scheduler (tools) runs that scheduler's hooks; its turn
  is an *action* when its own scheduler would stop there (an answer without a tool call, a stop
  rule), else an inner turn (a tool call) and its own ``step`` runs next; a role without one acts
  with every turn;
* ``step`` after an action: the action goes to the episode (:meth:`Episode.submit`, which steps
  the environment once every acting role has acted) and the role goes on when named, rests until
  then, or finishes when the episode ends (``episode_done``, its reward);
* ``on_request_finished``: a role that left early (an error, a timeout, a limit) ends its
  episode; the environment is closed when the episode's last role has finished.

``check_finished`` is false: the output's own ``finish_reason`` never ends a role, the episode
does (the executor's turn bound, a context budget and ``max_steps`` still bound it).
"""
from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from mtflow.core.calls import is_async_callable
from mtflow.core.errors import ForkRefused
from mtflow.core.machine import EPISODE_DONE, ROLE_FAILED
from mtflow.core.scheduler import HookSet, Scheduler
from mtflow.core.seeds import stable_seed
from mtflow.core.stop import decide_stop, default_check
from mtflow.roles.env import Action, EpisodeEnvError, EpisodeInfo, check_episode_env
from mtflow.roles.episode import Episode, Member
from mtflow.roles.role import Role, RoleError, check_roles, seat_of

__all__ = ['EpisodeScheduler', 'EnvFactory']

#: ``factory(episode_info) -> environment``, or an environment class (made with no arguments)
EnvFactory = Callable[..., Any]


async def _awaited(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class EpisodeScheduler(Scheduler):
    """See the module docstring.

    Args:
        env: the episode environment: a class (``env()`` per episode), or a factory called with
            the :class:`~mtflow.roles.env.EpisodeInfo` (or with nothing) that returns one; checked
            against the interface now (:func:`~mtflow.roles.env.check_episode_env`).
        roles: the episode's :class:`~mtflow.roles.role.Role` s.
        policies: the policy ids the run serves (each role's must be one: checked now); ``None``:
            not checked here (the router checks it).
        max_steps: environment steps before an episode is cut (``max_turns``); ``None``: none.
        turn_prompt: the message a role gets when named to act with no new observation.
    """
    opens_in_step = True
    requires_unique_uuids = True
    finish_reasons = (EPISODE_DONE, ROLE_FAILED)

    def __init__(self, env: EnvFactory, roles: Sequence[Role], *, policies: Optional[Sequence[str]] = None,
                 max_steps: Optional[int] = None, turn_prompt: str = 'Your turn.', max_turns: Optional[int] = None) -> None:
        super().__init__(max_turns=max_turns)
        self.roles: Dict[str, Role] = check_roles(roles, policies)
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
            raise RoleError(f'max_steps must be an int >= 1, got {max_steps!r}')
        self.max_steps = max_steps
        self.turn_prompt = turn_prompt
        self.make_env = env
        self._check_env([r.env_seat for r in self.roles.values()])
        #: each role's own scheduler's hooks (a role without one: ``None``)
        self.role_hooks: Dict[str, Optional[HookSet]] = {
            name: HookSet(role.scheduler) if role.scheduler is not None else None for name, role in self.roles.items()}
        self.episodes: Dict[str, Episode] = {}
        #: request uuid -> (its episode, its member)
        self.members: Dict[str, Tuple[Episode, Member]] = {}
        #: request uuid -> the reason its own scheduler stopped at this turn (its action), if it did
        self.acted: Dict[str, Optional[str]] = {}

    def _check_env(self, seats: List[Any]) -> None:
        """The environment against the interface, at load: a class as it is; a factory by one
        environment it makes for a probe episode (closed at once)."""
        if inspect.isclass(self.make_env):
            check_episode_env(self.make_env, seats)
            return
        if not callable(self.make_env):
            raise EpisodeEnvError(f'env must be an episode environment class or a factory of them, got '
                                  f'{type(self.make_env).__name__}')
        probe = self._new_env(EpisodeInfo('<check>', 0, {}, [], {n: r.env_seat for n, r in self.roles.items()}))
        try:
            check_episode_env(probe, seats)
        finally:
            close = getattr(probe, 'close', None)
            if callable(close) and not is_async_callable(close):
                close()

    # ---- who is who ------------------------------------------------------------------------------
    def _member(self, request: Any) -> Tuple[Episode, Member]:
        found = self.members.get(str(getattr(request, 'uuid', None)))
        if found is None:
            raise RoleError(f'request {getattr(request, "uuid", None)} is no role of a running episode (was it made by '
                            f'mtflow.roles.episode_requests, and did its episode start in this run?)')
        return found

    def _new_env(self, info: EpisodeInfo) -> Any:
        make = self.make_env
        if inspect.isclass(make):
            return make()
        try:
            return make(info)
        except TypeError:
            if len(inspect.signature(make).parameters) == 0:
                return make()
            raise

    def _episode_of(self, request: Any) -> Episode:
        seat = seat_of(request)
        uuid = str(getattr(request, 'uuid', None))
        if seat is None:
            raise RoleError(f'request {uuid} has no data_dict["episode"]: an episode scheduler runs role requests '
                            f'only (mtflow.roles.episode_requests makes them)')
        episode = self.episodes.get(seat.episode)
        if episode is None:
            data = dict(getattr(request, 'data_dict', None) or {})
            task = data.pop('task', None) or []
            data.pop('episode', None)
            seed = data.get('seed')
            info = EpisodeInfo(seat.episode, seed if isinstance(seed, int) else stable_seed(seat.episode), data, task,
                               {name: role.env_seat for name, role in self.roles.items()})
            episode = Episode(info, self._new_env(info), self.roles, self.max_steps, self.turn_prompt)
            self.episodes[seat.episode] = episode
        episode.join(seat.role, uuid, request)
        self.members[uuid] = (episode, episode.members[seat.role])
        return episode

    # ---- hooks -----------------------------------------------------------------------------------
    async def on_trajectory_start(self, requests: List[Any]) -> None:
        fresh: List[Episode] = []
        for request in requests:
            episode = self._episode_of(request)
            if not episode.started and episode not in fresh:
                fresh.append(episode)
        await asyncio.gather(*(episode.start() for episode in fresh))  # each keeps its own failure

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        return False

    async def on_turn_end(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        episode, member = self._member(infer_request)
        hooks = self.role_hooks[member.role.name]
        uuid = member.uuid
        if hooks is None:
            self.acted[uuid] = None
            return {}
        result: Dict[str, Any] = {}
        if hooks.on_turn_end is not None:
            result = dict(await _awaited(hooks.on_turn_end(infer_request, response_choice, current_turn)) or {})
        if hooks.check_finished is not None:
            checked = bool(await _awaited(hooks.check_finished(infer_request, response_choice, current_turn)))
            reason = 'check_finished'
        else:
            checked, reason = default_check(response_choice.finish_reason, current_turn, None)
        stop, why = decide_stop(result or None, checked, reason, current_turn, None, None)
        if stop:  # what would have ended its request is its action in the episode
            self.acted[uuid] = why
            result.pop('done', None)
            result.pop('finish_reason', None)
        else:
            self.acted.pop(uuid, None)
        return result

    async def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Any:
        episode, member = self._member(infer_request)
        if member.waiting is not None:  # its step runs again while it rests: a run stopped and resumed it
            raise RoleError(f'role {member.role.name!r} of episode {episode.info.id} was cut while it waited for the '
                            f'others (a budget stopped the run): an episode cannot resume from its roles; run its '
                            f'prompt again')
        if response_choice is None:  # it opens: its first messages come from the episode
            episode.open(member, infer_request)
            hooks = self.role_hooks[member.role.name]
            if hooks is not None and hooks.on_trajectory_start is not None:  # e.g. a YAML scheduler's system prompt
                await _awaited(hooks.on_trajectory_start([infer_request]))
            return episode.next_for(member)
        if not member.opened:
            raise RoleError(f'role request {member.uuid} came with messages: it did not start its episode '
                            f'{episode.info.id} (a role request is used once: make new ones with episode_requests)')
        member.request = infer_request
        hooks = self.role_hooks[member.role.name]
        if hooks is not None and member.uuid not in self.acted:  # an inner turn: its own scheduler's step
            return await _awaited(hooks.step(infer_request, response_choice, current_turn))
        self.acted.pop(member.uuid, None)
        action = Action(response_choice.message.content or '', response_choice.token_ids, current_turn,
                        infer_request.messages[member.mark:])
        await episode.submit(member, action, current_turn)
        return episode.next_for(member)

    async def turn_reward(self, infer_request: Any, response_choice: Any, current_turn: int) -> Optional[float]:
        """A role's own scheduler's ``turn_reward``, when it has one."""
        hooks = self.role_hooks[self._member(infer_request)[1].role.name]
        if hooks is None or hooks.turn_reward is None:
            return None
        return await _awaited(hooks.turn_reward(infer_request, response_choice, current_turn))

    def on_fork(self, infer_request: Any, children: List[Any], current_turn: int) -> None:
        """A role cannot be forked: its copies would be roles the episode does not have."""
        raise ForkRefused(f'role {self._member(infer_request)[1].role.name!r} of an episode cannot be forked (a '
                          f'branch would be a second player in the same seat); branch whole episodes by their '
                          f'prompts instead (copies)', uuid=str(getattr(infer_request, 'uuid', None)),
                          turn=current_turn, field='branch')

    async def on_request_finished(self, infer_request: Any, reason: str, turn: int) -> None:
        uuid = str(getattr(infer_request, 'uuid', None))
        found = self.members.pop(uuid, None)
        self.acted.pop(uuid, None)
        hooks = None
        if found is not None:
            episode, member = found
            hooks = self.role_hooks[member.role.name]
            episode.left(member, reason, turn)
            if episode.over:
                self.episodes.pop(episode.info.id, None)
                await episode.close()
        if hooks is not None and hooks.on_request_finished is not None:
            await _awaited(hooks.on_request_finished(infer_request, reason, turn))

    async def on_trajectory_end(self, requests: List[Any], error: Optional[BaseException]) -> None:
        for scheduler in {id(h.scheduler): h for h in self.role_hooks.values() if h is not None}.values():
            if scheduler.on_trajectory_end is not None:
                await _awaited(scheduler.on_trajectory_end(requests, error))
