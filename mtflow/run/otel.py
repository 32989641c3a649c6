"""OpenTelemetry traces of a rollout, built from mtflow's own trace events (``docs/telemetry.md``).

mtflow's trace (``core/trace.py``, ``trace.jsonl``) stays the source: the viewer reads it, and
the engine records it whatever happens here. This outer-layer module turns each finished
request's events into spans through the OpenTelemetry SDK, so a fleet's rollouts show up in
Jaeger or Grafana Tempo next to the servers' own traces. One request is one trace:

=================  =================================================================================
span               attributes (``mtflow.*``)
=================  =================================================================================
``request``        uuid, index, finish_reason, turns, reward, group, error (root; ERROR status when
                   the request failed)
``turn``           turn (one per turn, from its generation to the next one)
``model_call``     turn, tokens, replica, prompt_tokens, cached_tokens, moves (the OpenAI
                   backend's serving log), trigger
``env_step``       turn, duration_s, tool_calls, tool_errors (the scheduler's ``step``: tools,
                   environment)
``tool_call``      tool, ok, error_kind, duration_s (a child of the step, one per call)
``compaction``     turn, policy, prompt_tokens_before, prompt_tokens_after, segment (the training
                   segment that begins after it), outcome (the state it left to: ``generating``,
                   ``continuing``, or ``finished`` when it could not make the prompt fit), fits,
                   changed (the ``compacting`` state of a context budget, ``docs/context.md``)
other moves        a span named by the trigger (an interrupt) with its extra
=================  =================================================================================

Times are the events' (seconds since the run started) on the run's wall clock. Nothing is
imported or computed when telemetry is off: ``mtflow run`` without ``--otel`` never builds an
exporter. The SDK is imported here only (``pip install 'mtflow[otel]'``).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from mtflow.core.errors import UserError

__all__ = ['OtelExporter', 'make_exporter', 'OtelError']

_GEN_STATES = ('generating', 'continuing')


class OtelError(UserError):
    """``--otel`` cannot be used (the SDK is not installed, an unknown target)."""


def _sdk() -> Any:
    try:
        from opentelemetry.sdk import trace as sdk_trace
        from opentelemetry.sdk.resources import Resource
    except ImportError as exc:
        raise OtelError("--otel needs the OpenTelemetry SDK: pip install 'mtflow[otel]' "
                        '(opentelemetry-sdk==1.45.2)') from exc
    return sdk_trace, Resource


class _JsonLinesExporter:
    """A span exporter that appends each span as one JSON line (the SDK's ``Span.to_json``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fh = open(path, 'a', encoding='utf-8')

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        for span in spans:
            self.fh.write(span.to_json(indent=None) + '\n')
        self.fh.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.fh.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self.fh.flush()
        return True


def make_exporter(target: str, service_name: str = 'mtflow') -> 'OtelExporter':
    """The exporter for ``--otel TARGET``: ``otlp`` (OTLP over HTTP to
    ``$OTEL_EXPORTER_OTLP_ENDPOINT``, default ``http://localhost:4318``), ``otlp=URL``, or a
    ``.json``/``.jsonl`` file (one span per line)."""
    sdk_trace, _ = _sdk()
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    if target == 'otlp' or target.startswith('otlp='):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise OtelError("--otel otlp needs the OTLP exporter: pip install "
                            "'opentelemetry-exporter-otlp-proto-http==1.45.2'") from exc
        endpoint = target[len('otlp='):] or None
        if endpoint and not endpoint.rstrip('/').endswith('/v1/traces'):
            endpoint = endpoint.rstrip('/') + '/v1/traces'
        return OtelExporter(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)), service_name)
    if target.endswith(('.json', '.jsonl')):
        return OtelExporter(SimpleSpanProcessor(_JsonLinesExporter(target)), service_name)
    raise OtelError(f"--otel {target}: expected 'otlp', 'otlp=URL' or a .json/.jsonl file")


