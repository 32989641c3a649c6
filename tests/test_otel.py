"""OpenTelemetry export (mtflow/run/otel.py): the span tree of a run with tools, through the SDK's
in-memory exporter (an in-process collector) and through ``mtflow run --otel FILE``."""
import json
from pathlib import Path

import pytest

pytest.importorskip('opentelemetry.sdk')

from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from mtflow import Executor, RequestConfig, RolloutInferRequest  # noqa: E402
from mtflow.backends import make_backend  # noqa: E402
from mtflow.cli import main  # noqa: E402
from mtflow.declarative import load_scheduler  # noqa: E402
from mtflow.run.otel import OtelError, OtelExporter, make_exporter  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / 'configs'


def _requests():
    lines = [json.loads(x) for x in (CONFIGS / 'scripted_tools.jsonl').read_text().splitlines() if x.strip()]
    return [RolloutInferRequest(uuid=d['uuid'], messages=[{'role': 'user', 'content': d['prompt']}],
                                data_dict={'answer': d['answer']}) for d in lines]


def _tree(spans):
    """{uuid: (root, {span_id: span}, children by parent id)} from SDK spans."""
    roots = [s for s in spans if s.name == 'request']
    by_trace = {}
    for root in roots:
        mine = [s for s in spans if s.context.trace_id == root.context.trace_id]
        children = {}
        for s in mine:
            if s.parent is not None:
                children.setdefault(s.parent.span_id, []).append(s)
        by_trace[root.attributes['mtflow.uuid']] = (root, children)
    return by_trace


def test_a_run_with_tools_is_one_trace_per_request_with_turn_model_step_and_tool_spans():
    memory = InMemorySpanExporter()
    exporter = OtelExporter(SimpleSpanProcessor(memory))
    scheduler = load_scheduler(ROOT / 'schedulers' / 'scripted_tools.yaml')
    backend = make_backend('scripted', path=str(CONFIGS / 'scripted_tools_model.jsonl'))
    result = Executor(scheduler, backend, RequestConfig(), max_turns=5, on_error='return',
                      on_finished=exporter.on_finished).run(_requests())
    exporter.close()
    spans = memory.get_finished_spans()
    trees = _tree(spans)
    assert sorted(trees) == sorted(r.uuid for r in _requests()) and exporter.exported == 4
    for uuid, (root, children) in trees.items():
        assert root.parent is None and root.attributes['mtflow.finish_reason'] == result.trace.finish_reason(uuid)
        turns = sorted(children[root.context.span_id], key=lambda s: s.attributes['mtflow.turn'])
        assert [s.name for s in turns] == ['turn'] * len(turns) and len(turns) == root.attributes['mtflow.turns']
        for turn in turns:
            kids = children.get(turn.context.span_id, [])
            names = [k.name for k in sorted(kids, key=lambda k: k.start_time)]
            assert names[0] == 'model_call', names
            assert all(turn.start_time <= k.start_time and k.end_time <= turn.end_time for k in kids)
        steps = [k for t in turns for k in children.get(t.context.span_id, []) if k.name == 'env_step']
        assert len(steps) == len(turns) - 1, 'every turn but the last ran the tools'
        calls = [c for s in steps for c in children.get(s.context.span_id, [])]
        assert calls and all(c.name == 'tool_call' and c.attributes['mtflow.tool'] in ('calculator', 'python')
                             for c in calls)
    bad_calls = [c for c in spans if c.name == 'tool_call' and c.attributes.get('mtflow.ok') is False]
    assert len(bad_calls) == 1 and bad_calls[0].attributes['mtflow.error_kind'] == 'exception'
    assert bad_calls[0].attributes['mtflow.uuid'] == 'bad' and not bad_calls[0].status.is_ok


def test_mtflow_run_otel_writes_spans_with_rewards_to_a_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    spans_file = tmp_path / 'spans.jsonl'
    assert main(['run', str(CONFIGS / 'scripted_tools.yaml'), '--out', 'o', '-q', '--otel', str(spans_file)]) == 0
    spans = [json.loads(line) for line in spans_file.read_text().splitlines()]
    roots = [s for s in spans if s['name'] == 'request']
    assert len(roots) == 4 and all(s['parent_id'] is None for s in roots)
    assert sorted(r['attributes']['mtflow.reward'] for r in roots) == [0.0, 1.0, 1.0, 1.0]
    by_id = {s['context']['span_id']: s for s in spans}
    for s in spans:
        if s['name'] != 'request':
            chain = [s]
            while chain[-1]['parent_id'] is not None:
                chain.append(by_id[chain[-1]['parent_id']])
            assert chain[-1]['name'] == 'request' and chain[-1]['context']['trace_id'] == s['context']['trace_id']
    events = [json.loads(x) for x in (tmp_path / 'o' / 'trace.jsonl').read_text().splitlines()]
    assert len([s for s in spans if s['name'] == 'model_call']) == sum(
        1 for e in events if e['from'] == 'generating')
    # the span times are the trace's, on the run's clock
    first = min(s['start_time'] for s in spans)
    assert first.startswith('20')


def test_otel_targets_are_checked():
    with pytest.raises(OtelError, match="expected 'otlp', 'otlp=URL' or a .json/.jsonl file"):
        make_exporter('jaeger')
    exporter = make_exporter('otlp=http://127.0.0.1:9')  # nothing listens: export fails quietly at close
    exporter.close()


