"""One running episode: its environment, its roles' requests, who acts now, and its record.

The episode is what the role requests of one episode share while they run; the requests
themselves are ordinary records of the engine, driven by whichever driver runs them. A role's
``step`` (:class:`mtflow.roles.scheduler.EpisodeScheduler`) hands the episode its action
(:meth:`Episode.submit`) and asks for its next observation (:meth:`Episode.next_for`): the
request goes on at once when the environment names it to act, and otherwise answers
:class:`~mtflow.core.records.Wait` with a future the episode resolves when the environment does
name it (or ends the episode). So a role waiting for the others rests in ``tool_step``, as a
gateway session waits for its client's next call.

Once every acting role has acted, the environment steps (:meth:`Episode.submit`): each role's
observations go to its inbox (delivered as its next messages when it acts), rewards add up, and
the step goes into the episode record with who acted and at which of their turns. The episode
ends when the environment says so (finish reason ``episode_done``, each role its reward), when
it has run ``max_steps`` environment steps (``max_turns``), or when a role leaves early
(:meth:`Episode.left`: an error or timeout ends the others ``role_failed``, a limit ends them
with that limit; ``ended_by`` names the role). An environment that names no role to act while
the episode is not over is a deadlock: every role of the episode fails with a
:class:`~mtflow.core.errors.DeadlockError` naming the episode and the step.
"""
from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Union

from mtflow.core.errors import DeadlockError
from mtflow.core.machine import EPISODE_DONE, FAILURE_REASONS, MAX_TURNS, ROLE_FAILED
from mtflow.core.records import Wait
from mtflow.roles.env import EpisodeEnvError, EpisodeInfo, as_messages, as_step
from mtflow.roles.role import EPISODE_KEY, Role, Seat

__all__ = ['Episode', 'Member', 'StepResult']

#: what a role's step gets back from the episode: its next request, the end, or a wait
StepResult = Union[Dict[str, Any], Wait]


async def _value(result: Any) -> Any:
    """An environment method's result, awaited when it is awaitable (sync or async methods)."""
    return await result if inspect.isawaitable(result) else result


@dataclass
class Member:
    """One role of the episode: its request and what the episode keeps for it."""
    role: Role
    uuid: str
    request: Any = None
    #: observations not yet delivered (its next messages when it acts)
    inbox: List[Dict[str, Any]] = field(default_factory=list)
    #: the future its resting step waits on, while it waits
    waiting: Optional['asyncio.Future[Any]'] = None
    reward: float = 0.0
    rewarded: bool = False
    #: the finish reason the episode gave it (its end was the episode's), or ``None``
    given: Optional[str] = None
    #: the reason its request finished with, once it did
    finished: Optional[str] = None
    #: how many messages its conversation had when it was last named to act (what it added since: its action's)
    mark: int = 0
    #: its request opened in its step (a role request reused from an earlier run never does)
    opened: bool = False


