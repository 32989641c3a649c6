"""verifiers 0.4 environments run in-process: the taskset's tasks, the environment's own
``Env.run(task, agents)`` and the tasks' own rewards (``Task.score``) in mtflow's process, with
mtflow as the agent, so a rollout costs no agent program (verifiers' harnesses are programs, one
process per rollout: that path is the gateway's, docs/gateway.md).

verifiers 0.4 (``verifiers.v1``) has no in-process model loop: every seat of an ``Env`` is played
by a harness program whose model calls verifiers intercepts. Here each seat is played by the
request instead. ``agents.<seat>.interaction(task)`` gives an interaction whose ``turn(message)``
hands ``message`` to mtflow as the next message (the first one opens the conversation) and
returns the model's next reply as verifiers' ``Segment``; ``agents.<seat>.run(task)`` (the
``SingleAgentEnv`` of a plain taskset) takes one reply to the task's prompt. Each reply is
recorded on a real verifiers ``Trace`` by verifiers' own graph code (``prepare_turn(...)
.commit(...)``), so when ``Env.run`` returns, the task's ``@vf.reward`` functions score the same
trace they would after a harness run; the trace's reward (the sum of its weighted rewards, what
vf-eval reports) is the step's reward, each named reward in ``env_info``.

Each request names its task by ``data_dict['task']`` (its index in the taskset, as vf-eval numbers
them); its messages are replaced by the task's own (system prompt, then the prompt, or the
environment's first message). The episode runs on the section's own event loop (a host-side
engine, e.g. verifiers' OpenEnv taskset, keeps its WebSocket open across turns). Tasks that launch
tool servers (MCP ``toolsets``) or need a runtime box are refused at load: only a harness program
can use those. A failure of ``Env.run`` or of the scoring fails that request with
:class:`EnvFailure`, naming the taskset and the step.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any, Dict, List, Optional

from mtflow.core.errors import MtflowError
from mtflow.declarative.envs.base import EnvFailure, StepOutcome, require
from mtflow.declarative.envs.config import VerifiersConfig
from mtflow.declarative.envs.local_servers import IOLoop

__all__ = ['VerifiersPool', 'VerifiersSession', 'KIND']

KIND = 'verifiers'


class VerifiersError(MtflowError):
    """A verifiers environment that cannot run in-process, or a request that names no task."""


class VerifiersPool:
    """One ``env: {verifiers: ...}`` section: the verifiers ``Env`` (loaded once, as vf-eval loads
    it), its tasks, and the loop the episodes run on; calling it makes a :class:`VerifiersSession`."""

    def __init__(self, config: VerifiersConfig) -> None:
        require('verifiers.v1', 'verifiers-v1')
        from verifiers.v1.configs.env import EnvConfig
        from verifiers.v1.configs.taskset import TasksetConfig
        from verifiers.v1.env import Env
        from verifiers.v1.utils.generic import concrete_type
        from verifiers.v1.utils.loaders import environment_class, taskset_class

        self.config = config
        tasks_cls = taskset_class(config.taskset)
        taskset_config = concrete_type(tasks_cls, TasksetConfig) or TasksetConfig
        env_cls = environment_class(config.taskset, config.env or '')
        env_config = concrete_type(env_cls, EnvConfig, origin=Env) or EnvConfig
        self.env = env_cls(env_config(taskset=taskset_config(id=config.taskset, **config.config)))
        task_cls = type(self.env.taskset).task_type()
        if task_cls.toolsets(self.env.taskset.config.task):
            raise VerifiersError(f'taskset {config.taskset!r}: its tasks launch tool servers (MCP toolsets), which '
                                 'only a harness program can use; run it through the gateway (docs/gateway.md)')
        if getattr(task_cls, 'NEEDS_CONTAINER', False):
            raise VerifiersError(f'taskset {config.taskset!r}: its tasks need a container runtime')
        self._tasks: List[Any] = []
        self._iter = iter(self.env.taskset)
        self._lock = threading.Lock()
        self.io = IOLoop('mtflow-verifiers-io', lambda: VerifiersError('the verifiers pool is closed'))
        self.ids = itertools.count(1)

    def __call__(self) -> 'VerifiersSession':
        return VerifiersSession(self)

    def task(self, index: Any) -> Any:
        """The taskset's task ``index`` (its position in the taskset, as vf-eval numbers them)."""
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise VerifiersError(f"data_dict['task'] must be a task index (an int >= 0), got {index!r}")
        with self._lock:
            while len(self._tasks) <= index:
                nxt = next(self._iter, None)
                if nxt is None:
                    raise VerifiersError(f'taskset {self.config.taskset!r} has {len(self._tasks)} task(s); '
                                         f"data_dict['task'] is {index}")
                self._tasks.append(nxt)
            return self._tasks[index]

    def close(self) -> None:
        self.io.close()


