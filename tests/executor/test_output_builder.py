"""OutputBuilder builds exactly what validation builds for values the executor has checked, and
declines (the executor then validates) whatever it cannot vouch for."""
from __future__ import annotations

import pydantic
import pytest

from mtflow.core.protocol import OutputBuilder, RolloutOutput, make_choice, make_response


def fields(response):
    return dict(response=response,
                messages=[{'role': 'user', 'content': 'q'}, {'role': 'assistant', 'content': [1, 2]}],
                response_token_ids=[[1, 2], [3]], response_loss_mask=[[1, 1], [0]],
                rollout_infos={'num_turns': 2, 'x': [1]}, rollout_logprobs=[[-.1, -.2]])


def test_mtflow_output_is_identical_to_the_validated_one():
    f = fields(make_response(make_choice('hi', [1], [-.1])))
    built, validated = OutputBuilder(RolloutOutput).build(f), RolloutOutput(**f)
    assert built.model_dump() == validated.model_dump()
    assert built.model_fields_set == validated.model_fields_set and built.__pydantic_extra__ == {}
    assert built.messages is not f['messages'] and built.messages[0] is not f['messages'][0]  # copied, as validation


def test_swift_output_is_identical_to_the_validated_one():
    sp = pytest.importorskip('swift.infer_engine.protocol')
    from mtflow.integrations.swift import to_swift
    f = fields(to_swift(make_response(make_choice('hi', [1], [-.1]))))
    built, validated = OutputBuilder(sp.RolloutOutput).build(f), sp.RolloutOutput(**f)
    assert type(built) is sp.RolloutOutput and built.model_dump() == validated.model_dump()


def test_it_declines_what_it_cannot_vouch_for():
    b = OutputBuilder(RolloutOutput)
    response = make_response(make_choice('hi'))
    assert b.build({**fields(response), 'response': object()}) is None  # another response type
    assert b.build({**fields(response), 'rollout_infos': {1: 'x'}}) is None  # keys validation would reject
    assert b.build({**fields(response), 'messages': [('user', 'q')]}) is None

    class Checked(RolloutOutput):

        @pydantic.model_validator(mode='after')
        def check(self):
            return self

    assert not OutputBuilder(Checked).ok
    assert not OutputBuilder(dict).ok
