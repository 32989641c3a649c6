"""``mtflow run`` with an ``agent:`` section: an external agent command per prompt, each against its
own gateway session, scored by a verifier.

For every prompt of the dataset (times ``num_generations``) the runner opens a session named by
the request's uuid (with a key of its own), starts the agent command with ``OPENAI_BASE_URL`` /
``OPENAI_API_KEY`` and ``ANTHROPIC_BASE_URL`` / ``ANTHROPIC_API_KEY`` pointing at it (and
``MTFLOW_SESSION``), gives it the task (the last argument, its stdin, or the file named by
``MTFLOW_TASK_FILE``), and waits at most ``agent.timeout_s``: then its whole process tree is
killed (:func:`kill_tree`). Its stdout and stderr are kept in ``<out>/agents/<uuid>.out|.err``.
The verifier scores the episode (:class:`Episode`: the session's transcript as the model saw it,
the exit code, whether it was killed) and the runner finishes the session with that reward
(finish reason ``client_finished``, or ``agent_timeout`` for a killed agent). At most
``agent.concurrency`` episodes run at once; the model calls are the gateway's, so policy versions
and ``gateway.max_staleness`` apply to them as to any stream.

An episode that produced nothing (its command could not start, or the agent exited before its
first model call) has no trajectory to write: it *fails*, with its reason on the terminal (the
exit status, the last line of its stderr) and in ``summary.json`` (``failed_unwritten``, which the
exit-code rule counts: ``mtflow.run.summary.too_many_failed``). A command that is not on ``PATH``
is refused before the backend loads (:func:`check_command`).
"""
from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from mtflow.core.errors import UserError
from mtflow.core.machine import AGENT_TIMEOUT, CLIENT_FINISHED
from mtflow.core.registry import resolve_reference
from mtflow.data.sources import iter_requests
from mtflow.gateway.gateway import Gateway, close_failed
from mtflow.gateway.wire import WireError
from mtflow.run.agent_config import AgentConfig, GatewayConfig, VerifierCommand
from mtflow.run.assembly import build_backend, seed_everything

__all__ = ['Episode', 'AgentRunner', 'run_agents', 'kill_tree', 'process_tree', 'check_command', 'AGENTS_DIR']

#: the folder of the agents' stdout and stderr in the run directory
AGENTS_DIR = 'agents'


@dataclass
class Episode:
    """What a verifier gets: the task, the dataset row's ``data``, the session's ``messages`` as
    the model saw them (after its last turn), the agent's ``exit_code`` (``None`` when killed),
    ``timed_out``, the paths of its ``stdout`` and ``stderr``, and its wall time."""
    uuid: str
    task: str
    data: Dict[str, Any]
    messages: List[Dict[str, Any]]
    exit_code: Optional[int]
    timed_out: bool
    stdout: str
    stderr: str
    wall_s: float
    turns: int = 0
    info: Dict[str, Any] = field(default_factory=dict)


# ---- the process tree ---------------------------------------------------------------------------
def process_tree(pid: int) -> List[int]:
    """Every descendant of ``pid`` now (Linux ``/proc``; ``[]`` elsewhere), children first."""
    children: Dict[int, List[int]] = defaultdict(list)
    try:
        entries = os.listdir('/proc')
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f'/proc/{entry}/stat', encoding='ascii', errors='replace') as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(')', 1)[-1].split()
        if len(fields) > 1 and fields[1].isdigit():
            children[int(fields[1])].append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def _signal(pid: int, sig: int, group: bool = False) -> None:
    try:
        os.killpg(pid, sig) if group else os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(pid: int) -> List[int]:
    """SIGKILL process ``pid``, its process group and every descendant (one that left the group
    with ``setsid`` too): the tree is stopped first, so that nothing forks while it is collected.
    A process that daemonized itself (its parent exited before) is out of reach: run agents in a
    sandbox or a cgroup for that. Returns the descendants found."""
    _signal(pid, signal.SIGSTOP, group=True)
    tree = process_tree(pid)
    for child in tree:
        _signal(child, signal.SIGSTOP)
    tree = list(dict.fromkeys(tree + process_tree(pid)))  # what forked before it was stopped
    _signal(pid, signal.SIGKILL, group=True)
    _signal(pid, signal.SIGKILL)
    for child in tree:
        _signal(child, signal.SIGKILL)
    return tree


