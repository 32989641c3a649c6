"""OpenEnv environments against real OpenEnv servers: ``tests/envs/openenv_app.py`` served by
openenv's own server code (``create_app``, uvicorn) on 127.0.0.1, launched by the scheduler
(``launch:``) or by the test (``url:``).

The scripted model guesses from the uuid (``g<target>-...`` guesses the target, ``w-...`` always
guesses wrong), so each request's path and reward are known in advance."""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip('openenv.core', reason="needs the 'openenv' extra (openenv 0.10)")

from mtflow import Executor
from mtflow.declarative import load_scheduler
from mtflow.declarative.envs.openenv_env import OpenEnvCapacityError, OpenEnvSessionError
from tests.helpers import out, req

ROOT = Path(__file__).resolve().parents[2]
APP = 'tests.envs.openenv_app:app'


def target_of(seed: int) -> int:
    return seed % 9 + 1


def config(**openenv):
    openenv.setdefault('launch', APP)
    return {'name': 'openenv_guess', 'max_turns': 6, 'env': {'openenv': openenv}}


def stats(url: str) -> dict:
    with urllib.request.urlopen(f'{url}/stats', timeout=10) as resp:
        return json.loads(resp.read())


def settled(url: str, deadline_s: float = 60.0) -> dict:
    """The server's stats once it has no session open: a client's close returns before the
    server has destroyed the session (and called the environment's close), so wait for it."""
    deadline = time.monotonic() + deadline_s
    while True:
        s = stats(url)
        if s['open'] == 0 or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


class Guesser:
    """Answers ``guess <digit>``: the right digit at turn ``k`` for ``g<k>-`` requests (data_dict
    ``seed`` fixes the target), wrong digits otherwise; calls ``on_turn(turn)`` before answering."""

    def __init__(self, on_turn=None):
        self.turn = 0
        self.on_turn = on_turn
        self.calls = []

    def __call__(self, requests, request_config):
        self.turn += 1
        self.calls.append([r.uuid for r in requests])
        if self.on_turn is not None:
            self.on_turn(self.turn)
        outs = []
        for r in requests:
            target = target_of(r.data_dict['seed'])
            m = re.match(r'g(\d)-', r.uuid)
            right_at = int(m.group(1)) if m else None
            guess = target if right_at == self.turn else (target % 9) + 1
            outs.append(out(f'guess {guess}'))
        return outs


def requests(names):
    return [req(name, {'role': 'system', 'content': 'Play.'}, data_dict={'seed': 10 + i}) for i, name in enumerate(names)]


@pytest.fixture
def launched():
    """A scheduler whose OpenEnv servers it launches itself; always closed (servers stopped)."""
    made = []

    def make(**openenv):
        scheduler = load_scheduler(config(**openenv), base_dir=str(ROOT))
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in made:
        scheduler.close()
        for server in scheduler.env_factory.servers:
            assert server.process.poll() is not None, 'a launched server outlived scheduler.close()'


def test_concurrent_sessions_rewards_and_every_session_closed(launched):
    scheduler = launched(replicas=2, max_sessions=4)
    names = ['g1-a', 'g2-b', 'g3-c', 'w-d', 'g1-e', 'w-f']
    reqs = requests(names)
    result = Executor(scheduler, Guesser(), max_turns=6, on_error='return').run(reqs)
    assert result.failures == []
    by = dict(zip(names, zip(result.finish_reasons, [o.rollout_infos for o in result.outputs])))
    for name in ('g1-a', 'g1-e'):
        assert by[name][0] == 'stop_rule:env_done' and by[name][1]['reward'] == 1.0 and by[name][1]['env_steps'] == 1
    assert by['g3-c'][1]['rewards'] == [0.0, 0.0, 1.0]
    for name in ('w-d', 'w-f'):  # the server ends the episode after 4 wrong tries, reward 0
        assert by[name][0] == 'stop_rule:env_done' and by[name][1]['rewards'] == [0.0] * 4
    # the observation is the server's prompt; the opening one became the first user message
    assert reqs[0].messages[1] == {'role': 'user', 'content': 'Guess my digit (1-9).'}
    # both replicas served sessions, each within its cap, and every session was closed
    servers = scheduler.env_factory.servers
    seen = [settled(s.url) for s in servers]
    assert all(s['resets'] > 0 for s in seen) and sum(s['resets'] for s in seen) == 6
    assert all(s['open'] == 0 and s['closes'] == s['resets'] for s in seen)
    episodes = sorted(e for s in seen for e in s['episodes'])
    assert episodes == sorted(names)  # episode_id is the request uuid
    assert all(s.open == 0 for s in servers)


