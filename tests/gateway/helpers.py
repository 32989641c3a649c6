"""Shared pieces of the gateway tests: a scripted model with a real (tiny) tokenizer, so that every
trajectory keeps exact token records, and the checks every test makes of a run directory."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

from mtflow.backends.scripted import ScriptedBackend
from mtflow.run.token_check import check_run_tokens
from tests.tiny_model import make_tokenizer

ADD_TOOL = {'type': 'function', 'function': {'name': 'add', 'description': 'add two integers', 'parameters': {
    'type': 'object', 'properties': {'a': {'type': 'integer'}, 'b': {'type': 'integer'}}, 'required': ['a', 'b']}}}
CALLS_ADD = 'I will add them.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
#: a client's timeout: no test waits longer for one call
TIMEOUT_S = 60


def scripted(*outputs: Any, cycle: bool = True, honor_max_tokens: bool = False) -> ScriptedBackend:
    """A scripted model that replays ``outputs`` (texts, or dicts keyed by ``uuid``/``turn``) with
    exact-id prompts under the tiny tokenizer's chat template."""
    return ScriptedBackend(outputs=list(outputs), cycle=cycle, tokenizer=make_tokenizer(),
                           honor_max_tokens=honor_max_tokens)


def lines(run_dir: Path) -> List[Dict[str, Any]]:
    path = Path(run_dir) / 'trajectories.jsonl'
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def events(run_dir: Path, uuid: str) -> List[Dict[str, Any]]:
    path = Path(run_dir) / 'trace.jsonl'
    return [e for e in map(json.loads, path.read_text().splitlines()) if e['uuid'] == uuid]


def assert_tokens_exact(run_dir: Path, segments: int) -> None:
    """``mtflow check-tokens RUN_DIR`` passes every check of every segment, and there are ``segments``."""
    report = check_run_tokens(Path(run_dir) / 'trajectories.jsonl')
    assert report.ok and not report.problems, report.problems
    assert report.segments == segments
    for check in ('exact', 'lengths', 'sampled', 'prompts'):
        assert report.passed[check] == segments and not report.failed[check], (check, report.passed, report.failed)