# ---- the verifier -------------------------------------------------------------------------------
def _reward_of(value: Any, where: str) -> Tuple[Optional[float], Dict[str, Any]]:
    """``(reward, info)`` of a verifier's answer: a number, ``{"reward": R, "info": {...}}`` or
    ``(R, info)``."""
    if isinstance(value, tuple) and len(value) == 2:
        value = {'reward': value[0], 'info': value[1]}
    if isinstance(value, dict):
        reward, info = value.get('reward'), value.get('info') or {}
    else:
        reward, info = value, {}
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        raise ValueError(f'{where} returned {reward!r:.60} as the reward: a number (or null) is needed')
    if not isinstance(info, dict):
        raise ValueError(f'{where} returned info of type {type(info).__name__}: an object is needed')
    return (None if reward is None else float(reward)), info


class Verifier:
    """``agent.verifier``: a ``module:attr`` callable over the :class:`Episode` (sync or async),
    or a command that reads ``MTFLOW_TRANSCRIPT`` and prints the reward."""

    def __init__(self, spec: Any, base_dir: Optional[Path], where: str, timeout_s: float) -> None:
        self.where, self.timeout_s = where, timeout_s
        self.command: Optional[List[str]] = None
        self.fn: Optional[Callable[[Episode], Any]] = None
        if isinstance(spec, VerifierCommand):
            self.command = shlex.split(spec.command) if isinstance(spec.command, str) else list(spec.command)
            return
        try:
            self.fn = resolve_reference(spec, str(base_dir) if base_dir else None)
        except (ImportError, AttributeError) as exc:
            raise UserError(f'{where}: {exc}') from None
        if not callable(self.fn):
            raise UserError(f'{where}: {spec} is a {type(self.fn).__name__}, not a function of the episode')

    async def score(self, episode: Episode, cwd: Optional[str]) -> Tuple[Optional[float], Dict[str, Any]]:
        if self.fn is not None:
            fn = self.fn
            call = fn(episode) if inspect.iscoroutinefunction(fn) else asyncio.to_thread(fn, episode)
            value = await asyncio.wait_for(call, self.timeout_s)
            if inspect.isawaitable(value):
                value = await asyncio.wait_for(value, self.timeout_s)
            return _reward_of(value, self.where)
        with tempfile.NamedTemporaryFile('w', suffix='.json', delete=False, encoding='utf-8') as f:
            json.dump(asdict(episode), f, ensure_ascii=False)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command, cwd=cwd, env=dict(os.environ, MTFLOW_TRANSCRIPT=f.name), stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True)
            try:
                out, err = await asyncio.wait_for(proc.communicate(), self.timeout_s)
            except asyncio.TimeoutError:
                kill_tree(proc.pid)
                await proc.wait()
                raise
            if proc.returncode != 0:
                raise RuntimeError(f'exited with {proc.returncode}: {err.decode(errors="replace")[-300:]}')
            last = (out.decode(errors='replace').strip().splitlines() or [''])[-1]
            try:
                value = json.loads(last)
            except json.JSONDecodeError:
                raise ValueError(f'its last line of output is not a number or JSON: {last[:80]!r}') from None
            return _reward_of(value, self.where)
        finally:
            os.unlink(f.name)