def test_server_killed_mid_run_fails_its_requests_only(launched):
    scheduler = launched(replicas=2, retries=1, retry_backoff_s=0.05, message_timeout_s=10)
    names = [f'w-{i}' for i in range(6)]
    pool = scheduler.env_factory
    victim = {}

    def kill_at_turn_2(turn):
        if turn == 2:
            victim['server'] = server = pool.servers[1]
            victim['stats'] = stats(server.url)
            server.process.kill()
            server.process.wait(timeout=10)

    t0 = time.monotonic()
    result = Executor(scheduler, Guesser(kill_at_turn_2), max_turns=6, on_error='return').run(requests(names))
    assert time.monotonic() - t0 < 600  # a hang guard, not a speed check: every wait is bounded
    failed = {f.uuid: f for f in result.failures}
    assert len(victim['stats']['episodes']) == len(failed) > 0  # exactly the killed server's sessions failed
    assert set(failed) == set(victim['stats']['episodes'])
    for f in failed.values():
        assert f.turn == 2 and f.phase == 'on_turn_end' and isinstance(f.error, OpenEnvSessionError)
        assert victim['server'].url in str(f.error) and 'during step 2' in str(f.error)
        assert 'not retried' in str(f.error)
    for name, reason, output in zip(names, result.finish_reasons, result.outputs):
        if name in failed:
            assert reason == 'error'
        else:
            assert reason == 'stop_rule:env_done' and output.rollout_infos['rewards'] == [0.0] * 4
    survivor = settled(pool.servers[0].url)
    assert survivor['open'] == 0 and survivor['closes'] == survivor['resets'] == len(names) - len(failed)
    assert all(s.open == 0 for s in pool.servers) and not list(pool.sessions)


def test_new_sessions_avoid_a_dead_server(launched):
    scheduler = launched(replicas=2, retries=2, retry_backoff_s=0.05)
    pool = scheduler.env_factory
    pool.start()
    pool.servers[0].process.kill()
    pool.servers[0].process.wait(timeout=10)
    result = Executor(scheduler, Guesser(), max_turns=6, on_error='return').run(requests(['g1-a', 'g2-b', 'g1-c']))
    assert result.failures == [] and result.finish_reasons == ['stop_rule:env_done'] * 3
    assert stats(pool.servers[1].url)['resets'] == 3


def test_client_side_capacity_waits_then_fails_clearly(launched):
    scheduler = launched(max_sessions=2, capacity_wait_s=0.5)
    result = Executor(scheduler, Guesser(), max_turns=6, on_error='return').run(requests(['g1-a', 'g1-b', 'g1-c']))
    failed = result.failures
    assert len(failed) == 1 and isinstance(failed[0].error, OpenEnvCapacityError)
    assert 'max_sessions' in str(failed[0].error) and 'batch_size' in str(failed[0].error)
    assert sorted(result.finish_reasons) == ['error', 'stop_rule:env_done', 'stop_rule:env_done']
    assert settled(scheduler.env_factory.servers[0].url)['open'] == 0


@pytest.fixture
def server(tmp_path):
    """A server the test starts (capacity 2), given to the scheduler as ``url``."""
    import socket
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    log = open(tmp_path / 'server.log', 'w')
    proc = subprocess.Popen([sys.executable, '-m', 'uvicorn', APP, '--host', '127.0.0.1', '--port', str(port),
                             '--log-level', 'warning'], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**__import__('os').environ, 'OPENENV_TEST_MAX_SESSIONS': '2',
                                 'PYTHONPATH': str(ROOT)})
    url = f'http://127.0.0.1:{port}'
    deadline = time.monotonic() + 90
    while True:
        try:
            stats(url)
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / 'server.log').read_text()
            time.sleep(0.2)
    yield url
    proc.kill()
    proc.wait(timeout=10)
    log.close()


