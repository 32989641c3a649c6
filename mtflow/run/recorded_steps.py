"""Tool and environment results served from a run's record (``mtflow replay --tools recorded``).

A replay with ``--tools recorded`` re-runs only the scheduler's own logic (parsing, stop rules,
tips, answer checks, rewards, the finish policy) over the recorded model outputs: every tool call
gets the result recorded for that request, turn and position (the trace event leaving
``tool_step``: ``extra.calls`` for name, ok, error kind, duration; ``extra.tool_io`` for the
arguments and the whole result text), and every environment is a :class:`RecordedEnv` that
answers each step with the recorded observation (the message after the turn's assistant
message), step reward (``rollout_infos.rewards``) and end (the line's finish reason). No tool and
no environment is called, so the replay is fast and free of side effects.

A call the record cannot answer (the scheduler now reads other calls from the same text, or the
record has no result for that turn) fails its request with an error naming the request, the
turn and the call; the scheduler's observations and rewards are otherwise the recorded ones.

Memory: the trajectory file is indexed (uuid -> byte offset), the trace's tool steps too
((uuid, turn) -> byte offset); an event is read when its call asks, a trajectory line when its
environment resets, and dropped when that environment closes.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mtflow.core.errors import RequestError
from mtflow.core.images import IMAGE_TOKEN, Observation
from mtflow.run.diff import index_lines
from mtflow.run.files import IMAGES_DIR, TRACE, TRAJECTORIES
from mtflow.tools.runner import ToolResult

__all__ = ['RecordedSteps', 'RecordedEnv']

_TOOL_STEP = b'"from": "tool_step"'
_ENV_DONE, _ENV_TRUNCATED = 'stop_rule:env_done', 'stop_rule:env_truncated'


class RecordedSteps:
    """The tool results and environment steps of a recorded run directory (module docstring).

    Attributes: ``tool_calls`` and ``env_steps``, how many were served (a replay's figures)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.trace_path = self.run_dir / TRACE
        self.trajectories_path = self.run_dir / TRAJECTORIES
        if not self.trace_path.is_file():
            raise FileNotFoundError(2, 'no trace.jsonl in the recorded run (--tools recorded needs it)',
                                    str(self.trace_path))
        self._steps = self._index_tool_steps()
        self._lines = index_lines(self.trajectories_path)
        self._trace = open(self.trace_path, 'rb')
        self._traj = open(self.trajectories_path, 'rb')
        self.tool_calls = 0
        self.env_steps = 0

    def _index_tool_steps(self) -> Dict[Tuple[str, int], int]:
        index: Dict[Tuple[str, int], int] = {}
        offset = 0
        with open(self.trace_path, 'rb') as f:
            for raw in f:
                if _TOOL_STEP in raw:  # only those events are parsed
                    event = json.loads(raw)
                    extra = event.get('extra') or {}
                    if isinstance(extra, dict) and 'calls' in extra:
                        index[(str(event['uuid']), int(event['turn']))] = offset
                offset += len(raw)
        return index

    # ---- tools ------------------------------------------------------------------------------
    def tool_results(self, uuid: Any, turn: int, calls: Sequence[Any]) -> List[ToolResult]:
        """The recorded results of request ``uuid``'s calls at ``turn``, in call order."""
        uuid = str(uuid)
        offset = self._steps.get((uuid, turn))
        if offset is None:
            raise RequestError(f'{self.trace_path}: no recorded tool results for this turn; --tools recorded '
                               'cannot answer its calls', uuid=uuid, turn=turn, field='tool_calls')
        self._trace.seek(offset)
        extra = json.loads(self._trace.readline())['extra']
        infos, ios = extra['calls'], extra.get('tool_io') or []
        if len(infos) != len(calls) or len(ios) != len(infos):
            raise RequestError(f'{len(calls)} tool call(s) now, {len(infos)} recorded in {self.trace_path}: '
                               '--tools recorded cannot answer them', uuid=uuid, turn=turn, field='tool_calls')
        results: List[ToolResult] = []
        shown = iter(extra.get('images') or ())  # the images the step added, in call order (mtflow.run.images)
        for k, (call, info, io) in enumerate(zip(calls, infos, ios), 1):
            name = getattr(call, 'name', None)
            if name != info['name'] or getattr(call, 'arguments', None) != io.get('arguments'):
                raise RequestError(f'call {k} is now {name}({getattr(call, "arguments", None)!r}), recorded '
                                   f'{info["name"]}({io.get("arguments")!r}): --tools recorded cannot answer it',
                                   uuid=uuid, turn=turn, field='tool_calls')
            results.append(ToolResult(info['name'], io.get('arguments'), bool(info['ok']), output=io.get('output', ''),
                                      error=io.get('error', info.get('error', '')),
                                      error_kind=info.get('error_kind', ''), duration_s=info.get('duration_s', 0.0),
                                      output_chars=io.get('output_chars'),
                                      images=[self.image_file(next(shown)['sha256'], uuid, turn)
                                              for _ in range(int(info.get('images') or 0))]))
        self.tool_calls += len(results)
        return results

    # ---- environments -----------------------------------------------------------------------
    def env_factory(self) -> 'RecordedEnvFactory':
        return RecordedEnvFactory(self)

    def image_file(self, sha256: str, uuid: str, turn: int) -> Path:
        """The stored file of the image with content hash ``sha256`` (``<run>/images``)."""
        found = sorted((self.run_dir / IMAGES_DIR).glob(f'{sha256}.*'))
        if not found:
            raise RequestError(f'{self.run_dir / IMAGES_DIR} has no image {sha256}: --tools recorded cannot show it',
                               uuid=uuid, turn=turn, field='images')
        return found[0]

    def line(self, uuid: str) -> Optional[Dict[str, Any]]:
        offset = self._lines.get(uuid)
        if offset is None:
            return None
        self._traj.seek(offset)
        return json.loads(self._traj.readline())

    def close(self) -> None:
        self._trace.close()
        self._traj.close()


class RecordedEnvFactory:
    """A zero-argument callable making one :class:`RecordedEnv` per request (what an env factory is)."""

    def __init__(self, steps: RecordedSteps) -> None:
        self.steps = steps

    def __call__(self) -> 'RecordedEnv':
        return RecordedEnv(self.steps)


class RecordedEnv:
    """An environment that answers with what the recorded one answered to the same request."""

    def __init__(self, steps: RecordedSteps) -> None:
        self.steps = steps
        self.uuid = ''
        self.turn = 0
        self._line: Dict[str, Any] = {}
        self._assistant: List[int] = []

    def reset(self, infer_request: Any) -> Any:
        self.uuid = str(getattr(infer_request, 'uuid', None))
        line = self.steps.line(self.uuid)
        if line is None:
            raise RequestError(f'{self.steps.trajectories_path} has no such request: --tools recorded cannot '
                               'answer its environment', uuid=self.uuid, turn=1, field='env')
        self._line = line
        messages = line.get('messages') or []
        self._assistant = [i for i, m in enumerate(messages) if m.get('role') == 'assistant']
        # the opening is what the scheduler added as the first user message when the request had none
        at = next((i for i, m in enumerate(messages) if m.get('role') == 'user'), None)
        return None if at is None else self._observation(at, 1)

    def _observation(self, at: int, turn: int) -> Any:
        """Message ``at`` of the recorded line as an observation: its text, and the stored
        images its ``<image>`` placeholders show (the line's ``images``, in placeholder order)."""
        messages = self._line.get('messages') or []
        text = messages[at].get('content') or ''
        n = text.count(IMAGE_TOKEN) if isinstance(text, str) else 0
        if not n:
            return text
        first = sum((m.get('content') or '').count(IMAGE_TOKEN) for m in messages[:at]
                    if isinstance(m.get('content'), str))
        refs = (self._line.get('images') or [])[first:first + n]
        if len(refs) != n:
            raise RequestError(f'{self.steps.trajectories_path}: the recorded message shows {n} image(s), the line '
                               f'names {len(refs)}', uuid=self.uuid, turn=turn, field='images')
        return Observation(text, [self.steps.run_dir / r for r in refs])

    def step(self, action: str) -> Tuple[Any, float, bool, bool, Dict[str, Any]]:
        self.turn += 1
        line, t = self._line, self.turn
        messages = line.get('messages') or []
        infos = line.get('rollout_infos') or {}
        rewards = infos.get('rewards') or []
        if t > len(rewards):
            raise RequestError(f'{self.steps.trajectories_path}: the recorded environment made {len(rewards)} '
                               'step(s)', uuid=self.uuid, turn=t, field='env')
        last = t == line.get('num_turns')
        at = self._assistant[t - 1] + 1 if t <= len(self._assistant) else len(messages)
        observation = self._observation(at, t) if at < len(messages) and not last else ''
        reason = line.get('finish_reason') if last else None
        self.steps.env_steps += 1
        info = infos.get('env_info') or {} if last else {}
        return observation, float(rewards[t - 1]), reason == _ENV_DONE, reason == _ENV_TRUNCATED, dict(info)

    def close(self) -> None:
        self._line, self._assistant = {}, []