# ---- the command ---------------------------------------------------------------------------------
def agent_command(agent: AgentConfig) -> List[str]:
    """The agent's argv: its ``command`` split as a shell would; a first word ``python`` is this
    interpreter (the venv's, whatever ``PATH`` holds)."""
    command = shlex.split(agent.command) if isinstance(agent.command, str) else list(agent.command)
    if command and command[0] in ('python', 'python3'):
        command[0] = sys.executable
    return command


def agent_cwd(agent: AgentConfig, base_dir: Optional[Path]) -> Optional[str]:
    """Where the agent runs: ``agent.cwd`` relative to the config's directory, else here."""
    return str((base_dir or Path.cwd()) / agent.cwd) if agent.cwd else None


def check_command(cfg: Any) -> None:
    """Refuse, before the backend loads, an agent command that cannot start: a program that is not
    on ``PATH`` (the agent's ``env`` PATH when it sets one), or a path that is not an executable
    file (relative to ``agent.cwd``)."""
    agent = cfg.agent
    program = agent_command(agent)[0]
    cwd = agent_cwd(agent, cfg.base_dir) or os.getcwd()
    path = agent.env.get('PATH', os.environ.get('PATH', os.defpath))
    if os.sep in program:
        target = program if os.path.isabs(program) else os.path.join(cwd, program)
        if not (os.path.isfile(target) and os.access(target, os.X_OK)):
            what = 'is not an executable file' if os.path.exists(target) else 'does not exist'
            raise UserError(f"{cfg.where('agent.command')}: {program!r} {what} (relative paths are from {cwd})")
    elif shutil.which(program, path=path) is None:
        raise UserError(f"{cfg.where('agent.command')}: {program!r} is not on PATH; install it, or give its full "
                        'path')


def _last_line(path: Path) -> str:
    """The last non-empty line of a log file (its tail only), for a one-line reason."""
    try:
        with open(path, 'rb') as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            tail = f.read().decode('utf-8', errors='replace')
    except OSError:
        return ''
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ''


def nothing_produced(exit_code: Optional[int], timed_out: bool, out_path: Path, err_path: Path) -> str:
    """Why an episode made no model call, in one line: how the agent ended, and the last line of its
    stderr (else of its stdout), named by its path in the run directory."""
    how = 'was killed at agent.timeout_s' if timed_out else f'exited with status {exit_code}'
    for path in (err_path, out_path):
        last = _last_line(path)
        if last.startswith('mtflow: cannot start the agent'):
            return last[len('mtflow: '):]
        if last:
            return f'the agent {how} before its first model call ({path.parent.name}/{path.name}: {last})'
    return f'the agent {how} before its first model call, printing nothing'


# ---- the episodes -------------------------------------------------------------------------------
def _safe(name: str) -> str:
    return re.sub(r'[^0-9A-Za-z_.#-]', '_', name)[:120]