class Episode:
    """See the module docstring. ``env``: the episode environment (an instance);
    ``roles``: the episode's roles by name; ``max_steps``: environment steps before the episode is
    cut (``None``: the environment decides); ``turn_prompt``: the message a role gets when it is
    named to act with no new observation (a message never ends with the role's own text, so its
    next turn is a new reply, never a continuation)."""

    def __init__(self, info: EpisodeInfo, env: Any, roles: Mapping[str, Role], max_steps: Optional[int] = None,
                 turn_prompt: str = 'Your turn.') -> None:
        self.info = info
        self.env = env
        self.roles = roles
        self.max_steps = max_steps
        self.turn_prompt = turn_prompt
        self.members: Dict[str, Member] = {}
        self.by_seat = {role.env_seat: name for name, role in roles.items()}
        self.acting: List[str] = []
        self.actions: Dict[str, str] = {}
        self.action_turns: Dict[str, int] = {}
        self.steps: List[Dict[str, Any]] = []
        self.done = False
        self.reason: Optional[str] = None
        self.ended_by: Optional[Dict[str, Any]] = None
        self.env_info: Optional[Mapping[str, Any]] = None
        self.failure: Optional[BaseException] = None
        #: the roles that left early (:meth:`left`): the episode ends once the others owe no action
        self.leavers: List[Dict[str, Any]] = []
        self.started = False
        self.closed = False

    # ---- names -----------------------------------------------------------------------------------
    def where(self, field_name: str = '') -> str:
        step = len(self.steps) + 1
        return (f'episode {self.info.id}, step {step}, environment {type(self.env).__name__}'
                + (f', field {field_name!r}' if field_name else ''))

    def _role_of_seat(self, seat: Any, field_name: str) -> str:
        name = self.by_seat.get(seat)
        if name is None:
            raise EpisodeEnvError(f'{self.where(field_name)}: unknown seat {seat!r}; the seats are '
                                  f'{list(self.by_seat)!r}')
        return name

    def seat(self, member: Member) -> Seat:
        role = member.role
        return Seat(self.info.id, role.name, role.seat, role.policy, role.train)

    # ---- joining and starting --------------------------------------------------------------------
    def join(self, role: str, uuid: str, request: Any) -> None:
        """A request plays ``role`` (each role exactly once)."""
        if role not in self.roles:
            raise EpisodeEnvError(f'episode {self.info.id}: request {uuid} plays role {role!r}, which the episode '
                                  f'does not declare (roles: {list(self.roles)})')
        other = self.members.get(role)
        if other is not None and other.uuid != uuid:
            raise EpisodeEnvError(f'episode {self.info.id}: role {role!r} is played by requests {other.uuid} and '
                                  f'{uuid}; each role of an episode is one request')
        if other is None:
            self.members[role] = Member(self.roles[role], uuid, request)

    async def start(self) -> None:
        """Reset the environment (once) and learn who acts first. A failure here is kept and fails
        every role of this episode at its first step (the other episodes go on)."""
        if self.started:
            return
        self.started = True
        try:
            missing = [name for name in self.roles if name not in self.members]
            if missing:
                raise EpisodeEnvError(f'episode {self.info.id} has no request for role(s) {missing} (each role of '
                                      f'an episode is one request of the same run: mtflow.roles.episode_requests)')
            opening = await _value(self.env.reset(self.info))
            self._deliver(opening, 'reset')
            await self._who_acts()
        except Exception as exc:  # an environment that cannot start: this episode's roles fail, naming it
            self.failure = exc

    async def _who_acts(self) -> None:
        seats = await _value(self.env.acting())
        if isinstance(seats, (str, bytes)) or not isinstance(seats, (list, tuple, set, frozenset)):
            raise EpisodeEnvError(f'{self.where("acting")}: acting() must return a list of seats, got '
                                  f'{type(seats).__name__}')
        self.acting = [self._role_of_seat(s, 'acting') for s in seats]
        if not self.acting and not self.done:
            last = self.steps[-1] if self.steps else None
            after = (f'after step {last["step"]} ({", ".join(f"{n} at its turn {t}" for n, t in last["turns"].items())})'
                     if last else 'after the reset')
            raise DeadlockError(f'episode {self.info.id}, {after}: the environment {type(self.env).__name__} named no '
                                f'role to act and the episode is not over (roles playing: '
                                f'{", ".join(m.role.name for m in self.members.values() if m.finished is None)})')

    def _deliver(self, observations: Any, field_name: str) -> None:
        if observations is None:
            return
        if not isinstance(observations, Mapping):
            raise EpisodeEnvError(f'{self.where(field_name)}: observations must map seats to observations, got '
                                  f'{type(observations).__name__}')
        for seat, observation in observations.items():
            name = self._role_of_seat(seat, field_name)
            self.members[name].inbox.extend(as_messages(observation, self.where(f'{field_name}[{seat!r}]')))

    # ---- the roles' steps ------------------------------------------------------------------------
    def open(self, member: Member, request: Any) -> None:
        """A role's first step (its request has no messages yet): its system prompt; then
        :meth:`next_for` says whether it acts (its opening observations) or waits to be named."""
        member.request = request
        member.opened = True
        if member.role.system:
            request.messages.insert(0, {'role': 'system', 'content': member.role.system})

    async def submit(self, member: Member, text: str, turn: int) -> None:
        """``member`` acted with ``text`` at its turn ``turn``; once every acting role has, the
        environment steps."""
        if self.done or self.failure is not None:
            return
        name = member.role.name
        if name not in self.acting or name in self.actions:
            raise EpisodeEnvError(f'{self.where()}: role {name!r} acted but the environment did not name it to act '
                                  f'(acting: {self.acting})')
        self.actions[name] = text
        self.action_turns[name] = turn
        if self.leavers:  # a role left: no more environment steps
            self._end_if_settled()
            return
        if all(n in self.actions for n in self.acting):
            try:
                await self._step_env()
            except Exception as exc:  # the environment failed: every role of this episode fails with it
                self.failure = exc
                self._wake_all()
                raise

    async def _step_env(self) -> None:
        acted = [n for n in self.acting]
        actions = {self.roles[n].env_seat: self.actions[n] for n in acted}
        entry: Dict[str, Any] = {'step': len(self.steps) + 1, 'acted': acted,
                                 'turns': {n: self.action_turns[n] for n in acted}}
        result = as_step(await _value(self.env.step(actions)), self.where('step'))
        self.actions, self.action_turns = {}, {}
        if result.rewards:
            rewards = {}
            for seat, value in result.rewards.items():
                name = self._role_of_seat(seat, 'rewards')
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise EpisodeEnvError(f'{self.where(f"rewards[{seat!r}]")}: a reward must be a number, got '
                                          f'{value!r:.60}')
                member = self.members[name]
                member.reward += float(value)
                member.rewarded = True
                rewards[name] = float(value)
            entry['rewards'] = rewards
        if result.info:
            self.env_info = dict(result.info)
        self.steps.append(entry)
        self._deliver(result.observations, 'observations')
        if result.done:
            self.end(EPISODE_DONE)
        elif self.max_steps is not None and len(self.steps) >= self.max_steps:
            self.end(MAX_TURNS, {'reason': 'max_steps', 'max_steps': self.max_steps})
        else:
            await self._who_acts()
            for name in self.acting:
                waiting = self.members[name]
                if waiting.waiting is not None:
                    self._resolve(waiting, self.next_for(waiting))

    def next_for(self, member: Member) -> StepResult:
        """What ``member``'s step answers now: its next request (named to act: its inbox delivered),
        the end of the episode, or a wait until either."""
        if self.failure is not None:
            raise self.failure
        if self.done:
            return self._finish(member)
        name = member.role.name
        if name in self.acting and name not in self.actions:
            request = member.request
            messages = member.inbox or [{'role': 'user', 'content': self.turn_prompt}]
            member.inbox = []
            request.messages.extend(messages)
            member.mark = len(request.messages)
            return {'infer_request': request, 'rollout_infos': {EPISODE_KEY: self.seat(member).to_dict()}}
        future = asyncio.get_running_loop().create_future()
        member.waiting = future
        others = ', '.join(self.acting) or 'nobody'
        return Wait(future, f'episode {self.info.id}, step {len(self.steps) + 1}: {name} waits for {others}')

    def _resolve(self, member: Member, result: Any) -> None:
        future, member.waiting = member.waiting, None
        if future is not None and not future.done():
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    def _wake_all(self) -> None:
        for member in self.members.values():
            if member.waiting is not None:
                self._resolve(member, self.failure if self.failure is not None else self._finish(member))

    # ---- the end ---------------------------------------------------------------------------------
    def end(self, reason: str, ended_by: Optional[Dict[str, Any]] = None) -> None:
        """The episode is over (``reason``: each role still playing finishes with it)."""
        if self.done:
            return
        self.done = True
        self.reason = reason
        self.ended_by = ended_by
        self.acting = []
        self._wake_all()

    def left(self, member: Member, reason: str, turn: int) -> None:
        """``member``'s request finished with ``reason``. If the episode did not end it, the
        episode ends: the others finish ``role_failed`` (it failed or timed out) or with the same
        limit (``max_turns``, ``interrupted``, ...), and ``ended_by`` names it. The roles that owe an
        action of the current step (named to act, not acted yet) act first, then finish: whether a
        role had generated its move when another failed never depends on the timing."""
        member.finished = reason
        member.waiting = None
        if member.given is not None or self.done:
            return
        self.leavers.append({'role': member.role.name, 'seat': member.role.seat, 'uuid': member.uuid,
                             'reason': reason, 'turn': turn})
        self._end_if_settled()

    def _end_if_settled(self) -> None:
        """A role left: the episode ends once no other role owes an action of this step (their
        actions are recorded, the environment does not step again)."""
        if not self.leavers or self.done:
            return
        owing = [n for n in self.acting if n not in self.actions and self.members[n].finished is None]
        if owing:
            return
        acted = [n for n in self.acting if n in self.actions]
        if acted:
            self.steps.append({'step': len(self.steps) + 1, 'acted': acted,
                               'turns': {n: self.action_turns[n] for n in acted}, 'stepped': False})
        order = list(self.roles)  # several left in the same step: the first declared names the end
        first = min(self.leavers, key=lambda leaver: order.index(leaver['role']))
        self.end(ROLE_FAILED if first['reason'] in FAILURE_REASONS else first['reason'], first)

    def _finish(self, member: Member) -> Dict[str, Any]:
        member.given = self.reason
        infos: Dict[str, Any] = {EPISODE_KEY: self.record(member)}
        if self.reason == EPISODE_DONE or member.rewarded:
            infos['reward'] = member.reward
        return {'done': True, 'finish_reason': self.reason, 'rollout_infos': infos}

    def record(self, member: Optional[Member] = None) -> Dict[str, Any]:
        """The episode record: this role's place (when ``member`` is given), every role with its
        request, who acted at each step (and at which of their turns), the rewards by role, why it
        ended."""
        out: Dict[str, Any] = self.seat(member).to_dict() if member is not None else {'id': self.info.id}
        out['roles'] = [{'role': m.role.name, 'seat': m.role.seat, 'policy': m.role.policy, 'train': m.role.train,
                         'uuid': m.uuid} for m in self.members.values()]
        out['steps'] = [dict(s) for s in self.steps]
        out['rewards'] = {m.role.name: m.reward for m in self.members.values() if m.rewarded or
                          self.reason == EPISODE_DONE}
        out['reason'] = self.reason
        if self.ended_by is not None:
            out['ended_by'] = dict(self.ended_by)
        if self.env_info:
            out['info'] = _plain(self.env_info)
        return out

    @property
    def over(self) -> bool:
        """Every role's request has finished (the episode can be forgotten)."""
        return all(m.finished is not None for m in self.members.values())

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        close = getattr(self.env, 'close', None)
        if callable(close):
            await _value(close())


def _plain(value: Any) -> Any:
    """A JSON-friendly copy of an environment's info (keys as text, unknown values as their repr)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)
