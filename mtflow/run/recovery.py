"""Opening a run directory again (``--resume``): check that it is the same run, then repair what a
crash or a signal left behind.

A request is done exactly when its trajectory line is whole. So resuming drops a torn last line
of ``trajectories.jsonl`` and of ``trace.jsonl``, removes the trace events of requests that are
not done (their trajectory line never made it), forgets the interrupted requests (they run
again) and the stale summary, and reads every done request back into the tally, so the summary
of the resumed run covers the whole directory.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from mtflow.run.files import (FORMAT, INTERRUPTED_FILE, RUN_INFO, SUMMARY, TRACE, TRAJECTORIES, FingerprintMismatch,
                              RunDirError, count_lines, fsync_dir, scan_jsonl)
from mtflow.run.fingerprint import ACCEPTABLE
from mtflow.run.tally import RunTally

__all__ = ['Recovery', 'fingerprint_changes', 'read_run_info', 'recover']


@dataclass
class Recovery:
    """What opening a directory with ``mode='resume'`` found and repaired."""
    done: int = 0  # trajectories already written
    torn_trajectory_line: bool = False  # a torn last line of trajectories.jsonl was dropped
    torn_trace_line: bool = False  # a torn last line of trace.jsonl was dropped
    orphan_events: int = 0  # trace events of requests that were not done, dropped
    interrupted: int = 0  # requests the last attempt cut short (run again)
    attempts: int = 0  # earlier attempts
    accepted_changes: List[str] = field(default_factory=list)  # code changes --accept-changed went past

    def notes(self) -> List[str]:
        """One phrase per repair, for the command's message."""
        out = []
        if self.torn_trajectory_line:
            out.append(f'dropped a torn last line of {TRAJECTORIES}')
        if self.torn_trace_line:
            out.append(f'dropped a torn last line of {TRACE}')
        if self.orphan_events:
            out.append(f'dropped {self.orphan_events} trace event(s) of requests that were not finished')
        if self.interrupted:
            out.append(f'{self.interrupted} interrupted request(s) run again')
        if self.accepted_changes:
            out.append(self.accepted_note())
        return out

    def accepted_note(self) -> str:
        """What ``--accept-changed`` went past (``''``: nothing): said even under ``-q``, since it
        changes what the run means (the requests written before ran the old code)."""
        if not self.accepted_changes:
            return ''
        return f'--accept-changed: going on with changed code ({"; ".join(self.accepted_changes)}), recorded in {RUN_INFO}'


def fingerprint_changes(old: Any, new: Any, prefix: str = '') -> List[str]:
    """``['request_config.temperature: 0.7 -> 1.0', ...]``: what differs between two
    fingerprints (nested dicts), one entry per changed leaf."""

    def short(v: Any) -> str:
        s = json.dumps(v, default=str)
        return s if len(s) <= 60 else s[:57] + '...'

    if isinstance(old, dict) and isinstance(new, dict):
        out: List[str] = []
        for key in sorted(set(old) | set(new), key=str):
            name = f'{prefix}.{key}' if prefix else str(key)
            if key not in old:
                out.append(f'{name}: (absent) -> {short(new[key])}')
            elif key not in new:
                out.append(f'{name}: {short(old[key])} -> (absent)')
            else:
                out.extend(fingerprint_changes(old[key], new[key], name))
        return out
    return [] if old == new else [f'{prefix or "fingerprint"}: {short(old)} -> {short(new)}']


def _acceptable(change: str) -> bool:
    """Whether ``--accept-changed`` may go past this change (:data:`ACCEPTABLE`)."""
    return any(change == part or change.startswith(part + '.') or change.startswith(part + ':')
               for part in ACCEPTABLE)