class AgentRunner:
    """Runs ``agent`` once per request against ``gateway`` (see the module docstring)."""

    #: how many episodes that produced nothing are named on the terminal (the rest are counted)
    MAX_SAID = 5

    def __init__(self, agent: AgentConfig, gateway: Gateway, out_dir: Path, base_dir: Optional[Path],
                 where: Callable[[str], str], say: Optional[Callable[[str], None]] = None) -> None:
        self.agent, self.gateway = agent, gateway
        self.command = agent_command(agent)
        self.logs = Path(out_dir) / AGENTS_DIR
        self.cwd = agent_cwd(agent, base_dir)
        self.verifier = Verifier(agent.verifier, base_dir, where('agent'), agent.verifier_timeout_s)
        self.counts = {'episodes': 0, 'killed': 0, 'no_calls': 0, 'verifier_errors': 0, 'agent_failed': 0}
        self.episodes: List[Dict[str, Any]] = []
        #: the episodes that produced nothing (no model call: no trajectory), each with its reason
        self.failed: List[Dict[str, Any]] = []
        self.say = say
        self._procs: Dict[str, Any] = {}

    def task_of(self, request: Any) -> str:
        prompt = next((m.get('content') for m in reversed(request.messages) if m.get('role') == 'user'), '') or ''
        data = dict(getattr(request, 'data_dict', None) or {})
        try:
            return self.agent.task_template.format(**{**data, 'prompt': prompt, 'uuid': request.uuid})
        except (KeyError, IndexError, ValueError) as exc:
            raise UserError(f'agent.task_template: cannot fill it for request {request.uuid!r}: '
                            f'{type(exc).__name__}: {exc}') from None

    def run(self, requests: Iterable[Any], skip: Callable[[str], bool]) -> Dict[str, Any]:
        """Run every request not ``skip``ped, ``concurrency`` at a time; the counts. An interrupt
        kills every agent still running (their sessions are cut) and propagates."""
        self.logs.mkdir(parents=True, exist_ok=True)
        todo = (r for r in requests if not skip(str(r.uuid)))
        try:
            asyncio.run(self._all(todo))
        finally:
            for proc in list(self._procs.values()):
                kill_tree(proc.pid)
        return dict(self.counts)

    async def _all(self, todo: Iterator[Any]) -> None:
        async def worker() -> None:
            for request in todo:  # one shared iterator: each request to one worker
                await self.episode(request)

        await asyncio.gather(*(worker() for _ in range(self.agent.concurrency)))

    async def episode(self, request: Any) -> None:
        uuid = str(request.uuid)
        task = self.task_of(request)
        data = dict(getattr(request, 'data_dict', None) or {})
        session = self.gateway.open_session(uuid, key=True, data=data)
        out_path, err_path = self.logs / f'{_safe(uuid)}.out', self.logs / f'{_safe(uuid)}.err'
        t0 = time.perf_counter()
        exit_code, timed_out = await self._agent(uuid, task, session, out_path, err_path)
        wall = time.perf_counter() - t0
        self.counts['episodes'] += 1
        self.counts['killed'] += timed_out
        self.counts['agent_failed'] += bool(exit_code)
        live = self.gateway.table.get(uuid)
        episode = Episode(uuid, task, data, list(live.transcript) if live is not None else [], exit_code, timed_out,
                          str(out_path), str(err_path), round(wall, 3), live.turns if live is not None else 0)
        try:
            reward, info = await self.verifier.score(episode, self.cwd)
        except Exception as exc:  # a verifier that fails: the episode is kept, without a reward
            self.counts['verifier_errors'] += 1
            reward, info = None, {'verifier_error': f'{type(exc).__name__}: {exc}'[:500]}
        info = {**info, 'exit_code': exit_code, 'timed_out': timed_out, 'agent_wall_s': episode.wall_s,
                'stdout': str(out_path.relative_to(self.logs.parent)), 'stderr': str(err_path.relative_to(self.logs.parent))}
        reason = AGENT_TIMEOUT if timed_out else CLIENT_FINISHED
        try:
            summary = await asyncio.to_thread(self.gateway.finish, uuid, reward, info, reason=reason,
                                              key=session['api_key'])
        except WireError as exc:  # no model call was made (nothing to record), or the session ended
            summary = {'session': uuid, 'error': exc.message}
            if exc.code == 'no_calls':
                self.counts['no_calls'] += 1
                self._produced_nothing(uuid, nothing_produced(exit_code, timed_out, out_path, err_path))
        self.episodes.append({'uuid': uuid, 'reward': reward, 'exit_code': exit_code, 'timed_out': timed_out,
                              **{k: v for k, v in summary.items() if k != 'session'}})

    def _produced_nothing(self, uuid: str, reason: str) -> None:
        """An episode with no trajectory: it failed; said at once (the first :attr:`MAX_SAID`)."""
        self.failed.append({'uuid': uuid, 'phase': 'agent', 'message': reason})
        if self.say is not None and len(self.failed) <= self.MAX_SAID:
            self.say(f'episode {uuid} failed: {reason}')

    async def _agent(self, uuid: str, task: str, session: Dict[str, Any], out_path: Path,
                     err_path: Path) -> Tuple[Optional[int], bool]:
        """Start the agent, wait for it at most ``timeout_s`` (then kill its tree): ``(exit code, killed)``."""
        key = session['api_key']
        env = dict(os.environ, **self.agent.env, OPENAI_BASE_URL=session['base_url'], OPENAI_API_KEY=key,
                   ANTHROPIC_BASE_URL=session['anthropic_base_url'], ANTHROPIC_API_KEY=key, MTFLOW_SESSION=uuid,
                   TOKENIZERS_PARALLELISM='false')
        command = list(self.command)
        task_file = None
        if self.agent.task == 'argument':
            command.append(task)
        elif self.agent.task == 'file':
            task_file = self.logs / f'{_safe(uuid)}.task'
            task_file.write_text(task, encoding='utf-8')
            env['MTFLOW_TASK_FILE'] = str(task_file)
        with open(out_path, 'wb') as out, open(err_path, 'wb') as err:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *command, cwd=self.cwd, env=env, stdout=out, stderr=err, start_new_session=True,
                    stdin=asyncio.subprocess.PIPE if self.agent.task == 'stdin' else asyncio.subprocess.DEVNULL)
            except OSError as exc:
                err.write(f'mtflow: cannot start the agent {command[0]!r}: {exc}\n'.encode())
                return 127, False
            self._procs[uuid] = proc
            try:
                if self.agent.task == 'stdin':
                    try:
                        proc.stdin.write(task.encode())
                        await proc.stdin.drain()
                        proc.stdin.close()
                    except (BrokenPipeError, ConnectionResetError):  # it does not read its stdin
                        pass
                try:
                    code = await asyncio.wait_for(proc.wait(), self.agent.timeout_s)
                except asyncio.TimeoutError:
                    kill_tree(proc.pid)
                    await proc.wait()
                    return None, True
                _signal(proc.pid, signal.SIGKILL, group=True)  # what it left running in its group dies with it
                return code, False
            finally:
                self._procs.pop(uuid, None)