class OtelExporter:
    """Turns finished requests into traces on a private ``TracerProvider`` (the process's global
    one is left alone) with ``processor`` (any SDK span processor: batch OTLP, a file, the
    SDK's in-memory exporter in tests).

    ``mtflow run --otel`` calls :meth:`export_record` with each trajectory line and its events;
    in Python, pass :meth:`on_finished` to the executor
    (``Executor(..., on_finished=exporter.on_finished)``), or :meth:`wrap` your own callback."""

    def __init__(self, processor: Any, service_name: str = 'mtflow', start_unix: Optional[float] = None) -> None:
        sdk_trace, Resource = _sdk()
        self.provider = sdk_trace.TracerProvider(resource=Resource.create({'service.name': service_name}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer('mtflow')
        self.start_unix = start_unix
        self.exported = 0

    # ---- entry points ----------------------------------------------------------------------------
    def on_finished(self, finished: Any) -> None:
        """The executor's ``on_finished``: the request's trace from its events."""
        events = [e.to_dict() if hasattr(e, 'to_dict') else dict(e) for e in (getattr(finished, 'events', None) or ())]
        if self.start_unix is None and events:  # the events' clock: the run started `t` seconds ago
            self.start_unix = time.time() - max(float(e.get('t') or 0.0) for e in events)
        output = getattr(finished, 'output', None)
        infos = getattr(output, 'rollout_infos', None) or {}
        self.export_record({'uuid': finished.uuid, 'index': getattr(finished, 'index', None),
                            'finish_reason': getattr(finished, 'finish_reason', None),
                            'reward': infos.get('reward') if isinstance(infos, dict) else None}, events)

    def wrap(self, on_finished: Optional[Callable[[Any], None]] = None) -> Callable[[Any], None]:
        """An ``on_finished`` that exports, then calls yours."""

        def both(finished: Any) -> None:
            self.on_finished(finished)
            if on_finished is not None:
                on_finished(finished)

        return both

    def export_record(self, record: Dict[str, Any], events: Iterable[Dict[str, Any]]) -> None:
        """One request (a trajectory line's fields: uuid, finish_reason, reward, ...) and its
        trace events (dicts, ``trace.jsonl``'s shape) as one trace."""
        events = sorted(events, key=lambda e: float(e.get('t') or 0.0))
        if not events:
            return
        base = self.start_unix if self.start_unix is not None else time.time()
        ns = lambda t: int((base + float(t or 0.0)) * 1e9)  # noqa: E731
        first, last = events[0], events[-1]
        root = self.tracer.start_span('request', start_time=ns(first.get('t')), attributes=_clean({
            'mtflow.uuid': record.get('uuid'), 'mtflow.index': record.get('index'),
            'mtflow.finish_reason': record.get('finish_reason') or last.get('reason'),
            'mtflow.turns': record.get('num_turns', max(int(e.get('turn') or 0) for e in events)),
            'mtflow.reward': record.get('reward'), 'mtflow.group': record.get('group')}))
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        ctx = trace.set_span_in_context(root)
        turns: Dict[int, Any] = {}
        turn_ctx: Dict[int, Any] = {}
        open_at: Dict[str, Dict[str, Any]] = {}  # state -> the event that entered it
        error = None
        for e in events:
            turn = int(e.get('turn') or 0)
            src, dst, extra = e.get('from'), e.get('to'), e.get('extra') or {}
            # an event entering generation after turn t's step (turn t) starts turn t + 1; from
            # pending (or a compaction of the first prompt) it starts turn t itself
            first = src == 'pending' or (src == 'compacting' and (open_at.get('compacting') or {}).get('from')
                                         == 'pending')
            starts = turn if first else turn + 1
            if dst in _GEN_STATES and starts not in turns:
                prev = turns.get(starts - 1)
                if prev is not None:
                    prev.end(end_time=ns(e.get('t')))
                # a first turn whose prompt was compacted begins where the compaction did
                begun = open_at['compacting'].get('t') if first and src == 'compacting' else e.get('t')
                turns[starts] = self.tracer.start_span('turn', context=ctx, start_time=ns(begun), attributes={
                    'mtflow.uuid': record.get('uuid'), 'mtflow.turn': starts})
                turn_ctx[starts] = trace.set_span_in_context(turns[starts])
            parent = turn_ctx.get(turn, ctx)
            entered = open_at.pop(src, None) if src is not None else None
            if src in _GEN_STATES and entered is not None:
                serving = extra.get('serving') or {}
                self._span('model_call', parent, ns(entered.get('t')), ns(e.get('t')), {
                    'mtflow.uuid': record.get('uuid'), 'mtflow.turn': turn, 'mtflow.tokens': e.get('tokens'),
                    'mtflow.replica': serving.get('replica'), 'mtflow.prompt_tokens': serving.get('prompt_tokens'),
                    'mtflow.cached_tokens': serving.get('cached_tokens'),
                    'mtflow.moves': len(serving.get('moves') or ()) if serving else None,
                    'mtflow.trigger': e.get('trigger')})
            elif src == 'tool_step' and entered is not None:
                step = self.tracer.start_span('env_step', context=parent, start_time=ns(entered.get('t')),
                                              attributes=_clean({
                                                  'mtflow.uuid': record.get('uuid'), 'mtflow.turn': turn,
                                                  'mtflow.duration_s': e.get('duration_s'),
                                                  'mtflow.tool_calls': extra.get('tool_calls'),
                                                  'mtflow.tool_errors': extra.get('tool_errors')}))
                step_ctx = trace.set_span_in_context(step)
                at = float(entered.get('t') or 0.0)
                for call in extra.get('calls') or ():
                    duration = float(call.get('duration_s') or 0.0)
                    failed = call.get('ok') is False
                    self._span('tool_call', step_ctx, ns(at), ns(at + duration), {
                        'mtflow.uuid': record.get('uuid'), 'mtflow.turn': turn, 'mtflow.tool': call.get('name'),
                        'mtflow.ok': call.get('ok'), 'mtflow.error_kind': call.get('error_kind') or call.get('kind'),
                        'mtflow.duration_s': duration},
                        Status(StatusCode.ERROR, str(call.get('error') or 'tool error')[:200]) if failed else None)
                step.end(end_time=ns(e.get('t')))
            elif src == 'compacting':
                compaction = extra.get('compaction') or {}
                self._span('compaction', parent, ns(entered.get('t') if entered else e.get('t')), ns(e.get('t')), {
                    'mtflow.uuid': record.get('uuid'), 'mtflow.turn': turn,
                    'mtflow.compaction.policy': compaction.get('policy'),
                    'mtflow.compaction.prompt_tokens_before': compaction.get('prompt_tokens_before'),
                    'mtflow.compaction.prompt_tokens_after': compaction.get('prompt_tokens_after'),
                    'mtflow.compaction.segment': compaction.get('segment'),
                    'mtflow.compaction.fits': compaction.get('fits'),
                    'mtflow.compaction.changed': compaction.get('changed'),
                    'mtflow.compaction.outcome': dst, 'mtflow.finish_reason': e.get('reason')})
            elif src not in _GEN_STATES and src != 'tool_step' and src != 'pending' and src is not None:
                self._span(str(e.get('trigger') or src), parent, ns(entered.get('t') if entered else e.get('t')),
                           ns(e.get('t')), {'mtflow.uuid': record.get('uuid'), 'mtflow.turn': turn})
            if dst is not None and dst != 'finished':
                open_at[dst] = e
            if dst == 'finished' and extra.get('error'):
                error = extra['error']
        for span in turns.values():
            if span.is_recording():
                span.end(end_time=ns(last.get('t')))
        if error is not None or record.get('finish_reason') in ('error', 'timeout'):
            message = error.get('message') if isinstance(error, dict) else str(error or record.get('finish_reason'))
            root.set_status(Status(StatusCode.ERROR, str(message)[:200]))
        root.end(end_time=ns(last.get('t')))
        self.exported += 1

    def _span(self, name: str, parent: Any, start: int, end: int, attributes: Dict[str, Any],
              status: Any = None) -> Any:
        span = self.tracer.start_span(name, context=parent, start_time=start, attributes=_clean(attributes))
        if status is not None:
            span.set_status(status)
        span.end(end_time=max(end, start))
        return span

    def close(self) -> None:
        """Flush and shut the provider down (spans still queued for OTLP are sent)."""
        self.provider.force_flush()
        self.provider.shutdown()


def _clean(attributes: Dict[str, Any]) -> Dict[str, Any]:
    """OpenTelemetry attributes are str, bool, int, float (or lists of them): ``None`` is left out."""
    out = {}
    for k, v in attributes.items():
        if v is None:
            continue
        out[k] = v if isinstance(v, (str, bool, int, float)) else str(v)
    return out
