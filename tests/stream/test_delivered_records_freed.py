"""A delivered group's records are freed by reference counting: no cycle (record <-> its group)
is left for the cyclic collector, whose full passes over a long stream's garbage (a gateway's
thousands of sessions) pause every thread of the process."""
from __future__ import annotations

import gc

from mtflow import Executor, Scheduler
from mtflow.core.machine import RequestRecord
from tests.helpers import out, req


class TwoTurns(Scheduler):
    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'again'})
        return {'infer_request': infer_request}


def rollout(requests, request_config=None):
    return [out('ok', [1, 2]) for _ in requests]


def test_no_record_of_a_delivered_group_is_cyclic_garbage():
    source = [[req(f'g{k}-a'), req(f'g{k}-b')] for k in range(20)]
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        groups = list(Executor(TwoTurns(max_turns=2), rollout).stream(iter(source), max_concurrency=4))
        assert len(groups) == 20 and all(g.finish_reasons == ['max_turns'] * 2 for g in groups)
        del groups
        gc.collect()
        left = [o for o in gc.garbage if isinstance(o, RequestRecord)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()
    # at most the last wake-up's completions (a list the driver's finished wait task still holds), not
    # one cycle per delivered group: 40 records before the link was cut
    assert len(left) <= 4, f'{len(left)} records of delivered groups left as cyclic garbage'
