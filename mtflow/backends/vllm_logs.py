"""What mtflow's vLLM backend does to vLLM's log and process settings when it builds an engine.

**Weight dtype warnings, summarised.** Loading a float32 checkpoint into a bfloat16 engine makes
vLLM warn once per tensor ("Attempted to load weight ... with dtype torch.float32 into parameter
with dtype torch.bfloat16": 122 lines for SmolLM2-135M). The warning comes from the worker
process that loads the model; on CPU vLLM starts its engine core and workers with ``spawn``, so a
filter added in the user's process never reaches them. What does reach them is the engine's
``logging_config`` (vLLM's ``LoggingConfig``, part of the ``VllmConfig`` every engine process
applies when it starts): :func:`logging_config_file` writes vLLM's own default logging
``dictConfig`` with one addition, the :class:`WeightDtypeSummary` filter on its handler, which
swallows those records and logs one line with their count and dtypes instead.

**The worker grace period.** When an engine stops, its engine core closes the workers' pipe and
waits ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (5 s by default) before it SIGTERMs them. A CPU
worker spends 1.5-2 s of CPU after its last log line in interpreter teardown (torch's operator
tables, module dicts; measured with ``strace``/``perf``), 2 s at load 1 and past 5 s on a loaded
2-core machine. The 30 s mtflow gives ``shutdown(timeout=...)`` is the client's wait for the
engine core and never reached the workers' wait: :func:`engine_process_env` gives the workers
:data:`WORKER_SHUTDOWN_GRACE_S` through the environment the engine core inherits."""
from __future__ import annotations

import atexit
import contextlib
import copy
import json
import logging
import os
import tempfile
from typing import Any, Dict, Iterator, Optional, Tuple

__all__ = ['WeightDtypeSummary', 'logging_config_file', 'engine_process_env', 'WORKER_SHUTDOWN_GRACE_S']

#: the start of vLLM's per-tensor warning (``vllm/model_executor/models/utils.py``)
WEIGHT_DTYPE_MESSAGE = 'Attempted to load weight %s with dtype %s into parameter with dtype %s'

#: seconds an engine core waits for its workers to exit before SIGTERM (vLLM's default: 5); below
#: the 30 s the backend's close() gives the engine core as a whole, which exits after its workers
WORKER_SHUTDOWN_GRACE_S = 20

_FILTER_NAME = 'mtflow_weight_dtype_summary'


class WeightDtypeSummary(logging.Filter):
    """A handler filter: vLLM's per-tensor dtype warnings are held back and counted (by source
    and target dtype); the next other record in the process (vLLM logs ``Loading weights took``
    right after) or the process's exit first logs one line with the counts."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Dict[Tuple[str, str], int] = {}
        self._template: Optional[logging.LogRecord] = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == WEIGHT_DTYPE_MESSAGE and isinstance(record.args, tuple) and len(record.args) == 3:
            key = (str(record.args[1]), str(record.args[2]))
            self.counts[key] = self.counts.get(key, 0) + 1
            if self._template is None:
                self._template = record
                # a process whose next record never comes still says it once
                atexit.register(self.flush)
            return False
        self.flush()
        return True

    def summary(self) -> Optional[str]:
        """The line for the held-back warnings (``None`` when there are none)."""
        if not self.counts:
            return None
        total = sum(self.counts.values())
        parts = ', '.join(f'{n} from {src} into {dst}' for (src, dst), n in sorted(self.counts.items()))
        return (f'{total} weights loaded into parameters of another dtype and cast ({parts}); '
                f"vLLM's {total} 'Attempted to load weight' warnings summarised by mtflow")

    def flush(self) -> None:
        """Log the summary line (once) through vLLM's logger, then count anew."""
        line, template = self.summary(), self._template
        self.counts, self._template = {}, None
        if line is None or template is None:
            return
        logger = logging.getLogger(template.name)
        summary = logger.makeRecord(template.name, template.levelno, template.pathname, template.lineno, line, (),
                                    None, func=template.funcName)
        try:
            logger.handle(summary)
        except Exception:  # pragma: no cover - at interpreter exit the stream may be gone
            pass


def logging_config_file(directory: Optional[str] = None) -> Optional[str]:
    """A JSON file with vLLM's default logging ``dictConfig`` (as vLLM builds it for this
    process's environment) plus :class:`WeightDtypeSummary` on its handler; ``None`` when the
    user configures vLLM's logging (``VLLM_LOGGING_CONFIG_PATH``, ``VLLM_CONFIGURE_LOGGING=0``)
    or this vLLM has no default config to start from. The caller deletes the file."""
    if os.environ.get('VLLM_LOGGING_CONFIG_PATH') or os.environ.get('VLLM_CONFIGURE_LOGGING', '1') == '0':
        return None
    try:
        import vllm.envs as envs
        from vllm import logger as vllm_logger
    except Exception:  # pragma: no cover - no vllm, or one without its logging module
        return None
    default = getattr(vllm_logger, 'DEFAULT_LOGGING_CONFIG', None)
    if not isinstance(default, dict) or 'vllm' not in default.get('handlers', {}):
        return None
    config: Dict[str, Any] = copy.deepcopy(default)
    level = envs.VLLM_LOGGING_LEVEL
    handler = config['handlers']['vllm']
    # as vllm.logger._configure_vllm_root_logger refreshes them from the environment
    handler['level'], handler['stream'] = level, envs.VLLM_LOGGING_STREAM
    use_color = getattr(vllm_logger, '_use_color', None)
    if callable(use_color) and 'vllm_color' in config.get('formatters', {}):
        handler['formatter'] = 'vllm_color' if use_color() else 'vllm'
    for formatter in config.get('formatters', {}).values():
        if 'log_level' in formatter:
            formatter['log_level'] = level
    config.setdefault('loggers', {}).setdefault('vllm', {})['level'] = level
    config.setdefault('filters', {})[_FILTER_NAME] = {'()': f'{__name__}.WeightDtypeSummary'}
    handler['filters'] = list(handler.get('filters', [])) + [_FILTER_NAME]
    fd, path = tempfile.mkstemp(prefix='mtflow-vllm-logging-', suffix='.json', dir=directory)
    with os.fdopen(fd, 'w') as f:
        json.dump(config, f)
    return path


@contextlib.contextmanager
def engine_process_env() -> Iterator[None]:
    """While an engine is built (its engine core process is started and inherits the
    environment): ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` is :data:`WORKER_SHUTDOWN_GRACE_S`
    unless the user set it. The process's environment is restored afterwards."""
    key = 'VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS'
    if key in os.environ:
        yield
        return
    os.environ[key] = str(WORKER_SHUTDOWN_GRACE_S)
    try:
        yield
    finally:
        os.environ.pop(key, None)
