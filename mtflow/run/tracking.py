"""Experiment tracking for ``mtflow run --log tensorboard|wandb``: the run's progress figures over
time (requests finished, turns, tokens/s, ETA) and, at the end, the summary (``summary.json``'s
numbers as scalars, the whole of it as text), where TRL, verifiers and ms-swift users look.

Both libraries are imported only when asked for (``import mtflow`` stays light). TensorBoard goes
through ``tensorboardX`` (a pure-Python writer, far lighter than ``tensorboard`` itself), into
``OUT/tensorboard/``; W&B runs offline unless ``WANDB_MODE`` says otherwise (``wandb sync`` uploads
it later), into ``OUT/wandb/``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from mtflow.core.errors import RunSetupError

__all__ = ['TRACKERS', 'Tracker', 'make_tracker', 'check_tracker', 'summary_scalars']

#: what ``--log`` takes
TRACKERS = ('tensorboard', 'wandb')
#: progress figures logged over time (prefix ``progress/``)
PROGRESS_KEYS = ('finished', 'turns', 'turn_bound', 'tokens', 'tokens_per_s', 'eta_s', 'elapsed_s')


def summary_scalars(summary: Mapping[str, Any]) -> Dict[str, float]:
    """The numbers of a summary, flat: ``reward_mean``, ``turns/mean``, ``finish_reasons/<r>``,
    ``reward_groups/with_spread``, ... (lists and text are left to the text record)."""
    out: Dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, bool):
            out[prefix] = float(value)
        elif isinstance(value, (int, float)):
            out[prefix] = float(value)
        elif isinstance(value, Mapping) and prefix.count('/') < 2:
            for k, v in value.items():
                walk(f'{prefix}/{k}' if prefix else str(k), v)

    walk('', {k: v for k, v in summary.items() if k not in ('finish_policy', )})
    return out


class Tracker:
    """One backend: ``log`` figures at a step, ``finish`` with the summary. Figures come at every
    turn; at most one record per ``min_interval_s`` goes out (the last one always does)."""

    def __init__(self, min_interval_s: float = 0.5) -> None:
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._pending: Optional[Dict[str, Any]] = None
        self.records = 0

    def log(self, figures: Mapping[str, Any]) -> None:
        now = time.monotonic()
        self._pending = dict(figures)
        if now - self._last >= self.min_interval_s:
            self._flush_pending()
            self._last = now

    def _flush_pending(self) -> None:
        if self._pending is None:
            return
        figures, self._pending = self._pending, None
        step = int(figures.get('turns') or 0)
        values = {f'progress/{k}': float(figures[k]) for k in PROGRESS_KEYS if isinstance(figures.get(k), (int, float))}
        self._write(values, step)
        self.records += 1

    def finish(self, summary: Optional[Mapping[str, Any]]) -> None:
        """The last progress record, the summary, then close."""
        try:
            self._flush_pending()
            if summary is not None:
                self._write_summary(summary)
        finally:
            self.close()

    # ---- what a backend does ---------------------------------------------------------------------
    def _write(self, values: Dict[str, float], step: int) -> None:
        raise NotImplementedError

    def _write_summary(self, summary: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    """Event files under ``<out>/tensorboard`` (``tensorboard --logdir <out>/tensorboard``)."""

    def __init__(self, out_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        super().__init__()
        try:
            from tensorboardX import SummaryWriter  # 2 MB, imported only for --log tensorboard
        except ImportError:
            raise RunSetupError("--log tensorboard needs the 'tensorboardX' package: "
                                "pip install 'mtflow[tensorboard]'") from None
        self.logdir = Path(out_dir) / 'tensorboard'
        self.writer = SummaryWriter(logdir=str(self.logdir), flush_secs=5)
        self.writer.add_text('config', '```\n' + json.dumps(dict(config), indent=1, default=str) + '\n```', 0)
        self.run_name = run_name
        self._step = 0

    def _write(self, values: Dict[str, float], step: int) -> None:
        self._step = max(self._step, step)
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def _write_summary(self, summary: Mapping[str, Any]) -> None:
        for key, value in summary_scalars(summary).items():
            self.writer.add_scalar(f'summary/{key}', value, self._step)
        self.writer.add_text('summary', '```\n' + json.dumps(dict(summary), indent=1, default=str) + '\n```',
                             self._step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A W&B run under ``<out>/wandb``, offline unless ``WANDB_MODE`` is set."""

    def __init__(self, out_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        super().__init__()
        try:
            import wandb  # heavy; imported only for --log wandb
        except ImportError:
            raise RunSetupError("--log wandb needs the 'wandb' package: pip install 'mtflow[wandb]'") from None
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get('WANDB_PROJECT', 'mtflow'), name=run_name, config=dict(config),
                              dir=str(out_dir), mode=os.environ.get('WANDB_MODE', 'offline'), reinit=True)

    def _write(self, values: Dict[str, float], step: int) -> None:
        self.run.log(values)

    def _write_summary(self, summary: Mapping[str, Any]) -> None:
        self.run.summary.update({f'summary/{k}': v for k, v in summary_scalars(summary).items()})

    def close(self) -> None:
        self.run.finish()


#: the module each tracker imports, and the extra that installs it
_NEEDS = {'tensorboard': ('tensorboardX', 'tensorboard'), 'wandb': ('wandb', 'wandb')}


def check_tracker(kind: Optional[str]) -> None:
    """Before anything starts: the library ``--log`` needs is installed (a one-line error)."""
    if kind is None:
        return
    if kind not in _NEEDS:
        raise RunSetupError(f'--log {kind!r}: choose one of {", ".join(TRACKERS)}')
    module, extra = _NEEDS[kind]
    if importlib.util.find_spec(module) is None:
        raise RunSetupError(f"--log {kind} needs the '{module}' package: pip install 'mtflow[{extra}]'")


def make_tracker(kind: Optional[str], out_dir: Path, run_name: str, config: Mapping[str, Any]) -> Optional[Tracker]:
    """The tracker ``--log`` names, or ``None``; a missing library is a one-line error."""
    if kind is None:
        return None
    if kind == 'tensorboard':
        return TensorBoardTracker(out_dir, run_name, config)
    if kind == 'wandb':
        return WandbTracker(out_dir, run_name, config)
    raise RunSetupError(f'--log {kind!r}: choose one of {", ".join(TRACKERS)}')