class _Episode:
    """One task's ``Env.run`` on the pool's loop, the request playing every seat. ``events``
    carries ``('turn', text)``, ``('done', None)`` or ``('error', exc)`` to the session; ``reply``
    is the future the current turn waits on (the model's text, or ``None``: the request is over)."""

    def __init__(self, pool: VerifiersPool, task: Any) -> None:
        from verifiers.v1.state import state_cls
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask
        from verifiers.v1.configs.agent import AgentConfig

        self.pool, self.task = pool, task
        specs = getattr(pool.env, '_agent_specs', {}) or {}
        self.trace = Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                           state=state_cls(type(task))(), agent=AgentInfo(config=next(iter(specs.values()), None)
                                                                          or AgentConfig()))
        self.events: 'asyncio.Queue[tuple]' = asyncio.Queue()
        self.reply: Optional['asyncio.Future[Optional[str]]'] = None
        self.history: List[Any] = []
        self.started = False
        self.over = False
        self.runner: Optional['asyncio.Task[None]'] = None

    async def main(self) -> None:
        try:
            await self.pool.env.run(self.task, _Agents(self))
            await self.task.score(self.trace)
        except BaseException as exc:  # the session names it; nothing is lost with the episode
            await self.events.put(('error', exc))
            if not isinstance(exc, Exception):
                raise
            return
        await self.events.put(('done', None))

    async def turn(self, message: Any) -> Any:
        """What ``Interaction.turn`` does, with the request as the agent."""
        from verifiers.v1.agent import Segment
        from verifiers.v1.graph import prepare_turn
        from verifiers.v1.dialects import parse_message
        from verifiers.v1.types import AssistantMessage, Response, SystemMessage, UserMessage

        data = self.task.data
        if self.over:
            raise RuntimeError('the exchange is over (the run ended); read interaction.trace')
        prompted = not self.started and data.prompt is not None
        if message is None and not prompted:
            raise ValueError("nothing to run a turn on: a bare turn() takes a prompted task's opening reply")
        if message is not None and prompted:
            raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
        if not self.started:
            self.started = True
            if data.system_prompt:
                self.history.append(SystemMessage(content=data.system_prompt))
            if prompted:
                message = data.prompt
        new = [UserMessage(content=message)] if isinstance(message, str) else [
            parse_message(m) if isinstance(m, dict) else m for m in message or []]
        self.history.extend(new)
        loop = asyncio.get_running_loop()
        self.reply = loop.create_future()
        await self.events.put(('turn', new))
        text = await self.reply
        if text is None:
            self.over = True
            return Segment(messages=[], terminated=True)
        reply = AssistantMessage(content=text)
        prepare_turn(self.trace, list(self.history), []).commit(Response(
            id=f'mtflow-{next(self.pool.ids)}', created=int(time.time()), model='mtflow', message=reply,
            finish_reason='stop'))
        self.history.append(reply)
        return Segment(messages=[reply])


class _Interaction:
    def __init__(self, episode: _Episode) -> None:
        self.episode = episode

    @property
    def trace(self) -> Any:
        return self.episode.trace

    async def turn(self, message: Any = None) -> Any:
        return await self.episode.turn(message)


