"""Hooks come from one declared table (``mtflow.core.scheduler.HOOKS``): a misspelled ``on_*``
method or a hook with the wrong arguments is an error when the executor is built."""
from __future__ import annotations

import pytest

import mtflow
from mtflow.core.scheduler import HOOK_NAMES, HOOKS, HookError, HookSet


class _Base(mtflow.Scheduler):
    def step(self, infer_request, response_choice, current_turn):
        return {'infer_request': infer_request}


def _rollout(requests, request_config=None):
    raise AssertionError('never called: the executor is refused when it is built')


@pytest.mark.parametrize('typo,closest', [('on_turn_ends', 'on_turn_end'), ('on_trajectory_stat', 'on_trajectory_start'),
                                          ('on_request_finish', 'on_request_finished'), ('on_finish', None)])
def test_a_misspelled_hook_names_the_closest(typo, closest):
    cls = type('Typo', (_Base, ), {typo: lambda self, *a: None})
    with pytest.raises(HookError, match=typo) as err:
        mtflow.Executor(cls(), _rollout)
    if closest is not None:
        assert f"did you mean '{closest}'" in str(err.value)
    assert 'Typo' in str(err.value)


def test_a_hook_with_the_wrong_arity_is_refused():
    class TwoArgs(_Base):
        async def on_turn_end(self, infer_request, response_choice):  # current_turn forgotten
            return {}

    with pytest.raises(HookError, match=r'TwoArgs.*on_turn_end.*on_turn_end\(infer_request, response_choice, '
                                        r'current_turn\)'):
        mtflow.Executor(TwoArgs(), _rollout)


def test_hooks_with_defaults_and_star_args_fit():
    class Loose(_Base):
        def check_finished(self, *args, **kwargs):
            return True

        def on_trajectory_end(self, requests, error=None, extra=1):
            return None

    hooks = HookSet(Loose())
    assert hooks.check_finished is not None and hooks.on_trajectory_end is not None
    assert hooks.on_turn_end is None  # the no-op default is skipped


def test_the_table_names_every_hook_the_base_class_has():
    defined = {n for n in vars(mtflow.Scheduler) if not n.startswith('_') and callable(getattr(mtflow.Scheduler, n))}
    assert defined - {'tokenizer'} == set(HOOK_NAMES)
    assert len(HOOKS) == len(set(HOOK_NAMES))
