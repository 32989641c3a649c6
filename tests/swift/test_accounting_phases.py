"""A per-request failure in ms-swift 4.6's materialize phase fails that request only, on mtflow's
executor (ms-swift's own driver would leave the turn half done); the 4.6 accounting lives in the
core and is re-exported by the integration."""
from __future__ import annotations

from typing import Any, Dict

import pytest
from swift.rollout.multi_turn import MultiTurnScheduler

import mtflow
from mtflow.accounting import accounting_for
from tests.swift.swift_helpers import ScriptedSwift, sreq
from tests.tiny_model import make_tokenizer

TOK = make_tokenizer()


class Snap(MultiTurnScheduler):
    """Decoding id-backed messages fails for request 'bad' at turn 2."""

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        infer_request.messages.append({'role': 'user', 'content': 'more'})
        return {'infer_request': infer_request}

    def snapshot_and_materialize_assistant_messages(self, infer_request: Any) -> Any:
        snapshot = super().snapshot_and_materialize_assistant_messages(infer_request)
        if infer_request.uuid == 'bad' and len(infer_request.messages) > 2:
            raise UnicodeDecodeError('utf-8', b'\xff', 0, 1, 'bad ids')
        return snapshot


def test_a_materialize_failure_fails_that_request_only() -> None:
    reqs = [sreq('bad'), sreq('ok')]
    rollout = ScriptedSwift({'bad': ['one', 'two', 'x'], 'ok': ['three', 'four', 'y']}, tokenizer=TOK)
    with pytest.raises(mtflow.MultiTurnRolloutError) as info:
        mtflow.run_multi_turn(reqs, rollout.first(reqs), Snap(tokenizer=TOK), rollout, None, 3)
    (failure, ) = info.value.failures
    assert (failure.uuid, failure.turn, failure.phase) == ('bad', 2, 'materialize')
    bad, ok = info.value.outputs
    assert bad.rollout_infos['mtflow_error']['phase'] == 'materialize'
    assert ok.rollout_infos['num_turns'] == 3 and len(ok.response_token_ids) == 3


def test_the_46_accounting_lives_in_the_core_and_is_re_exported() -> None:
    import mtflow.accounting.swift46 as core
    import mtflow.accounting.swift46 as integ
    assert integ.Swift46Accounting is core.Swift46Accounting
    assert isinstance(accounting_for(Snap(tokenizer=TOK)), core.Swift46Accounting)
    assert type(accounting_for(mtflow.Scheduler())).__name__ == 'ContractAccounting'