def run_agents(cfg: Any, store: Any, total: int,
               say: Optional[Callable[[str], None]] = None) -> Tuple[str, Optional[Dict[str, Any]]]:
    """``mtflow run`` of a config with ``agent:``: the backend, a gateway on ``store`` (sessions only
    the runner opens, unless ``gateway.open_on_call`` says otherwise), one episode per request the
    store does not have. ``(status, summary)``: ``complete``, or ``interrupted`` on a signal (the
    agents running are killed; their sessions are cut and run again on ``--resume``). ``say``
    gets one line per episode that produced nothing (the summary's ``failed_unwritten``)."""
    seed_everything(cfg.seed)
    settings = cfg.gateway or GatewayConfig(open_on_call=False)
    gateway = None
    try:
        backend = build_backend(cfg)
        gateway = Gateway.from_config(cfg, backend, store, settings=settings, refuse_cut=False).start()
        runner = AgentRunner(cfg.agent, gateway, store.out_dir, cfg.base_dir, cfg.where, say)
        prompts = iter_requests(cfg.dataset, cfg.dataset_path(), cfg.limit, cfg.num_generations, check_unique=False)
        status = 'complete'
        try:
            runner.run(prompts, store.is_done)
        except KeyboardInterrupt:
            status = 'interrupted'
    except BaseException:
        close_failed(gateway, store)
        raise
    failed = runner.failed
    if say is not None and len(failed) > AgentRunner.MAX_SAID:
        say(f'{len(failed) - AgentRunner.MAX_SAID} more episodes produced nothing (failed_unwritten in summary.json)')
    figures = gateway.close(status, total=total, extra={'agent': {**runner.counts, 'command': runner.command},
                                                        'failed_unwritten': {'count': len(failed),
                                                                             'listed': failed[:20]}})
    return status, figures.get('summary')
