"""One source for each rule: finish reasons live in ``mtflow.core.machine.FINISH_REASON_TABLE`` (the
docs and the viewer read it), the stop decision in ``mtflow.core.stop``, and the core never imports
the outer layers."""
from __future__ import annotations

import ast
import time
from pathlib import Path

import mtflow
from mtflow import Scheduler
from mtflow.core import machine as M
from mtflow.core.stop import decide_stop, default_check
from mtflow.viewer.html import render_html
from mtflow.viewer.model import request_views
from mtflow.viewer.terminal import reason_style
from tests.helpers import Counter, out, req

ROOT = Path(__file__).resolve().parents[2]
CORE = ('core/protocol', 'core/machine', 'core/scheduler', 'accounting/segments', 'engine/executor', 'core/trace',
        'core/stop', 'core/validate', 'core/calls', 'core/records', 'core/types', 'core/errors', 'accounting/swift46')
OUTER = ('declarative', 'tools', 'backends', 'integrations', 'viewer', 'cli', 'commands', 'run')


def test_the_finish_reason_table_of_the_docs_is_generated_from_machine():
    page = (ROOT / 'docs' / 'state-machine.md').read_text()
    begin = '<!-- generated from mtflow.core.machine.FINISH_REASON_TABLE: begin -->\n'
    table = page[page.index(begin) + len(begin):page.index('<!-- generated from mtflow.core.machine.FINISH_REASON_TABLE: end')]
    assert table == M.finish_reasons_markdown(), 'regenerate the table from mtflow.core.machine.finish_reasons_markdown()'
    assert [row[0] for row in M.FINISH_REASON_TABLE] == list(M.FINISH_REASONS)


def test_the_viewer_colours_every_reason_by_its_kind():
    assert reason_style('timeout') == reason_style('error') == 'bold red'
    assert reason_style('turn_cap') == reason_style('max_turns') == 'yellow'
    assert reason_style('stop_rule:x') == 'green' and reason_style(None) == 'magenta'

    class Slow(Scheduler):

        def step(self, infer_request, response_choice, current_turn):
            time.sleep(1.0)
            return {'infer_request': infer_request}

    result = mtflow.Executor(Slow(max_turns=2), Counter(lambda r, n: out('x', [1])), on_error='return',
                             step_timeout_s=0.1).run([req('a')])
    assert result.finish_reasons == ['timeout']
    [view] = request_views(result.trace)
    assert view.cells[-1].marks().endswith('✗')
    page = render_html(result.trace)
    assert '"timeout": "error"' in page and '"interrupted": "limit"' in page


def test_one_stop_rule():
    assert default_check('length', 1, 5) == (True, M.LENGTH)
    assert default_check('stop', 5, 5) == (True, M.MAX_TURNS)
    assert default_check('stop', 4, 5) == (False, M.CHECK_FINISHED)
    assert decide_stop({'done': False}, True, M.CHECK_FINISHED, 1, None) == (False, M.DONE_BY_HOOK)
    assert decide_stop({'done': True, 'finish_reason': 'stop_rule:x'}, False, M.CHECK_FINISHED, 1, None) == (
        True, 'stop_rule:x')
    assert decide_stop({}, True, M.CHECK_FINISHED, 1, None) == (True, M.CHECK_FINISHED)
    assert decide_stop({'done': False}, False, M.CHECK_FINISHED, 3, 3, M.TURN_CAP) == (True, M.TURN_CAP)
    # the YAML scheduler and the ms-swift adapter use it (no copy of the rule elsewhere)
    for path in ('mtflow/declarative/scheduler.py', 'mtflow/integrations/swift/adapter.py', 'mtflow/core/scheduler.py'):
        text = (ROOT / path).read_text()
        assert 'current_turn >= self.max_turns' not in text, path
        assert 'from mtflow.core.stop import' in text, path


def test_the_core_never_imports_the_outer_layers():
    for name in CORE:
        tree = ast.parse((ROOT / 'mtflow' / f'{name}.py').read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = ('.' * node.level) + (node.module or '')
                assert not any(module.lstrip('.').startswith(o) or module.startswith(f'mtflow.{o}') for o in OUTER), \
                    f'mtflow/{name}.py imports {module}'
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert not any(alias.name.startswith(f'mtflow.{o}') for o in OUTER), f'{name} imports {alias.name}'


def test_a_failed_rollout_does_not_count_the_last_turns_tokens_twice():

    class Go(Scheduler):

        def step(self, infer_request, response_choice, current_turn):
            infer_request.messages.append({'role': 'user', 'content': 'obs'})
            return {'infer_request': infer_request}

    calls = []

    def rollout(requests, config):
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionError('engine died')
        return [out('x', [1, 2, 3]) for _ in requests]

    result = mtflow.Executor(Go(max_turns=3), rollout, on_error='return').run([req('a')])
    assert result.finish_reasons == ['error']
    [view] = request_views(result.trace)
    assert view.tokens == 3  # turn 1's output, once
