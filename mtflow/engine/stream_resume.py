"""A stream's ``on_update='resume'``: a generation cut by an update goes on from its exact ids.

The contract with a resumable ``rollout_fn`` (abort, resume, merge) is
:mod:`mtflow.engine.resume`'s; this module is the stream driver's side of it:

* **cut**: the call raised :class:`~mtflow.engine.resume.GenerationAborted`; what it generated
  becomes a segment of the turn, with the version that sampled it, and the request is issued
  again under the new version (or wound down, when its group is now too stale);
* **re-issue**: during the next call :func:`~mtflow.engine.resume.current_prefix` gives the
  segments so far, and ``max_tokens`` is lowered by their ids;
* **merge**: the last segment's output is joined with the prefix into the turn's one output,
  stamped with its oldest segment's version; the per-segment spans go to
  ``rollout_infos['policy_version_segments']`` (and the token record's ``TokenTurn.segments``).

:class:`Resumption` holds these rules, over what a record keeps of its cut turn
(``record.resume_from``, ``record.resumed_spans``); the stream driver holds one and decides when
each applies (it restores the token record, winds a doomed group down, issues the call again).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from mtflow.core.calls import OK, Outcome
from mtflow.core.machine import RequestRecord
from mtflow.accounting.token_record import RECORD_ATTR
from mtflow.engine.context import with_max_tokens
from mtflow.engine.resume import (SEGMENTS_KEY, GenerationAborted, ResumeFrom, merged_output, reset_prefix,
                                  segment_of, set_prefix, version_spans)

__all__ = ['Resumption']


class Resumption:
    """A stream's ``on_update='resume'`` rules (see the module docstring), held by its driver;
    everything per request is on the request's record."""

    @contextlib.contextmanager
    def prefixed(self, rec: RequestRecord) -> Iterator[None]:
        """Around issuing ``rec``'s call: the call's task copies the context, so it sees the
        prefix of a cut turn (none for a fresh one)."""
        prefix = rec.resume_from
        if prefix is None:
            yield
            return
        token = set_prefix(prefix)
        try:
            yield
        finally:
            reset_prefix(token)

    @staticmethod
    def call_config(rec: RequestRecord, config: Any) -> Any:
        """A resumed generation's ``max_tokens``: what is left after the ids it already has."""
        prefix = rec.resume_from
        if prefix is None:
            return config
        limit = config.get('max_tokens') if isinstance(config, dict) else getattr(config, 'max_tokens', None)
        if not isinstance(limit, int) or isinstance(limit, bool):
            return config  # the backend's own default: it is told the prefix, it knows its limit
        return with_max_tokens(config, max(1, limit - len(prefix)))

    @staticmethod
    def cut(rec: RequestRecord, aborted: GenerationAborted) -> None:
        """A generation cut by an update: keep what it generated as a segment of the turn, with
        the version that sampled it (the driver then issues the rest under the new version)."""
        if rec.resume_from is None:
            rec.resume_from = ResumeFrom()
        rec.resume_from.segments.append(segment_of(aborted.output, rec.issued_version))

    @staticmethod
    def merge(rec: RequestRecord, outcome: Outcome) -> Outcome:
        """The last segment of a resumed turn arrived: the turn's one output, stamped with its
        oldest segment's version; the segments' spans are recorded when it is applied
        (:meth:`applied`)."""
        prefix, rec.resume_from = rec.resume_from, None
        merged = merged_output(prefix, outcome.value)
        last = rec.issued_version
        own = len(merged[0].response.choices[0].token_ids or []) - len(prefix) if merged is not outcome.value else 0
        rec.resumed_spans = version_spans(prefix, own, last)
        # the version of the turn's first sampled token: a segment cut before it had any ids
        # (an update right after the call went out) sampled nothing, so its version is not the turn's
        oldest = next((seg.version for seg in prefix.segments if seg.ids and seg.version is not None), None)
        if oldest is not None:
            rec.issued_version = oldest
        return Outcome(OK, merged, outcome.duration)

    @staticmethod
    def applied(rec: RequestRecord, turn: int) -> None:
        """A merged turn's output was handed to ``rec``: its per-segment spans go to
        ``rollout_infos['policy_version_segments']`` and the token record's last turn."""
        spans, rec.resumed_spans = rec.resumed_spans, None
        if spans is None:
            return
        rec.infos.setdefault(SEGMENTS_KEY, []).append({'turn': turn, 'segments': spans})
        record = getattr(rec.request, RECORD_ATTR, None)
        turns = getattr(record, 'turns', None)
        if turns:
            turns[-1].segments = spans
