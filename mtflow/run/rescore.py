"""Rewards and the finish policy recomputed over a run's stored trajectories (``mtflow rescore``).

No model, tool or environment is called: each trajectory line is read, its reward recomputed with
the reward function given, the finish policy applied anew, and the line written to the new run
directory; nothing else of the line changes. Which lines get a reward is the YAML scheduler's own
rule: a line whose ``rollout_infos`` has ``stop_rule`` (the scheduler decided the finish, which is
where it computes the reward); a failed request keeps what it had. The finish policy applies to
every line, as the scheduler's ``finalize_output`` does on every finish path.

What the reward function sees is what the scheduler gave it (``reward(infer_request, infos)``):
the request as the dataset holds it (``data_dict``, ...) with the final conversation, and the
line's ``rollout_infos`` without what the finish policy and the old reward added
(``infos['reward']`` is the sum of the environment's step rewards when there are some, as when
the scheduler computed it). The old policy is undone first (its ``reward`` replaced by
``previous_reward``, ``mtflow_drop`` removed); a ``mask`` it applied cannot be undone (the mask is
the trained record) and stays, counted in ``kept_masked``.

Memory: lines stream one at a time; the dataset is read alongside (a request is kept from when
the dataset yields it until its line comes, so memory holds the run's disorder, a batch or so,
not the run); the summary's figures are running sums (:class:`mtflow.run.tally.RunTally`).
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional

from mtflow.core.errors import RequestError, UserError
from mtflow.core.validate import check_reward
from mtflow.declarative.policy import DROP_KEY, INFO_KEY, FinishPolicy, apply_policy
from mtflow.run.trajectories import reward_of as trajectory_reward
from mtflow.run.files import RUN_INFO, SUMMARY, TRACE, TRAJECTORIES, json_line, write_json_atomic
from mtflow.run.tally import RunTally

__all__ = ['Rescorer', 'rescore_line', 'count_lines']

Reward = Callable[[Any, Dict[str, Any]], Any]


class _Line:
    """What :func:`apply_policy` works on: a trajectory line's output fields."""

    def __init__(self, line: Dict[str, Any]) -> None:
        self.response_token_ids = line.get('response_token_ids')
        self.response_loss_mask = line.get('response_loss_mask')
        self.rollout_logprobs = line.get('rollout_logprobs')
        self.rollout_infos = line.get('rollout_infos')


def _undo_policy(infos: Dict[str, Any]) -> bool:
    """Take the old finish policy's record out of ``infos``; whether it had masked the line."""
    record = infos.pop(INFO_KEY, None)
    infos.pop(DROP_KEY, None)
    if not isinstance(record, dict):
        return False
    if 'previous_reward' in record:
        infos['reward'] = record['previous_reward']
    return 'mask' in str(record.get('action', '')).split('+')


def _reward_infos(infos: Dict[str, Any]) -> Dict[str, Any]:
    """``infos`` as the scheduler passed them to its reward (see the module docstring)."""
    shown = dict(infos)
    rewards = shown.get('rewards')
    if isinstance(rewards, list) and 'env_steps' in shown:
        shown['reward'] = float(sum(rewards))
    else:
        shown.pop('reward', None)
    return shown


def rescore_line(line: Dict[str, Any], request: Any, reward: Optional[Reward],
                 policy: Optional[FinishPolicy]) -> Dict[str, bool]:
    """Recompute ``line``'s reward and finish policy, in place; what happened to it
    (``rescored``: a new reward; ``kept_masked``: the old policy's mask stays)."""
    infos = line.get('rollout_infos')
    if not isinstance(infos, dict):
        infos = line['rollout_infos'] = {}
    masked = _undo_policy(infos)
    rescored = False
    if reward is not None and 'stop_rule' in infos:
        req = copy.copy(request)
        req.messages = copy.deepcopy(line.get('messages') or [])
        try:
            value = reward(req, _reward_infos(infos))
        except Exception as exc:
            raise UserError(f'rescore: request {line.get("uuid")}: the reward raised {type(exc).__name__}: '
                            f'{exc}') from None
        if hasattr(value, '__await__'):
            close = getattr(value, 'close', None)
            if callable(close):
                close()  # never awaited: no "coroutine was never awaited" warning
            raise UserError('rescore: the reward function is async; rescore calls it synchronously')
        try:
            value = check_reward(value, line.get('uuid'), None)
        except RequestError as exc:
            raise UserError(f'rescore: {exc}') from None
        infos['reward'], rescored = value, True
    if policy is not None:  # every finish path, as the scheduler's finalize_output
        out = apply_policy(policy, _Line(line), line.get('finish_reason') or '')
        line['response_loss_mask'], line['rollout_logprobs'] = out.response_loss_mask, out.rollout_logprobs
        line['rollout_infos'] = out.rollout_infos
    line['reward'] = trajectory_reward(line['rollout_infos'])  # the top-level copy follows rollout_infos
    return {'rescored': rescored, 'kept_masked': masked}


