"""Builders for the ms-swift tests: ms-swift's own request/output types, a scripted ``rollout_fn``
whose outputs carry a real tokenizer's ids and logprobs, and a field-by-field dump.

Everything here uses the installed ms-swift package (``swift``), never a stand-in."""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence

from swift.infer_engine.protocol import (ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage,
                                         RolloutInferRequest, RolloutOutput, UsageInfo)

from tests.tiny_model import make_tokenizer


def sreq(uuid: str, *messages: Dict[str, Any], **kw: Any) -> RolloutInferRequest:
    msgs = list(messages) or [{'role': 'user', 'content': f'question {uuid}'}]
    return RolloutInferRequest(messages=[dict(m) for m in msgs], uuid=uuid, **kw)


def sout(text: str, uuid: str, n: int, *, tokenizer: Any = None, logprobs: bool = True,
         finish_reason: Optional[str] = 'stop', ids: Optional[List[int]] = None) -> RolloutOutput:
    """One ms-swift output for ``text``: the tokenizer's ids, one logprob per id (deterministic),
    and a deterministic response id so two runs can be compared field by field."""
    tok = tokenizer or make_tokenizer()
    token_ids = list(tok.encode(text, add_special_tokens=False)) if ids is None else list(ids)
    lp = None
    if logprobs:
        lp = {'content': [{'token': tok.decode([t]), 'logprob': -0.01 * (k + 1), 'bytes': None, 'top_logprobs': []}
                          for k, t in enumerate(token_ids)]}
    choice = ChatCompletionResponseChoice(
        index=0,
        message=ChatMessage(role='assistant', content=text),
        finish_reason=finish_reason,
        logprobs=lp,
        token_ids=token_ids)
    response = ChatCompletionResponse(
        model='scripted',
        choices=[choice],
        usage=UsageInfo(prompt_tokens=0, completion_tokens=len(token_ids), total_tokens=len(token_ids)),
        id=f'chatcmpl-{uuid}-{n}',
        created=0)
    return RolloutOutput(response=response)


class ScriptedSwift:
    """``rollout_fn`` answering request ``uuid``'s n-th call with ``script[uuid][n-1]`` (a text, or
    a ``(text, finish_reason)`` pair). Records each call's uuids and the messages it was sent."""

    def __init__(self, script: Dict[str, Sequence[Any]], tokenizer: Any = None, logprobs: bool = True) -> None:
        self.script = {k: list(v) for k, v in script.items()}
        self.tokenizer = tokenizer or make_tokenizer()
        self.logprobs = logprobs
        self.counts: Dict[str, int] = {}
        self.calls: List[List[str]] = []
        self.sent: List[List[Any]] = []

    def first(self, requests: List[Any]) -> List[RolloutOutput]:
        """The first turn's outputs (what the trainer generates before the loop)."""
        return self(requests, None, record=False)

    def __call__(self, requests: List[Any], request_config: Any, record: bool = True) -> List[RolloutOutput]:
        if record:
            self.calls.append([r.uuid for r in requests])
            self.sent.append([copy.deepcopy(r.messages) for r in requests])
        outs = []
        for r in requests:
            n = self.counts.get(r.uuid, 0)
            self.counts[r.uuid] = n + 1
            item = self.script[r.uuid][n]
            text, reason = (item, 'stop') if isinstance(item, str) else item
            outs.append(sout(text, r.uuid, n, tokenizer=self.tokenizer, logprobs=self.logprobs, finish_reason=reason))
        return outs


def dump(obj: Any) -> Any:
    """A plain, comparable form of outputs/requests (pydantic models and dataclasses alike)."""
    if isinstance(obj, list):
        return [dump(o) for o in obj]
    if hasattr(obj, 'model_dump'):
        return obj.model_dump(mode='python')
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    return obj


def run_both(make_scheduler: Callable[[], Any], make_requests: Callable[[], List[Any]], script: Dict[str, list],
             max_turns: Optional[int] = None, prepare: Optional[Callable[[Any, List[Any]], None]] = None,
             gather_fn: Any = None, tokenizer: Any = None, logprobs: bool = True) -> Dict[str, Any]:
    """Run ms-swift's installed ``run_multi_turn`` and mtflow's on identical inputs (fresh
    scheduler, fresh requests, fresh script each); return both outputs, final requests and the
    rollout_fn calls."""
    from swift.rollout.agent_loop import run_multi_turn as swift_run

    import mtflow

    results = {}
    for name, driver in (('swift', swift_run), ('mtflow', mtflow.run_multi_turn)):
        scheduler = make_scheduler()
        requests = make_requests()
        if prepare is not None:
            prepare(scheduler, requests)
        rollout = ScriptedSwift(copy.deepcopy(script), tokenizer=tokenizer, logprobs=logprobs)
        first = rollout.first(requests)
        kwargs = {} if gather_fn is None else {'gather_fn': gather_fn}
        outputs = driver(requests, first, scheduler, rollout, None, max_turns, **kwargs)
        results[name] = {'outputs': outputs, 'requests': requests, 'calls': rollout.calls, 'sent': rollout.sent,
                         'scheduler': scheduler}
    return results


def assert_same(results: Dict[str, Any]) -> None:
    s, m = results['swift'], results['mtflow']
    assert all(type(o).__module__.startswith('swift.') for o in m['outputs']), 'mtflow must build ms-swift outputs'
    assert dump(m['outputs']) == dump(s['outputs'])
    assert dump(m['requests']) == dump(s['requests'])
    assert m['calls'] == s['calls']
    assert m['sent'] == s['sent']
