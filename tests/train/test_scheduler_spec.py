"""A trainer's config names its scheduler as text (verl's agent-loop YAML) or passes one: each
wrong value is one clear error naming it."""
from __future__ import annotations

import pytest

from mtflow.core.errors import UserError
from mtflow.train.scheduler_spec import make_scheduler

from tests.train.helpers import ToolEveryTurn


def test_a_scheduler_a_yaml_file_and_a_module_class_are_taken():
    mine = ToolEveryTurn(max_turns=2)
    assert make_scheduler(mine) is mine
    assert type(make_scheduler('schedulers/grid_game.yaml')).__name__ == 'YamlScheduler'
    built = make_scheduler('tests.train.helpers:ToolEveryTurn', args={'max_turns': 3})
    assert isinstance(built, ToolEveryTurn) and built.max_turns == 3


@pytest.mark.parametrize('spec, error, words', [
    ('schedulers/nope.yaml', FileNotFoundError, 'scheduler file not found: schedulers/nope.yaml'),
    ('no_such_module:Thing', UserError, "cannot import 'no_such_module'"),
    ('tests.train.helpers:Nope', UserError, "'tests.train.helpers' has no 'Nope'"),
    (42, ValueError, "a YAML file or 'module:Class', not 42")])
def test_a_wrong_scheduler_is_named(spec, error, words):
    with pytest.raises(error, match=words.replace('(', r'\(').replace(')', r'\)')):
        make_scheduler(spec)


def test_arguments_the_factory_does_not_take_are_named():
    with pytest.raises(ValueError, match=r"scheduler 'tests.train.helpers:even_share': bad arguments \['bogus'\]"):
        make_scheduler('tests.train.helpers:even_share', args={'bogus': 1})


def test_a_factory_that_builds_no_scheduler_is_named():
    with pytest.raises(ValueError, match=r"'tests.train.helpers:prompts' built a list, which has no step\(\) method"):
        make_scheduler('tests.train.helpers:prompts', args={'groups': 1, 'size': 1})
