#!/usr/bin/env python
"""What OpenTelemetry export costs a rollout (``mtflow/run/otel.py``), and that it costs nothing off.

The same scripted rollout (a model replayed from memory, a scheduler that answers every turn:
the executor's own cost dominates, the worst case for any per-request overhead) runs with
telemetry off (``on_finished=None``: what ``mtflow run`` without ``--otel`` does), with an
``on_finished`` that does nothing (the hook's call alone), and with the exporter on the SDK's
in-memory exporter (span building without network). Interleaved rounds; medians.

    .venv/bin/python benchmarks/otel.py                 # 1000 requests x 3 turns, 7 rounds
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--requests', type=int, default=1000)
    ap.add_argument('--turns', type=int, default=3)
    ap.add_argument('--rounds', type=int, default=7)
    args = ap.parse_args()

    import mtflow
    from mtflow import RequestConfig, RolloutInferRequest
    from mtflow.backends import make_backend
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from mtflow.run.otel import OtelExporter

    class GoOn(mtflow.Scheduler):

        def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
            infer_request.messages.append({'role': 'user', 'content': 'go on'})
            return {'infer_request': infer_request}

    backend = make_backend('scripted', outputs=[{'content': 'thinking', 'token_ids': [1, 2, 3]}], cycle=True)

    def one(mode: str) -> float:
        requests = [RolloutInferRequest(uuid=f'r{i}', messages=[{'role': 'user', 'content': 'q'}])
                    for i in range(args.requests)]
        exporter = OtelExporter(SimpleSpanProcessor(InMemorySpanExporter())) if mode == 'otel on' else None
        hook = {'off': None, 'empty hook': lambda f: None, 'otel on': exporter.on_finished if exporter else None}[mode]
        t0 = time.perf_counter()
        mtflow.Executor(GoOn(max_turns=args.turns), backend, RequestConfig(), on_finished=hook).run(requests)
        took = time.perf_counter() - t0
        if exporter is not None:
            exporter.close()
        return took

    modes = ['off', 'empty hook', 'otel on']
    times: Dict[str, List[float]] = {m: [] for m in modes}
    one('off')  # warm-up
    for _ in range(args.rounds):
        for m in modes:
            times[m].append(one(m))
    base = statistics.median(times['off'])
    print(f'{args.requests} requests x {args.turns} turns, {args.rounds} rounds (median)')
    print('| telemetry | wall s | per request | vs off |')
    print('|---|---:|---:|---:|')
    for m in modes:
        med = statistics.median(times[m])
        print(f'| {m} | {med:.3f} | {1e6 * med / args.requests:.0f} us | {med / base - 1:+.1%} |')


if __name__ == '__main__':
    main()