def test_server_capacity_reached_is_waited_for_then_served(server):
    """Another client holds both of the server's sessions and frees them after a while: the
    requests wait (CAPACITY_REACHED answers are retried within capacity_wait_s), then run."""
    from openenv.core import GenericEnvClient

    holders = []
    done = threading.Event()

    def hold():
        async def main():
            clients = [GenericEnvClient(base_url=server) for _ in range(2)]
            for c in clients:
                await c.connect()
                await c.reset(seed=1)
            holders.extend(clients)
            done.set()
            await asyncio.sleep(1.5)
            for c in clients:
                await c.close()
        asyncio.run(main())

    t = threading.Thread(target=hold)
    t.start()
    assert done.wait(60)
    scheduler = load_scheduler(config(launch=None, url=server, capacity_wait_s=60))
    try:
        result = Executor(scheduler, Guesser(), max_turns=6, on_error='return').run(requests(['g1-a', 'g2-b']))
    finally:
        scheduler.close()
        t.join(30)
    assert result.failures == [] and result.finish_reasons == ['stop_rule:env_done'] * 2
    s = settled(server)
    assert s['resets'] == 4 and s['open'] == 0


def test_server_capacity_past_the_wait_is_a_clear_error(server):
    scheduler = load_scheduler(config(launch=None, url=server, capacity_wait_s=0.3))
    try:
        result = Executor(scheduler, Guesser(), max_turns=6, on_error='return').run(requests(['w-a', 'w-b', 'w-c']))
    finally:
        scheduler.close()
    assert len(result.failures) == 1
    err = result.failures[0].error
    assert isinstance(err, OpenEnvCapacityError)
    assert 'the server answered: ' + server in str(err) and '2/2 sessions' in str(err)
    assert 'capacity_wait_s' in str(err) and 'CAPACITY_REACHED' in str(err)
    assert settled(server)['open'] == 0


def test_unreachable_url_fails_each_request_after_bounded_retries():
    import socket
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]  # nothing listens here
    scheduler = load_scheduler(config(launch=None, url=f'http://127.0.0.1:{port}', retries=2, retry_backoff_s=0.01,
                                      connect_timeout_s=2))
    try:
        result = Executor(scheduler, Guesser(), max_turns=6, on_error='return').run(requests(['w-a', 'w-b']))
    finally:
        scheduler.close()
    assert result.finish_reasons == ['error', 'error']
    for f in result.failures:
        assert isinstance(f.error, OpenEnvSessionError) and f.turn == 1
        assert 'could not open an OpenEnv session (3 attempt(s))' in str(f.error) and str(port) in str(f.error)


def test_rejected_action_is_fed_back_and_the_episode_goes_on(launched):
    scheduler = launched()

    def rollout(requests_, request_config):
        turn = sum(1 for m in requests_[0].messages if m['role'] == 'assistant') + 1
        target = target_of(requests_[0].data_dict['seed'])
        return [out('crash' if turn == 1 else f'guess {target}') for _ in requests_]

    reqs = requests(['x'])
    result = Executor(scheduler, rollout, max_turns=6, on_error='return').run(reqs)
    assert result.failures == [] and result.finish_reasons == ['stop_rule:env_done']
    assert 'Error: the environment crashed on purpose' in reqs[0].messages[3]['content']
    assert result.outputs[0].rollout_infos['rewards'] == [0.0, 1.0]


def test_launch_failure_is_one_clear_error_per_request(tmp_path):
    scheduler = load_scheduler(config(launch=[sys.executable, '-c', 'import sys; print("boom"); sys.exit(3)'],
                                      startup_timeout_s=30))
    try:
        result = Executor(scheduler, Guesser(), max_turns=6, on_error='return').run(requests(['a', 'b']))
    finally:
        scheduler.close()
    assert result.finish_reasons == ['error', 'error']
    assert all('exited with status 3' in str(f.error) and 'boom' in str(f.error) for f in result.failures)


