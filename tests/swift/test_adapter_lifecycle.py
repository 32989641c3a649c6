"""The ms-swift adapter's lifecycle: the mtflow scheduler's ``on_request_finished`` runs exactly
when ms-swift's driver finishes the request (also when the bound is the mtflow scheduler's own
``max_turns``), and ``on_trajectory_end`` is forwarded."""
from __future__ import annotations

from typing import Any, List

import mtflow
import mtflow.integrations.swift as integ
from tests.swift.swift_helpers import assert_same, run_both, sreq
from tests.tiny_model import make_tokenizer

TOK = make_tokenizer()


class OwnBound(mtflow.Scheduler):
    """Bounded by its own max_turns only: check_finished never says stop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get('max_turns') is None:  # its own bound, unless ms-swift passes one
            kwargs['max_turns'] = 2
        super().__init__(*args, **kwargs)
        self.closed: List[tuple] = []
        self.ended: List[tuple] = []

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        return False

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Any:
        infer_request.messages.append({'role': 'user', 'content': f'go on ({current_turn})'})
        return {'infer_request': infer_request}

    def on_request_finished(self, infer_request: Any, reason: str, turn: int) -> None:
        self.closed.append((infer_request.uuid, reason, turn))

    def on_trajectory_end(self, requests: List[Any], error: Any) -> None:
        self.ended.append(([r.uuid for r in requests], error))


SCRIPT = {'a': ['x', 'y', 'z', 'w'], 'b': ['x', 'y', 'z', 'w']}


def test_the_driver_finishes_when_the_inner_scheduler_is_told_it_finished() -> None:
    # ms-swift builds the adapter with max_turns=None (args.max_turns unset) and calls its driver
    # with max_turns=None: the mtflow scheduler's own max_turns=2 is the only bound.
    Adapter = integ.as_swift_scheduler(OwnBound)
    res = run_both(lambda: Adapter(max_turns=None, tokenizer=TOK), lambda: [sreq('a'), sreq('b')], SCRIPT)
    assert_same(res)
    for name in ('swift', 'mtflow'):
        inner = res[name]['scheduler'].inner
        assert sorted(inner.closed) == [('a', 'max_turns', 2), ('b', 'max_turns', 2)], name
        assert [o.rollout_infos['num_turns'] for o in res[name]['outputs']] == [2, 2], name
        assert [o.rollout_infos[integ.FINISH_REASON_KEY] for o in res[name]['outputs']] == ['max_turns'] * 2


def test_on_trajectory_end_is_forwarded_under_mtflows_executor() -> None:
    Adapter = integ.as_swift_scheduler(OwnBound)
    res = run_both(lambda: Adapter(max_turns=None, tokenizer=TOK), lambda: [sreq('a'), sreq('b')], SCRIPT)
    assert res['mtflow']['scheduler'].inner.ended == [(['a', 'b'], None)]
    assert res['swift']['scheduler'].inner.ended == []  # ms-swift 4.6's driver has no such hook
