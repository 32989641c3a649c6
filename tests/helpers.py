"""Small builders for scripted rollouts: requests, outputs, and a ``rollout_fn`` that replays a
script (or computes outputs from the request), counting its calls."""
from __future__ import annotations

import contextlib
import copy
import http.server
import itertools
import json
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from mtflow.core.protocol import RolloutInferRequest, RolloutOutput, make_choice, make_response
from mtflow.core.scheduler import Scheduler


def req(uuid: str, *messages: Dict[str, Any], **kw: Any) -> RolloutInferRequest:
    msgs = list(messages) or [{'role': 'user', 'content': f'question {uuid}'}]
    return RolloutInferRequest(messages=[dict(m) for m in msgs], uuid=uuid, **kw)


def out(text: str,
        ids: Optional[Sequence[int]] = None,
        logprobs: Optional[Sequence[float]] = None,
        finish_reason: Optional[str] = 'stop',
        lp_shape: str = 'content') -> RolloutOutput:
    """One output. ``lp_shape='none'`` gives ``logprobs=None``, ``'nocontent'`` a dict without ``content``."""
    choice = make_choice(text, None if ids is None else list(ids), None if logprobs is None else list(logprobs),
                         finish_reason)
    if lp_shape == 'nocontent':
        choice.logprobs = {'other': []}
    elif lp_shape == 'none':
        choice.logprobs = None
    return RolloutOutput(response=make_response(choice))


class Scripted:
    """``rollout_fn`` that answers each request from ``script[uuid]`` (a list of outputs, one per
    call for that request) and records every call's uuids."""

    def __init__(self, script: Dict[str, List[RolloutOutput]]):
        self.script = {k: list(v) for k, v in script.items()}
        self.calls: List[List[str]] = []

    def __call__(self, requests: List[Any], request_config: Any) -> List[RolloutOutput]:
        self.calls.append([r.uuid for r in requests])
        return [self.script[r.uuid].pop(0) for r in requests]


class Counter:
    """``rollout_fn`` that builds each output with ``make(request, n)`` (n = this request's call count)."""

    def __init__(self, make: Callable[[Any, int], RolloutOutput]):
        self.make = make
        self.counts: Dict[str, int] = {}
        self.calls: List[List[str]] = []

    def __call__(self, requests: List[Any], request_config: Any) -> List[RolloutOutput]:
        self.calls.append([r.uuid for r in requests])
        result = []
        for r in requests:
            n = self.counts.get(r.uuid, 0) + 1
            self.counts[r.uuid] = n
            result.append(self.make(r, n))
        return result


def dump(outputs: List[Any]) -> List[Dict[str, Any]]:
    """Outputs as plain dicts (for field-by-field comparison)."""
    return [o.model_dump(mode='python', exclude={'response': {'id', 'created'}}) if o is not None else None
            for o in outputs]


def clone(objs: Any) -> Any:
    return copy.deepcopy(objs)


_ids = itertools.count(1000)


# ---- a finished `mtflow run` directory ------------------------------------------------------------
def jsonl_lines(path: Path) -> List[Any]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_contents(out: Path) -> tuple:
    """A run directory's trajectories by uuid (no uuid written twice), and each request's trace
    events without the times: what two runs that should agree are compared by."""
    trajectories = jsonl_lines(out / 'trajectories.jsonl')
    uuids = [t['uuid'] for t in trajectories]
    assert len(uuids) == len(set(uuids)), f'a uuid written twice: {uuids}'
    events: Dict[str, List[Dict[str, Any]]] = {}
    for e in jsonl_lines(out / 'trace.jsonl'):
        events.setdefault(e['uuid'], []).append({k: v for k, v in e.items() if k not in ('t', 'duration_s')})
    return {t['uuid']: t for t in trajectories}, events


class SaysLower(Scheduler):
    """Never finishes by itself: every turn the user answers 'lower' (``max_turns`` ends it), and
    the turn's sampled ids are its response ids, all in the loss (the resume tests' scheduler)."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return False

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'lower'})
        ids = response_choice.token_ids or []
        return {'infer_request': infer_request, 'response_token_ids': ids, 'response_loss_mask': [1] * len(ids)}


@contextlib.contextmanager
def http_server(handler: type) -> Iterator[str]:
    """A threaded ``http.server`` with ``handler`` on a free loopback port, for as long as the
    ``with`` lasts; yields its OpenAI-style base URL (``http://127.0.0.1:<port>/v1``)."""
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f'http://127.0.0.1:{server.server_address[1]}/v1'
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def stop_by_sigterm(proc: subprocess.Popen, hung: str) -> str:
    """Send ``proc`` one SIGTERM (a clean stop, not the second signal's exit at once) and wait for
    it; its stderr. A run that does not stop within a minute fails the test, saying what ``hung``."""
    import pytest

    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f'SIGTERM did not stop the run while {hung}')
