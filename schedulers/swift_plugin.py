"""ms-swift plugin: mtflow schedulers for ``--multi_turn_scheduler``.

Pass this file to any ms-swift command that takes plugins::

    swift rlhf --rlhf_type grpo ... --external_plugins schedulers/swift_plugin.py \\
        --multi_turn_scheduler mtflow_react_calculator --max_turns 5
    swift rollout ... --external_plugins schedulers/swift_plugin.py \\
        --multi_turn_scheduler mtflow_react_calculator

Importing it registers, in ms-swift's ``multi_turns`` registry:

- every ``*.yaml`` scheduler beside this file as ``mtflow_<file stem>``
  (e.g. ``schedulers/react_calculator.yaml`` -> ``mtflow_react_calculator``);
- each entry of ``MTFLOW_SWIFT_SCHEDULERS``: ``name=path/to/scheduler.yaml`` or
  ``name=package.module:SchedulerClass``, separated by ``;`` or ``,``.

A YAML file is loaded (and validated) when ms-swift builds the scheduler, with the trainer's
tokenizer, so a bad file fails at start-up with every problem listed.

With ``MTFLOW_SWIFT_EXECUTOR=1`` it also calls ``mtflow.integrations.swift.install()``: the
trainers' multi-turn loop runs on mtflow's executor, and ``MTFLOW_TRACE_DIR`` (if set) receives one
JSONL trace per rollout and rank.

It also registers an ``atexit`` call to ``torch.distributed.destroy_process_group()``
(``mtflow.distributed.teardown``): without it, multi-rank gloo jobs abort now and then at exit.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Dict

from mtflow.distributed.teardown import destroy_process_group_at_exit
from mtflow.integrations.swift import install, register

HERE = Path(__file__).resolve().parent
PREFIX = 'mtflow_'


def _resolve(ref: str) -> object:
    """``path.yaml`` stays a path; ``module:attr`` is imported."""
    if ref.endswith(('.yaml', '.yml')):
        path = Path(os.path.expanduser(ref))
        if not path.is_absolute() and not path.exists() and (HERE / path).exists():
            path = HERE / path
        if not path.exists():
            raise FileNotFoundError(f'MTFLOW_SWIFT_SCHEDULERS: no scheduler file {ref!r}')
        return str(path)
    module, _, attr = ref.partition(':')
    if not attr:
        raise ValueError(f'MTFLOW_SWIFT_SCHEDULERS: {ref!r} is neither a .yaml file nor module:attribute')
    obj = importlib.import_module(module)
    for part in attr.split('.'):
        obj = getattr(obj, part)
    return obj


def register_all() -> Dict[str, type]:
    """Register the bundled YAML schedulers and those named in ``MTFLOW_SWIFT_SCHEDULERS``."""
    registered: Dict[str, type] = {}
    for path in sorted(HERE.glob('*.yaml')) + sorted(HERE.glob('*.yml')):
        name = PREFIX + path.stem
        registered[name] = register(name, str(path))
    spec = os.environ.get('MTFLOW_SWIFT_SCHEDULERS', '')
    for entry in filter(None, (e.strip() for e in spec.replace(',', ';').split(';'))):
        name, sep, ref = entry.partition('=')
        if not sep or not name.strip() or not ref.strip():
            raise ValueError(f'MTFLOW_SWIFT_SCHEDULERS: expected name=ref, got {entry!r}')
        registered[name.strip()] = register(name.strip(), _resolve(ref.strip()))
    return registered


REGISTERED = register_all()

# ms-swift 4.6 never destroys its process group; a gloo group alive at interpreter exit aborts
# about one run in ten (SIGABRT, `terminate called without an active exception`).
destroy_process_group_at_exit()

if os.environ.get('MTFLOW_SWIFT_EXECUTOR', '').lower() in ('1', 'true', 'yes', 'on'):
    install(trace_dir=os.environ.get('MTFLOW_TRACE_DIR') or None)
