"""The engine core's structure: one dispatch by state, and one place that changes a state.

Read from the source (``ast``), so a driver that grows its own ``if rec.state == ...`` dispatch
to a handler, or a module that sets ``record.state`` or calls the graph itself, fails here."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import List, Tuple

from mtflow.core.machine import FINISHED, STATES, StateGraph
from mtflow.engine.handlers import STATE_HANDLERS

ROOT = Path(__file__).resolve().parent.parent / 'mtflow'


def _sources() -> List[Tuple[str, ast.AST]]:
    return [(str(p.relative_to(ROOT.parent)), ast.parse(p.read_text())) for p in sorted(ROOT.rglob('*.py'))]


def test_the_handler_table_names_every_state_of_the_graph():
    assert set(STATE_HANDLERS) == set(StateGraph().states) - {FINISHED} == set(STATES) - {FINISHED}


def test_only_the_graph_sets_a_state_and_only_the_moves_call_the_graph():
    setters, callers = [], []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr == 'state' and not (
                            isinstance(t.value, ast.Name) and t.value.id in ('self', 'slot')):
                        setters.append(f'{path}:{node.lineno}')
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ('move', 'move_all', 'fork') and 'graph' in ast.unparse(node.func.value):
                callers.append(path)
    assert {s.split(':')[0] for s in setters} == {'mtflow/core/machine.py'}, setters  # StateGraph.move/move_all
    assert set(callers) == {'mtflow/engine/moves.py'}, callers


def test_no_driver_calls_a_handler_but_through_the_table():
    """The drivers name no handler: they hand records to ``STATE_HANDLERS`` (``advance``,
    ``turn_phases``) and decide only when, and how many."""
    handler_names = {fn.__name__ for fn in STATE_HANDLERS.values()} | {'start', 'handle_compacting'}
    offenders = []
    for path, tree in _sources():
        if not path.startswith('mtflow/engine/') or path.endswith(('handlers.py', 'context.py')):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):  # a handler imported by name
                name = node.func.id
                if name in handler_names:
                    offenders.append(f'{path}:{node.lineno} {name}')
    assert not offenders, offenders
