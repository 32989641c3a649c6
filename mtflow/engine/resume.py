"""Interruptible generation: a generation cut by a weight update goes on from its exact ids.

AReaL's interruptible rollouts abort the generations in flight when the weights change and
continue each one under the new weights from the tokens it had, instead of throwing them away.
A stream does that with ``on_update='resume'`` over a ``rollout_fn`` that says it can
(``resumable = True``, an attribute of the ``rollout_fn`` or of the backend under its wrappers).
The contract, for one-request async calls:

1. **abort**: the driver cancels the call's task. A resumable ``rollout_fn`` catches the
   cancellation and raises :class:`GenerationAborted` with an output holding what it generated so
   far (``token_ids``, ``logprobs``, ``message.content``; possibly nothing);
2. **resume**: the driver issues the same request again, its prompt unchanged, with
   ``max_tokens`` reduced by the ids already generated; during that call :func:`current_prefix`
   returns the :class:`ResumeFrom` (the segments so far), and the ``rollout_fn`` generates the
   continuation *after* the prefix's ids and returns only the new tokens (an engine that takes
   token prompts appends ``prefix.ids`` to the prompt ids; a chat server continues the final
   assistant message);
3. **merge**: when the turn's last segment arrives, :func:`merged_output` joins the segments into
   the turn's one output (ids, logprobs and text concatenated, the last segment's finish reason),
   which the handlers apply as any other. The turn is stamped with its oldest segment's version
   (``rollout_infos['policy_versions']``, as a generation kept across an update is), and its
   sub-segments with their versions go to ``rollout_infos['policy_version_segments']``
   (``[{'turn': t, 'segments': [[start, end, version], ...]}]``, spans in the turn's sampled
   ids) and, with a token record, to ``TokenTurn.segments``.

The prefix is passed in a context variable, not on the request or the request config, so that
nothing of it can leak into a request that is dumped or into sampling parameters sent to a server.
"""
from __future__ import annotations

import contextvars
import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from mtflow.core.errors import MtflowError
from mtflow.core.protocol import extract_logprobs

__all__ = ['GenerationAborted', 'Segment', 'ResumeFrom', 'current_prefix', 'set_prefix', 'reset_prefix',
           'is_resumable', 'segment_of', 'merged_output', 'version_spans', 'SEGMENTS_KEY']

#: the ``rollout_infos`` key of the resumed turns' version segments
SEGMENTS_KEY = 'policy_version_segments'

_PREFIX: 'contextvars.ContextVar[Optional[ResumeFrom]]' = contextvars.ContextVar('mtflow_resume_prefix',
                                                                                 default=None)


class GenerationAborted(MtflowError):
    """Raised by a resumable ``rollout_fn`` whose call was cancelled: ``output`` is the one
    request's output so far (a ``RolloutOutput``, or a list of one), ``None`` for nothing."""

    def __init__(self, output: Any = None) -> None:
        super().__init__('generation aborted')
        self.output = output


@dataclass
class Segment:
    """What one call generated of a turn, and the version that sampled it."""
    ids: List[int]
    logprobs: Optional[List[float]]
    text: str
    version: Optional[int]
    logprob_items: Optional[List[Dict[str, Any]]] = None  # the OpenAI-shaped items, kept whole


@dataclass
class ResumeFrom:
    """The segments a turn has so far; a resumable ``rollout_fn`` continues after :attr:`ids`."""
    segments: List[Segment] = field(default_factory=list)

    @property
    def ids(self) -> List[int]:
        return [i for s in self.segments for i in s.ids]

    @property
    def text(self) -> str:
        return ''.join(s.text for s in self.segments)

    def __len__(self) -> int:
        return sum(len(s.ids) for s in self.segments)


def current_prefix() -> Optional[ResumeFrom]:
    """The prefix the current ``rollout_fn`` call continues, or ``None`` (a fresh generation)."""
    return _PREFIX.get()


def set_prefix(prefix: Optional[ResumeFrom]) -> Any:
    """Set the prefix of the call about to be made in this task; returns the reset token."""
    return _PREFIX.set(prefix)


def reset_prefix(token: Any) -> None:
    """Undo :func:`set_prefix` (the tasks created meanwhile keep their copy)."""
    _PREFIX.reset(token)


def is_resumable(rollout_fn: Any) -> bool:
    """``resumable = True`` on the ``rollout_fn``, or on the backend under its wrappers
    (``__wrapped__``, a bound method's object)."""
    fn = rollout_fn
    for _ in range(8):
        if fn is None:
            return False
        if getattr(fn, 'resumable', False) is True:
            return True
        fn = fn.__self__ if inspect.ismethod(fn) else getattr(fn, '__wrapped__', None)
    return False


def _choice(output: Any) -> Any:
    if isinstance(output, (list, tuple)):
        output = output[0] if len(output) == 1 else None
    response = getattr(output, 'response', output)
    choices = getattr(response, 'choices', None)
    return choices[0] if choices else None


def segment_of(output: Any, version: Optional[int]) -> Segment:
    """The segment an aborted call had produced (``GenerationAborted.output``); empty when it
    produced nothing or nothing readable."""
    choice = _choice(output)
    if choice is None:
        return Segment([], None, '', version)
    ids = list(getattr(choice, 'token_ids', None) or [])
    lp = getattr(choice, 'logprobs', None)
    items = list(lp.get('content') or []) if isinstance(lp, dict) else None
    logprobs = extract_logprobs(choice) if items else None
    text = getattr(getattr(choice, 'message', None), 'content', None) or ''
    return Segment(ids, logprobs, text, version, items)


def merged_output(prefix: ResumeFrom, outputs: Any) -> Any:
    """The turn's one output: ``outputs`` (the last call's, a list of one) with the prefix's
    ids, logprobs and text in front; the last call's finish reason. Returned as a list of one,
    as the call returned it; unchanged when it is not one readable output."""
    if not isinstance(outputs, (list, tuple)) or len(outputs) != 1:
        return outputs
    output = outputs[0]
    choice = _choice(output)
    if choice is None:
        return outputs
    own_ids = getattr(choice, 'token_ids', None)
    ids = prefix.ids + list(own_ids or []) if (own_ids is not None or prefix.ids) else None
    lp = getattr(choice, 'logprobs', None)
    logprobs = lp
    if all(s.logprob_items is not None for s in prefix.segments) and (lp is None or isinstance(lp, dict)):
        own = list((lp or {}).get('content') or [])
        items = [item for s in prefix.segments for item in (s.logprob_items or [])] + own
        logprobs = {**(lp or {}), 'content': items} if items else lp
    message = choice.message.model_copy(update={'content': prefix.text + (choice.message.content or '')})
    new_choice = choice.model_copy(update={'token_ids': ids, 'logprobs': logprobs, 'message': message})
    response = output.response
    update: Dict[str, Any] = {'choices': [new_choice] + list(response.choices[1:])}
    if response.usage is not None:
        usage = response.usage
        completion = usage.completion_tokens + len(prefix)
        update['usage'] = usage.model_copy(update={'completion_tokens': completion,
                                                   'total_tokens': usage.prompt_tokens + completion})
    return [output.model_copy(update={'response': response.model_copy(update=update)})]


def version_spans(prefix: ResumeFrom, last_len: int, last_version: Optional[int]) -> List[List[Any]]:
    """``[[start, end, version], ...]`` of a resumed turn's sampled ids, oldest first."""
    spans, start = [], 0
    for seg in prefix.segments:
        if seg.ids:
            spans.append([start, start + len(seg.ids), seg.version])
            start += len(seg.ids)
    if last_len:
        spans.append([start, start + last_len, last_version])
    return spans