def count_lines(path: Path) -> int:
    """Lines of a file, read in blocks (what the progress bar counts to)."""
    n = 0
    with open(path, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            n += block.count(b'\n')
    return n


class Rescorer:
    """One ``mtflow rescore``: ``run(on_line)`` streams ``run_dir``'s trajectories into ``out_dir``.

    Args:
        requests: the dataset's requests in order (for ``data_dict``); ``reward``: the reward
            function (``None``: keep the rewards); ``policy``: the finish policy (``None``: none).
    """

    def __init__(self, run_dir: Path, out_dir: Path, requests: Iterator[Any], reward: Optional[Reward],
                 policy: Optional[FinishPolicy], describe: Dict[str, Any]) -> None:
        self.run_dir, self.out_dir = Path(run_dir), Path(out_dir)
        self.requests = requests
        self.reward, self.policy = reward, policy
        self.describe = describe
        self.tally = RunTally()
        self.figures = {'lines': 0, 'rescored': 0, 'reward_changed': 0, 'kept_masked': 0}
        self._pending: Dict[str, Any] = {}

    def _request(self, uuid: str) -> Any:
        while uuid not in self._pending:
            try:
                r = next(self.requests)
            except StopIteration:
                raise UserError(f'rescore: request {uuid} of {self.run_dir / TRAJECTORIES} is not in the dataset '
                                'of the config (data_dict unknown)') from None
            self._pending[str(getattr(r, 'uuid', ''))] = r
        return self._pending.pop(uuid)

    def run(self, on_line: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
        """Rescore into ``out_dir`` (missing or empty); on any failure nothing is left behind (no
        ``trajectories.jsonl.tmp``, the directory removed when this call made it), so the same
        command can be run again once the reward is fixed."""
        made = not self.out_dir.exists()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.out_dir / (TRAJECTORIES + '.tmp')
        if any(p != tmp for p in self.out_dir.iterdir()):  # a stale .tmp of a killed rescore is no run
            raise UserError(f'{self.out_dir} is not empty: rescore writes a new run directory')
        started = time.perf_counter()
        try:
            self._write_lines(tmp, on_line)
            os.replace(tmp, self.out_dir / TRAJECTORIES)
            if (self.run_dir / TRACE).is_file():
                shutil.copyfile(self.run_dir / TRACE, self.out_dir / TRACE)
            self.figures['wall_s'] = round(time.perf_counter() - started, 3)
            self._write_meta()
        except BaseException:
            tmp.unlink(missing_ok=True)
            for name in (TRAJECTORIES, TRACE, RUN_INFO, SUMMARY):
                (self.out_dir / name).unlink(missing_ok=True)
            if made:
                shutil.rmtree(self.out_dir, ignore_errors=True)
            raise
        return self.figures

    def _write_lines(self, tmp: Path, on_line: Optional[Callable[[], None]]) -> None:
        source = self.run_dir / TRAJECTORIES
        with open(source, 'r', encoding='utf-8') as src, open(tmp, 'w', encoding='utf-8') as dst:
            for no, raw in enumerate(src, 1):
                if not raw.strip():
                    continue
                try:
                    line = json.loads(raw)
                except ValueError as exc:
                    raise UserError(f'{source}:{no}: not JSON: {exc}') from None
                uuid = str(line.get('uuid'))
                old = (line.get('rollout_infos') or {}).get('reward')
                request = self._request(uuid) if self.reward is not None else None
                try:
                    what = rescore_line(line, request, self.reward, self.policy)
                except UserError as exc:
                    raise UserError(f'{source}:{no}: {exc}') from None
                f = self.figures
                f['lines'] += 1
                f['rescored'] += what['rescored']
                f['kept_masked'] += what['kept_masked']
                f['reward_changed'] += (line.get('rollout_infos') or {}).get('reward') != old
                self.tally.add_record(line)
                dst.write(json_line(line) + '\n')
                if on_line is not None:
                    on_line()
            dst.flush()
            os.fsync(dst.fileno())

    def _write_meta(self) -> None:
        try:
            info = json.loads((self.run_dir / RUN_INFO).read_text(encoding='utf-8'))
        except (OSError, ValueError):
            info = {}
        info['rescore_of'] = str(self.run_dir.resolve())
        info['rescore'] = {**self.describe, **self.figures}
        write_json_atomic(self.out_dir / RUN_INFO, info)
        try:
            summary = json.loads((self.run_dir / SUMMARY).read_text(encoding='utf-8'))
        except (OSError, ValueError):
            summary = {}
        t = self.tally
        summary.update({'out': str(self.out_dir), 'reward_mean': t.reward_mean(), 'reward_groups': t.reward_groups(),
                        'finish_policy': t.policy.summary(), 'rescore': info['rescore']})
        write_json_atomic(self.out_dir / SUMMARY, summary)