class _Seat:
    """One seat of the env (``agents.player``), played by the request."""

    def __init__(self, episode: _Episode) -> None:
        self.episode = episode

    def interaction(self, task: Any) -> Any:
        episode = self.episode

        class _Open:
            async def __aenter__(self) -> _Interaction:
                return _Interaction(episode)

            async def __aexit__(self, *exc: Any) -> None:
                return None
        return _Open()

    async def run(self, task: Any) -> Any:
        """A plain taskset's seat: the model's reply to the task's prompt."""
        await self.episode.turn(None)
        return self.episode.trace


class _Agents:
    def __init__(self, episode: _Episode) -> None:
        self._episode = episode

    def __getattr__(self, name: str) -> _Seat:
        if name.startswith('__'):
            raise AttributeError(name)
        return _Seat(self._episode)


def _text(messages: List[Any]) -> str:
    parts = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = ''.join(getattr(p, 'text', '') or '' for p in content)
        parts.append(content or '')
    return '\n'.join(parts)


class VerifiersSession:
    """One request's episode; the scheduler's environment protocol (all async)."""

    def __init__(self, pool: VerifiersPool) -> None:
        self.pool = pool
        self.episode: Optional[_Episode] = None
        self.steps = 0

    @property
    def name(self) -> str:
        return self.pool.config.taskset

    async def reset(self, infer_request: Any) -> Optional[str]:
        task = self.pool.task((getattr(infer_request, 'data_dict', None) or {}).get('task'))
        event = await self.pool.io.run(self._start(task))
        if event[0] != 'turn':
            self._fail(event, 'before its first message')
        infer_request.messages[:] = [{'role': m.role, 'content': _text([m])} for m in self.episode.history]
        return None

    async def step(self, action: str) -> StepOutcome:
        self.steps += 1
        event = await self.pool.io.run(self._answer(action))
        if event[0] == 'turn':
            return StepOutcome(_text(event[1]), 0.0, False, False, {})
        if event[0] != 'done':
            self._fail(event, f'at step {self.steps}')
        trace = self.episode.trace
        rewards = {k: r.value for k, r in trace.rewards.items() if r is not None}
        info: Dict[str, Any] = {'verifiers_rewards': rewards, 'verifiers_metrics': dict(trace.metrics)}
        if trace.stop_condition:
            info['stop_condition'] = trace.stop_condition
        return StepOutcome('', float(trace.reward), True, False, info)

    async def close(self) -> None:
        episode, self.episode = self.episode, None
        if episode is not None:
            await self.pool.io.run(self._end(episode))

    def _fail(self, event: tuple, where: str) -> None:
        exc = event[1] if event[0] == 'error' else VerifiersError(f'the episode ended {where}')
        raise EnvFailure(KIND, self.name, where, exc) from None

    # ---- on the pool's loop ---------------------------------------------------------------------
    async def _start(self, task: Any) -> tuple:
        self.episode = _Episode(self.pool, task)
        self.episode.runner = asyncio.ensure_future(self.episode.main())
        return await self._next()

    async def _answer(self, text: str) -> tuple:
        reply = self.episode.reply
        if reply is None or reply.done():
            return ('error', VerifiersError('the environment is not waiting for a reply'))
        reply.set_result(text)
        return await self._next()

    async def _next(self) -> tuple:
        try:
            return await asyncio.wait_for(self.episode.events.get(), self.pool.config.turn_timeout_s)
        except asyncio.TimeoutError:
            return ('error', VerifiersError(f'the environment sent nothing for {self.pool.config.turn_timeout_s:g} s '
                                            '(turn_timeout_s)'))

    async def _end(self, episode: _Episode) -> None:
        """The request is over: a turn still waiting gets ``terminated`` (the env's run ends as it
        does when a harness stops), bounded; then the run is cancelled."""
        if episode.reply is not None and not episode.reply.done():
            episode.reply.set_result(None)
        runner = episode.runner
        if runner is not None and not runner.done():
            try:
                await asyncio.wait_for(asyncio.shield(runner), 10.0)
            except (asyncio.TimeoutError, Exception):
                runner.cancel()
