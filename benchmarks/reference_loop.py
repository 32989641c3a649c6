"""A plain multi-turn loop written from the contract (``docs/contract.md``), list-based like the
original driver. It is the yardstick for ``benchmarks/overhead.py`` and the oracle of the
differential property tests; it is not used by mtflow itself.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, List, Optional


def _logprobs_of(choice: Any) -> List[float]:
    lp = choice.logprobs
    if lp is None or 'content' not in lp:
        return []
    return [item['logprob'] for item in lp['content']]


def _drive_directly(coros: List[Any]) -> List[Any]:
    """The benchmark's hooks never suspend; this yardstick does not handle those that do."""
    values = []
    for coro in coros:
        try:
            coro.send(None)
        except StopIteration as stop:
            values.append(stop.value)
        else:
            coro.close()
            raise RuntimeError("drive='direct' is for hooks that complete without suspending")
    return values


def reference_run_multi_turn(requests: List[Any],
                             first_turn_outputs: List[Any],
                             scheduler: Any,
                             rollout_fn: Callable,
                             request_config: Any,
                             max_turns: Optional[int] = None,
                             gather_fn: Callable[[List[bool]], List[bool]] = lambda v: list(v),
                             drive: str = 'gather') -> List[Any]:
    """``drive='gather'``: ``on_turn_end`` coroutines are gathered on an event loop, as the
    contract's driver does. ``drive='direct'``: each one is driven by ``send(None)`` (the hook must
    not suspend), which is what mtflow does first, and outputs are built without validation
    (``model_construct``), as mtflow builds them. That variant is the floor of the overhead
    benchmark: the contract's bookkeeping, with no loop cost, no checks and no trace."""
    loop = asyncio.new_event_loop()
    try:
        n = len(requests)
        results: List[Any] = [None] * n
        infos: List[dict] = [{} for _ in range(n)]
        seg_ids: List[list] = [[] for _ in range(n)]
        seg_mask: List[list] = [[] for _ in range(n)]
        seg_lps: List[list] = [[] for _ in range(n)]
        cont = [False] * n
        pending = list(range(n))
        outputs = first_turn_outputs
        turn = 1
        out_cls = type(first_turn_outputs[0]) if first_turn_outputs else None
        make_output = out_cls if drive == 'gather' else getattr(out_cls, 'model_construct', out_cls)
        while True:
            local = len(pending) > 0
            if not any(gather_fn([local])):
                break
            for i, out in zip(pending, outputs):
                msgs = requests[i].messages
                if msgs[-1]['content'] is None and msgs[-1]['role'] == 'assistant':
                    msgs.pop()
                text = out.response.choices[0].message.content
                if msgs[-1]['role'] == 'assistant':
                    msgs[-1]['content'] += text
                    cont[i] = True
                else:
                    msgs.append({'role': 'assistant', 'content': text})
                    cont[i] = False
            live_reqs = [requests[i] for i in pending]

            async def hooks():
                return await asyncio.gather(*[
                    scheduler.on_turn_end(r, o.response.choices[0], turn) for r, o in zip(live_reqs, outputs)])

            ends = loop.run_until_complete(hooks()) if drive == 'gather' else _drive_directly(
                [scheduler.on_turn_end(r, o.response.choices[0], turn) for r, o in zip(live_reqs, outputs)])
            for i, tr in zip(pending, ends):
                if tr.get('rollout_infos'):
                    infos[i].update(tr['rollout_infos'])
            stops = []
            for tr, r, o in zip(ends, live_reqs, outputs):
                checked = scheduler.check_finished(r, o.response.choices[0], turn)
                stops.append(tr['done'] if 'done' in tr else checked)
            nxt = []
            for stop, i, out in zip(stops, pending, outputs):
                if max_turns:
                    stop = stop or turn >= max_turns
                choice = out.response.choices[0]
                if stop:
                    ids = choice.token_ids
                    lps = _logprobs_of(choice)
                    if cont[i] and seg_ids[i]:
                        seg_ids[i][-1].extend(ids)
                        if seg_mask[i]:
                            seg_mask[i][-1].extend([1] * len(ids))
                        if seg_lps[i] and lps:
                            seg_lps[i][-1].extend(lps)
                    elif not seg_ids[i]:
                        if ids:
                            seg_ids[i] = [list(ids)]
                            seg_mask[i] = [[1] * len(ids)]
                        if lps:
                            seg_lps[i] = [lps]
                    else:
                        if ids:
                            seg_ids[i].append(list(ids))
                            seg_mask[i].append([1] * len(ids))
                        if lps:
                            seg_lps[i].append(lps)
                    kept = seg_lps[i]
                    if kept:
                        total = sum(len(s) for s in kept)
                        if seg_mask[i]:
                            if total != sum(sum(s) for s in seg_mask[i]):
                                kept = []
                        elif seg_ids[i]:
                            if total != sum(len(s) for s in seg_ids[i]):
                                kept = []
                        else:
                            kept = []
                    results[i] = make_output(
                        response=out.response,
                        messages=requests[i].messages,
                        response_token_ids=seg_ids[i],
                        response_loss_mask=seg_mask[i],
                        rollout_infos={
                            **infos[i], 'num_turns': turn
                        },
                        rollout_logprobs=kept)
                    continue
                res = scheduler.step(requests[i], choice, turn)
                new_req = res['infer_request']
                if 'response_token_ids' in res:
                    if cont[i] and seg_ids[i]:
                        seg_ids[i][-1].extend(res['response_token_ids'])
                    else:
                        seg_ids[i].append(list(res['response_token_ids']))
                if 'response_loss_mask' in res:
                    assert 'response_token_ids' in res
                    assert len(res['response_loss_mask']) == len(res['response_token_ids'])
                    if cont[i] and seg_mask[i]:
                        seg_mask[i][-1].extend(res['response_loss_mask'])
                    else:
                        seg_mask[i].append(list(res['response_loss_mask']))
                if 'rollout_infos' in res:
                    infos[i].update(res['rollout_infos'])
                lps = res.get('rollout_logprobs') or _logprobs_of(choice)
                if lps:
                    if cont[i] and seg_lps[i]:
                        seg_lps[i][-1].extend(lps)
                    else:
                        seg_lps[i].append(list(lps))
                requests[i] = new_req
                nxt.append(i)
            turn += 1
            outputs = rollout_fn([requests[i] for i in nxt] if local else [], request_config)
            pending = nxt
        return results
    finally:
        loop.close()