def test_mtflow_run_launches_the_servers_and_stops_them(tmp_path, monkeypatch, capsys):
    """``mtflow run`` with a scheduler that launches its OpenEnv server: rewards reach the
    trajectories and the summary, and the server is stopped when the run ends."""
    from mtflow.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    (tmp_path / 'sched.yaml').write_text(f'name: digits\nmax_turns: 4\nenv:\n  openenv: {{launch: {APP}}}\n')
    lines = [{'uuid': f'p{i}', 'messages': [{'role': 'system', 'content': 'Play.'}], 'seed': 10 + i} for i in range(2)]
    (tmp_path / 'data.jsonl').write_text(''.join(json.dumps(l) + '\n' for l in lines))
    script = [{'uuid': 'p0', 'content': f'guess {target_of(10)}'}] + [{'uuid': 'p1', 'content': 'guess 0'}] * 4
    (tmp_path / 'script.jsonl').write_text(''.join(json.dumps(l) + '\n' for l in script))
    (tmp_path / 'run.yaml').write_text('scheduler: sched.yaml\nbackend: scripted\nmodel: script.jsonl\n'
                                       'dataset: data.jsonl\nout: out\nmax_turns: 4\n')
    assert main(['run', 'run.yaml', '--no-progress']) == 0
    trajs = [json.loads(l) for l in (tmp_path / 'out' / 'trajectories.jsonl').read_text().splitlines()]
    assert [t['rollout_infos']['reward'] for t in trajs] == [1.0, 0.0]
    assert [t['finish_reason'] for t in trajs] == ['stop_rule:env_done'] * 2
    url = trajs[0]['rollout_infos']['env_info']['openenv_server']
    with pytest.raises(OSError):  # the launched server is gone
        stats(url)


def test_ready_openenv_guess_scheduler_plays_against_its_launched_server():
    """schedulers/openenv_guess.yaml: a binary-searching player wins every game (reward 1.0)."""
    import schedulers
    sched = load_scheduler(schedulers.path('openenv_guess'))
    bounds = {}

    def rollout(requests_, request_config):
        outs = []
        for r in requests_:
            low, high = bounds.get(r.uuid, (1, 100))
            last = r.messages[-1]['content'] if r.messages[-1]['role'] == 'user' else ''
            if 'too low' in last:
                low = bounds[r.uuid + '/g'] + 1
            elif 'too high' in last:
                high = bounds[r.uuid + '/g'] - 1
            guess = (low + high) // 2
            bounds[r.uuid], bounds[r.uuid + '/g'] = (low, high), guess
            outs.append(out(f'{guess}'))
        return outs

    reqs = [req(f'game-{i}', {'role': 'user', 'content': 'Play.'}, data_dict={'reset_kwargs': {'target': t}})
            for i, t in enumerate([1, 50, 62])]
    try:
        result = Executor(sched, rollout, max_turns=7, on_error='return').run(reqs)
    finally:
        sched.close()
    assert result.failures == [] and result.finish_reasons == ['stop_rule:env_done'] * 3
    assert [o.rollout_infos['reward'] for o in result.outputs] == [1.0, 1.0, 1.0]
    assert reqs[1].messages[-1]['content'] == '50' and len(reqs[1].messages) == 3  # 50 found at once
    assert 'too low' in reqs[2].messages[3]['content']
    assert all(s.process.poll() is not None for s in sched.env_factory.servers)


def test_sessions_survive_a_long_generation(launched):
    """The executor's event loop is idle while the model generates; the connections must still
    answer the server's keepalive pings (here every 0.5 s, 0.5 s timeout), or the server drops
    them. The scripted model blocks for 3 s at turn 2, as a slow model would."""
    scheduler = launched(launch=['{python}', '-m', 'uvicorn', APP, '--host', '127.0.0.1', '--port', '{port}',
                                 '--ws-ping-interval', '0.5', '--ws-ping-timeout', '0.5', '--log-level', 'warning'])
    result = Executor(scheduler, Guesser(lambda turn: time.sleep(3) if turn == 2 else None), max_turns=6,
                      on_error='return').run(requests(['g3-a', 'g2-b']))
    assert result.failures == [], [str(f.error) for f in result.failures]
    assert result.finish_reasons == ['stop_rule:env_done'] * 2
    assert [o.rollout_infos['reward'] for o in result.outputs] == [1.0, 1.0]
