"""A scheduler with a ``branch:`` section under ms-swift (issue 47, item 10): ms-swift's trainers
and driver take one output per request, so the forks could only be dropped; building the
adapter (what ``--multi_turn_scheduler`` does, with ms-swift's driver or mtflow's executor under
it) refuses in one line naming the scheduler, where the section used to be ignored silently."""
from __future__ import annotations

import pytest

import mtflow.integrations.swift as integ
from mtflow.core.errors import UserError
from schedulers import path as scheduler_path
from tests.tiny_model import make_tokenizer


def test_a_branched_scheduler_is_refused_when_ms_swift_builds_it():
    Adapter = integ.as_swift_scheduler(str(scheduler_path('guess_branch')), name='mtflow_guess_branch')
    with pytest.raises(UserError) as err:
        Adapter(max_turns=None, tokenizer=make_tokenizer())
    message = str(err.value)
    assert "'mtflow_guess_branch' has a branch: section" in message and 'cannot fork it' in message


def test_the_same_scheduler_without_branch_is_built():
    Adapter = integ.as_swift_scheduler(str(scheduler_path('guess_number')))
    assert Adapter(max_turns=None, tokenizer=make_tokenizer()).inner.branch is None
