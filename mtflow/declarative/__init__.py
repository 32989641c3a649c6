"""Declarative schedulers: a tool-use environment in one YAML file.

- :func:`load_scheduler` — YAML path (or dict) -> a ready :class:`mtflow.Scheduler`;
- :func:`validate_file` — every problem in a file, with file, line and field path
  (:func:`inspect_file` adds the Python code the file imports);
- :func:`json_schema` — the JSON Schema of the YAML (``mtflow schema``);
- :mod:`.parsers` (tool-call formats, :func:`register_parser`), :mod:`.gym` (the ``impl``
  environments, :func:`register_env`), :mod:`.envs` (every environment kind).

Reading a file: :mod:`.loader` (problems with lines) over :mod:`.schema` (the keys). Running it:
:mod:`.scheduler` (the hooks), one module per section of the file (:mod:`.stop_rules`,
:mod:`.answers`, :mod:`.tips`, :mod:`.tool_calls`, :mod:`.observations`, :mod:`.policy`).

See ``docs/declarative.md``.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Union

from mtflow.core.registry import resolve_reference
from mtflow.declarative.gym import Env, GuessNumberEnv, register_env
from mtflow.declarative.loader import ConfigError, FileReport, Problem, inspect_file, load_config, validate_file
from mtflow.declarative.parsers import ToolCall, ToolCallParser, get_parser, register_parser
from mtflow.declarative.schema import SchedulerConfig
from mtflow.declarative.scheduler import ToolCallError, YamlScheduler


def load_scheduler(source: Union[str, os.PathLike, Dict[str, Any], SchedulerConfig], tokenizer: Any = None,
                   **kwargs: Any) -> YamlScheduler:
    """Build the scheduler a YAML file (or mapping) describes.

    ``tokenizer`` (a Hugging Face tokenizer, given by the backend) lets inline observations and
    tips produce token ids with loss mask 0, and observation limits count tokens. Other keyword
    arguments go to the scheduler class (``infer_engine``, ``base_dir``). Raises
    :class:`ConfigError` listing every problem."""
    config, base_dir = load_config(source, kwargs.pop('base_dir', None))
    cls: Any = YamlScheduler
    if config.scheduler_class:
        cls = resolve_reference(config.scheduler_class, base_dir)
        if not (isinstance(cls, type) and issubclass(cls, YamlScheduler)):
            raise ConfigError([Problem(str(source) if not isinstance(source, dict) else '<dict>', None,
                                       'scheduler_class', f'{config.scheduler_class} is not a YamlScheduler subclass')])
    return cls(config, tokenizer=tokenizer, base_dir=base_dir, **kwargs)


def json_schema() -> Dict[str, Any]:
    """The JSON Schema of scheduler YAML files."""
    schema = SchedulerConfig.model_json_schema()
    schema['$schema'] = 'https://json-schema.org/draft/2020-12/schema'
    return schema


__all__ = [
    'load_scheduler', 'validate_file', 'inspect_file', 'FileReport', 'json_schema', 'load_config', 'ConfigError', 'Problem', 'SchedulerConfig',
    'YamlScheduler', 'ToolCallError', 'ToolCall', 'ToolCallParser', 'get_parser', 'register_parser', 'Env',
    'GuessNumberEnv', 'register_env'
]
