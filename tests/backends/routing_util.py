"""What the routing and server-metrics tests share: the tiny model behind real test chat servers
on 127.0.0.1 (``chat_server.py``, with its simulated prefix cache), a multi-turn workload over
them, and ``mtflow run`` of that workload over the servers."""
import json
import random
import threading

import pytest

from mtflow import Executor, RequestConfig, RolloutInferRequest, Scheduler
from mtflow.accounting.token_record import RecordAccounting
from mtflow.backends.hf import HFBackend
from mtflow.backends.openai_server import OpenAIBackend
from tests.backends.chat_server import ChatServer
from tests.tiny_model import make_model, make_tokenizer

CONFIG = RequestConfig(temperature=0, max_tokens=4)
WORDS = 'the quick brown fox jumps over lazy dog number guess higher lower answer please check again'.split()


@pytest.fixture(scope='module')
def tok():
    return make_tokenizer()


@pytest.fixture(scope='module')
def hf(tok):
    return HFBackend(make_model(tok, seed=3), tok)


class GoOn(Scheduler):
    """Every turn answered with a short user message; max_turns ends each request."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return False

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'go on'})
        return {'infer_request': infer_request}


class GoOnTogether(GoOn):
    """:class:`GoOn` whose first step in each process waits (up to a minute) until ``ACTORS``
    processes have taken a request, each leaving a file in ``MTFLOW_TEST_ACTORS_DIR``: under
    ``--ray N`` every actor then serves some requests, however slowly one of them starts (without
    it, one actor ready early could take every shard while the other was still loading)."""
    ACTORS = 2
    joined = False

    def step(self, infer_request, response_choice, current_turn):
        if not GoOnTogether.joined:
            import os
            import time
            from pathlib import Path

            folder = Path(os.environ['MTFLOW_TEST_ACTORS_DIR'])
            (folder / str(os.getpid())).touch()
            GoOnTogether.joined = True
            deadline = time.monotonic() + 60
            while len(list(folder.iterdir())) < self.ACTORS and time.monotonic() < deadline:
                time.sleep(0.05)
        return super().step(infer_request, response_choice, current_turn)


def task(i):
    """A long first message of its own per request (no prefix shared across requests but the
    template's), as a multi-turn task description is."""
    rng = random.Random(i)
    return RolloutInferRequest(uuid=f'r{i}', messages=[{'role': 'user', 'content': f'task {i}: ' + ' '.join(
        rng.choice(WORDS) for _ in range(240))}])


def make_servers(hf, n, **kw):
    lock = threading.Lock()  # one model, one generate at a time across the replicas
    return [ChatServer(hf, prefix_cache=True, lock=lock, **kw) for _ in range(n)]


def rollout(servers, tok, routing, n_requests=7, max_turns=5, begin_metrics=False, **kw):
    """``GoOn`` over ``servers`` behind one backend: ``(result, serving summary, serving logs by
    uuid, the uuids in the order on_finished saw them)``."""
    delivered = []
    with OpenAIBackend(urls=[s.base_url for s in servers], routing=routing, tokenizer=tok, backoff=0.01,
                       model='tiny-qwen2', **kw) as client:
        if begin_metrics:  # the servers' /metrics counters now, read again by serving_summary
            client.begin_server_metrics()
        result = Executor(GoOn(), client, CONFIG, max_turns=max_turns, accounting=RecordAccounting(),
                          on_finished=lambda f: delivered.append(f.uuid)).run([task(i) for i in range(n_requests)])
        summary = client.serving_summary()
        logs = {f'r{i}': client.serving(f'r{i}') for i in range(n_requests)}
    return result, summary, logs, delivered


def enter(servers):
    for s in servers:
        s.__enter__()


def leave(servers):
    for s in servers:
        s.__exit__(None, None, None)


def run_cli_over(servers, tmp_path, monkeypatch, ray=0):
    """``mtflow run`` of ``GoOn`` over ``servers`` (started here, stopped after) in ``tmp_path``:
    4 prompts, 3 turns (with ``ray``: ``--ray N``, shards of 1); returns the run's output directory."""
    from mtflow.cli import main

    monkeypatch.chdir(tmp_path)
    if ray:  # every actor serves (GoOnTogether); the actors inherit the environment
        (tmp_path / 'actors').mkdir()
        monkeypatch.setenv('MTFLOW_TEST_ACTORS_DIR', str(tmp_path / 'actors'))
    (tmp_path / 'prompts.jsonl').write_text(''.join(
        json.dumps({'uuid': f'p{i}', 'prompt': task(i).messages[0]['content']}) + '\n' for i in range(4)))
    enter(servers)
    try:
        urls = ', '.join(s.base_url for s in servers)
        (tmp_path / 'run.yaml').write_text(
            f'scheduler: {__name__}:{"GoOnTogether" if ray else "GoOn"}\n'
            f'backend: {{kind: openai, urls: [{urls}], health_interval_s: 0}}\n'
            f'model: tiny-qwen2\ndataset: prompts.jsonl\nout: out\nmax_turns: 3\nbatch_size: {1 if ray else 4}\n'
            'request_config: {max_tokens: 4, temperature: 0}\n')
        if ray:  # the chat-mode warning is the actors' own
            assert main(['run', 'run.yaml', '--no-progress', '--ray', str(ray)]) == 0
        else:
            with pytest.warns(UserWarning, match='not guaranteed the exact ids'):
                assert main(['run', 'run.yaml', '--no-progress']) == 0
    finally:
        leave(servers)
    return tmp_path / 'out'
