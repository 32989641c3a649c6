"""Swift46Accounting where ms-swift 4.6's driver fails: bad masks become errors naming the request,
turn and field, the record is left untouched, the other requests finish; and nothing imports
ms-swift at ``import mtflow`` time."""
from __future__ import annotations

import subprocess
import sys
from typing import Any, Dict

import pytest
from swift.rollout.agent_loop import run_multi_turn as swift_run
from swift.rollout.multi_turn import MultiTurnScheduler

import mtflow
from mtflow.core.errors import SchedulerResultError
from mtflow.accounting.swift46 import Swift46Accounting
from tests.swift.swift_helpers import ScriptedSwift, sreq
from tests.tiny_model import make_tokenizer

TOK = make_tokenizer()


class BadMask(MultiTurnScheduler):
    """Returns a loss mask one value short for request 'bad'; 'ok' goes on normally."""

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        infer_request.messages.append({'role': 'user', 'content': 'more'})
        result: Dict[str, Any] = {'infer_request': infer_request}
        if infer_request.uuid == 'bad':
            ids = list(response_choice.token_ids)
            result.update(response_token_ids=ids, response_loss_mask=[1] * (len(ids) - 1))
        return result


def run(driver: Any, sched: Any) -> Any:
    reqs = [sreq('bad'), sreq('ok')]
    rollout = ScriptedSwift({'bad': ['one two', 'x'], 'ok': ['three four', 'y']}, tokenizer=TOK)
    return driver(reqs, rollout.first(reqs), sched, rollout, None, 2)


def test_bad_step_mask_fails_only_that_request() -> None:
    with pytest.raises(AssertionError, match='same length'):
        run(swift_run, BadMask(tokenizer=TOK))  # ms-swift: a bare assert loses the batch
    with pytest.raises(mtflow.MultiTurnRolloutError) as info:
        run(mtflow.run_multi_turn, BadMask(tokenizer=TOK))
    (failure, ) = info.value.failures
    err = failure.error
    assert isinstance(err, SchedulerResultError)
    assert (err.uuid, err.turn, err.field) == ('bad', 1, 'response_loss_mask')
    bad, ok = info.value.outputs
    assert bad.rollout_infos['mtflow_error']['phase'] == 'step'
    assert bad.response_token_ids == []  # untouched: nothing half-applied
    assert ok.rollout_infos['num_turns'] == 2 and len(ok.response_token_ids) == 2


class BadTurnEnd(MultiTurnScheduler):

    async def on_turn_end(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        if infer_request.uuid == 'bad':
            return {'done': True, 'response_token_ids': [1, 2], 'response_loss_mask': [1]}
        return {'done': True}

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        raise AssertionError('not reached: every request stops at turn 1')


def test_bad_on_turn_end_mask_at_stop() -> None:
    with pytest.raises(AssertionError):
        run(swift_run, BadTurnEnd(tokenizer=TOK))
    with pytest.raises(mtflow.MultiTurnRolloutError) as info:
        run(mtflow.run_multi_turn, BadTurnEnd(tokenizer=TOK))
    (failure, ) = info.value.failures
    assert failure.phase == 'finalize' and failure.uuid == 'bad'
    assert failure.error.field == 'response_loss_mask'
    assert info.value.outputs[1].rollout_infos == {'num_turns': 1}


def test_needs_the_46_methods() -> None:
    with pytest.raises(TypeError, match='append_assistant_completion'):
        Swift46Accounting(mtflow.Scheduler())


def test_import_mtflow_does_not_import_swift() -> None:
    code = ('import sys, mtflow, mtflow.integrations, mtflow.accounting.swift46, '
            'mtflow.backends.swift_engine; print(any(m == "swift" or m.startswith("swift.") for m in sys.modules))')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == 'False'