def test_mtflow_run_otel_otlp_reaches_a_collector_on_loopback(tmp_path, monkeypatch):
    """OTLP over HTTP (protobuf) to a collector on 127.0.0.1 that decodes what it receives."""
    pytest.importorskip('opentelemetry.exporter.otlp.proto.http')
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    received = []

    class Collector(BaseHTTPRequestHandler):

        def log_message(self, *args):
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get('Content-Length') or 0))
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            received.append((self.path, request))
            self.send_response(200)
            self.send_header('Content-Type', 'application/x-protobuf')
            self.send_header('Content-Length', '0')
            self.end_headers()

    httpd = ThreadingHTTPServer(('127.0.0.1', 0), Collector)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    monkeypatch.chdir(tmp_path)
    try:
        url = f'http://127.0.0.1:{httpd.server_address[1]}'
        assert main(['run', str(CONFIGS / 'scripted_tools.yaml'), '--out', 'o', '-q', '--otel', f'otlp={url}']) == 0
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert received and all(path == '/v1/traces' for path, _ in received)
    spans = [s for _, r in received for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]
    services = {a.value.string_value for _, r in received for rs in r.resource_spans for a in rs.resource.attributes
                if a.key == 'service.name'}
    assert services == {'mtflow'}

    def attrs(span):
        return {a.key: a.value for a in span.attributes}

    roots = [s for s in spans if s.name == 'request']
    assert sorted(attrs(s)['mtflow.uuid'].string_value for s in roots) == ['bad', 'div', 'mul', 'sum']
    failed = [s for s in spans if s.name == 'tool_call' and not attrs(s)['mtflow.ok'].bool_value]
    assert len(failed) == 1 and attrs(failed[0])['mtflow.error_kind'].string_value == 'exception'
    ids = {s.span_id for s in spans}
    assert all(s.parent_span_id in ids for s in spans if s.name != 'request')


def _compaction_run(exporter, requests):
    from mtflow import ContextBudget
    from mtflow.backends.scripted import ScriptedBackend
    from tests.context.helpers import GrowingObservations, count_words

    def shorten(request, budget):  # the hook policy: a long task is cut, observations elided
        msgs = [dict(m) for m in request.messages]
        msgs[1]['content'] = ' '.join(msgs[1]['content'].split()[:20])
        return msgs[:2] + [dict(m, content='(elided)') if m['role'] == 'tool' else m for m in msgs[2:]]

    budget = ContextBudget(context_length=1000, policy=shorten, count_tokens=count_words)
    backend = ScriptedBackend(outputs=[{'content': 'I will look further', 'token_ids': [11, 12, 13, 14]}], cycle=True)
    return Executor(GrowingObservations(max_turns=8), backend, RequestConfig(max_tokens=50), context=budget,
                    on_finished=exporter.on_finished).run(requests)


def test_a_compaction_is_a_span_of_its_turn_with_policy_tokens_and_segment():
    memory = InMemorySpanExporter()
    exporter = OtelExporter(SimpleSpanProcessor(memory))
    long_task = ' '.join(['word'] * 990)  # the first prompt is over the budget: compacted before turn 1
    requests = [RolloutInferRequest(uuid='grow', messages=[{'role': 'system', 'content': 'Agent.'},
                                                           {'role': 'user', 'content': 'Task: explore.'}]),
                RolloutInferRequest(uuid='long', messages=[{'role': 'system', 'content': 'Agent.'},
                                                           {'role': 'user', 'content': long_task}])]
    result = _compaction_run(exporter, requests)
    exporter.close()
    assert result.finish_reasons == ['max_turns', 'max_turns']
    trees = _tree(memory.get_finished_spans())
    events = {u: [e for e in result.trace.events if e.uuid == u and e.src == 'compacting'] for u in ('grow', 'long')}
    for uuid, (root, children) in trees.items():
        turns = sorted(children[root.context.span_id], key=lambda s: s.attributes['mtflow.turn'])
        assert [t.attributes['mtflow.turn'] for t in turns] == list(range(1, 9))  # numbered as the trace
        spans = [(t, k) for t in turns for k in children.get(t.context.span_id, []) if k.name == 'compaction']
        assert len(spans) == len(events[uuid]) >= 1
        for (turn, span), event in zip(sorted(spans, key=lambda p: p[1].start_time), events[uuid]):
            comp, a = event.extra['compaction'], span.attributes
            assert turn.attributes['mtflow.turn'] == event.turn == a['mtflow.turn']
            assert a['mtflow.compaction.policy'] == 'hook:shorten' == comp['policy']
            assert a['mtflow.compaction.prompt_tokens_before'] == comp['prompt_tokens_before'] > 950
            assert a['mtflow.compaction.prompt_tokens_after'] == comp['prompt_tokens_after'] < 950
            assert a['mtflow.compaction.segment'] == comp['segment'] >= 1
            assert a['mtflow.compaction.outcome'] == 'generating'
            assert turn.start_time <= span.start_time <= span.end_time <= turn.end_time
    # the long task's compaction came before its first turn, and belongs to turn 1
    [(long_turn, _)] = [(e.turn, e) for e in events['long'][:1]]
    assert long_turn == 1
    root, children = trees['long']
    first = min(children[root.context.span_id], key=lambda s: s.attributes['mtflow.turn'])
    names = [k.name for k in sorted(children[first.context.span_id], key=lambda k: k.start_time)]
    assert names[:2] == ['compaction', 'model_call'], names
