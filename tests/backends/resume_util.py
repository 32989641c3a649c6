"""What the resume tests of every backend share: a stream whose policy version moves on while it
runs (a trainer thread), and one call cut in the middle."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Callable, Dict, List, Tuple

import pytest

from mtflow.engine.resume import GenerationAborted


def stream_with_updates(executor: Any, groups: List[List[Any]], updates: int, wait: Callable[[threading.Event], bool],
                        max_concurrency: int) -> Tuple[Dict[str, Any], Any]:
    """Stream ``groups`` with ``on_update='resume'`` while a trainer thread sets policy versions
    1..``updates``, each after ``wait(stop)`` returns true (false: the stream ended first).
    Returns every request's output by uuid and the finished stream (its ``stats``)."""
    stop = threading.Event()

    def trainer() -> None:
        for version in range(1, updates + 1):
            if not wait(stop):
                return
            executor.set_policy_version(version)

    thread = threading.Thread(target=trainer, daemon=True)
    stream = executor.stream(iter(groups), max_concurrency=max_concurrency, on_update='resume')
    thread.start()
    try:
        got = list(stream)
    finally:
        stop.set()
        thread.join()
    return {u: o for g in got for u, o in zip(g.uuids, g.outputs)}, stream


def every(seconds: float) -> Callable[[threading.Event], bool]:
    """A ``wait`` for :func:`stream_with_updates`: an update every ``seconds``."""
    return lambda stop: not stop.wait(seconds)


def after_steps(count: Callable[[], int], step: int) -> Callable[[threading.Event], bool]:
    """A ``wait`` for :func:`stream_with_updates`: an update each time ``count()`` (what the
    engine has done: tokens yielded, chunk calls) has gone up by ``step``."""

    def wait(stop: threading.Event) -> bool:
        mark = count() + step
        while count() < mark:
            if stop.wait(0.002):
                return False
        return True

    return wait


def check_resumed(ref: Dict[str, Any], mine: Dict[str, Any], turns: int, logprob_abs: float = 0.0) -> int:
    """Assert that every resumed rollout in ``mine`` equals the uninterrupted one in ``ref`` (ids,
    messages, logprobs within ``logprob_abs``; 0: equal) and that its versions are sound: one per
    turn (``turns``), never going back, each turn's segments covering its sampled tokens in
    order, and each turn stamped with the version of its first token (a cut before any token left
    an empty segment that sampled nothing: ``engine/stream_resume.py``). Returns how many turns
    two versions sampled (a test wants some)."""
    assert set(mine) == set(ref)
    cut_turns = 0
    for uuid, out in ref.items():
        got = mine[uuid]
        assert got.response_token_ids == out.response_token_ids, uuid  # continued, not regenerated
        assert got.messages == out.messages, uuid
        assert len(got.rollout_logprobs) == len(out.rollout_logprobs), uuid
        for a, b in zip(got.rollout_logprobs, out.rollout_logprobs):
            assert (a == b) if logprob_abs == 0 else (a == pytest.approx(b, abs=logprob_abs)), uuid
        versions = got.rollout_infos['policy_versions']
        assert versions == sorted(versions) and len(versions) == turns, (uuid, versions)
        for entry in got.rollout_infos.get('policy_version_segments', []):
            t, spans = entry['turn'], entry['segments']
            assert spans[0][0] == 0 and spans[-1][1] == len(out.rollout_logprobs[t - 1]), (uuid, t, spans)
            assert all(a[1] == b[0] and a[2] <= b[2] for a, b in zip(spans, spans[1:])), (uuid, t, spans)
            assert versions[t - 1] == spans[0][2], 'a turn is stamped with the version of its first token'
            cut_turns += len({v for _, _, v in spans}) > 1
    return cut_turns


def cut_midway(call: Callable[[], Awaitable[Any]], started: Callable[[], bool]) -> Any:
    """Start ``call()``, cancel it once ``started()`` says it is in the middle, and return the
    partial output its ``GenerationAborted`` carries."""

    async def cut() -> Any:
        task = asyncio.ensure_future(call())
        while not started():
            await asyncio.sleep(0.002)
        task.cancel()
        with pytest.raises(GenerationAborted) as info:
            await task
        return info.value.output[0]

    return asyncio.run(cut())