def read_run_info(out: Path, entries: List[str], fingerprint: Optional[Dict[str, Any]],
                  accept_changed: bool = False) -> Tuple[Dict[str, Any], List[str]]:
    """The ``run.json`` of the run in ``out`` (which holds ``entries``), refused unless it is an
    mtflow run started with the same ``fingerprint`` (:class:`FingerprintMismatch` names each
    change), and the changes ``accept_changed`` went past: the code and files the config names
    (:data:`mtflow.run.fingerprint.ACCEPTABLE`); ``run.json`` then takes the new fingerprint. A
    run started before the fingerprint held ``code`` compares none."""
    info_path = out / RUN_INFO
    if RUN_INFO not in entries:
        shown = ', '.join(entries[:5]) + (' ...' if len(entries) > 5 else '')
        raise RunDirError(f'cannot resume {out}: it holds no mtflow run (no {RUN_INFO}; found {shown}); '
                          f'choose another --out, or --overwrite to move it aside and start afresh')
    try:
        info = json.loads(info_path.read_text(encoding='utf-8'))
    except (OSError, ValueError) as exc:
        raise RunDirError(f'cannot resume {out}: {info_path} is unreadable ({exc}); '
                          f'--overwrite starts afresh') from None
    if not isinstance(info, dict) or info.get('format') != FORMAT:
        raise RunDirError(f'cannot resume {out}: {info_path} is not an mtflow run file (format {FORMAT})')
    if fingerprint is None:
        return info, []
    old = info.get('fingerprint') or {}
    if 'code' not in old:
        fingerprint = {k: v for k, v in fingerprint.items() if k != 'code'}
    changes = fingerprint_changes(old, fingerprint)
    held = [c for c in changes if not _acceptable(c)]
    code = [c for c in changes if _acceptable(c)]
    if held:
        listed = '; '.join(changes[:8]) + (f'; and {len(changes) - 8} more' if len(changes) > 8 else '')
        raise FingerprintMismatch(
            f'cannot resume {out}: the run was started with another config or dataset ({listed}); '
            f'resume with the original ones, or pass --overwrite to start afresh', changes)
    if code and not accept_changed:
        listed = '; '.join(code[:8]) + (f'; and {len(code) - 8} more' if len(code) > 8 else '')
        raise FingerprintMismatch(
            f'cannot resume {out}: code or files the config names changed since the run started ({listed}), so '
            f'the requests already written ran the old ones: restore them, pass --accept-changed to go on with the '
            f'new ones (recorded in {RUN_INFO}), or --overwrite to start afresh', code)
    if code:
        info['fingerprint'] = fingerprint
    return info, code


def recover(out: Path, info: Dict[str, Any], done: Set[str], tally: RunTally) -> Recovery:
    """Repair the directory of a resumed run; ``done`` gets every uuid already written and
    ``tally`` every request and trace event of theirs."""
    found = Recovery(attempts=len(info.get('attempts') or []))
    traj_path, trace_path = out / TRAJECTORIES, out / TRACE

    def on_trajectory(obj: Dict[str, Any], lineno: int) -> None:
        uuid = obj.get('uuid')
        if uuid is None:
            raise RunDirError(f'{traj_path}:{lineno}: a trajectory without a uuid: the directory is damaged')
        uuid = str(uuid)
        if uuid in done:
            raise RunDirError(f'{traj_path}:{lineno}: request {uuid} is written twice: the directory is damaged')
        done.add(uuid)
        tally.add_record(obj)

    found.torn_trajectory_line = scan_jsonl(traj_path, on_trajectory)
    found.done = len(done)

    def on_event(obj: Dict[str, Any], lineno: int) -> None:
        if str(obj.get('uuid')) in done:
            tally.add_event(obj)
        else:
            found.orphan_events += 1

    found.torn_trace_line = scan_jsonl(trace_path, on_event)
    if found.orphan_events:
        _drop_orphan_events(trace_path, done)
    found.interrupted = count_lines(out / INTERRUPTED_FILE)
    for stale in (INTERRUPTED_FILE, SUMMARY):
        try:
            os.unlink(out / stale)
        except FileNotFoundError:
            pass
    for name in (TRAJECTORIES, TRACE):
        if not (out / name).exists():
            os.close(os.open(out / name, os.O_WRONLY | os.O_CREAT, 0o644))
    fsync_dir(out)
    return found


def _drop_orphan_events(trace_path: Path, done: Set[str]) -> None:
    """Rewrite trace.jsonl with only the events of done requests (atomically)."""
    tmp = trace_path.with_name(trace_path.name + '.tmp')
    with open(trace_path, 'rb') as src, open(tmp, 'wb') as dst:
        for raw in src:
            if raw.strip() and str(json.loads(raw).get('uuid')) in done:
                dst.write(raw)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, trace_path)
    fsync_dir(trace_path.parent)
