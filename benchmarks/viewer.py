"""How long the trace viewer takes on big runs, and how big its page gets.

A real :class:`mtflow.Executor` run (a one-tool scheduler, scripted outputs of 5-40 tokens, 1-8
turns per request) is written as trace and trajectories files; then each view is timed from the
files, as the CLI does it: reading, the terminal timeline + summary (rendered to a string), and the
HTML page (with the trajectories). Prints a table.

    .venv/bin/python benchmarks/viewer.py            # --n 500 2000 5000
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import mtflow
from mtflow.core.protocol import RolloutInferRequest, RolloutOutput, make_choice, make_response
from mtflow.core.trace import Trace
from mtflow.run.trajectories import read_trajectories, trajectories_from_result, write_trajectories
from mtflow.viewer.html import render_html
from mtflow.viewer.terminal import format_trace


class OneTool(mtflow.Scheduler):
    """Appends a tool observation (2 masked tokens) each turn; every 7th step reports a tool error."""

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        infer_request.messages.append({'role': 'tool', 'content': 'obs'})
        info: Dict[str, Any] = {'tool_calls': [{'name': 'calc'}]}
        if (hash(infer_request.uuid) + current_turn) % 7 == 0:
            info['tool_errors'] = ['calc: bad input']
        ids = list(response_choice.token_ids)
        return {'infer_request': infer_request, 'response_token_ids': ids + [9, 9],
                'response_loss_mask': [1] * len(ids) + [0, 0], 'trace_info': info}


def make_run(n: int, directory: Path) -> Dict[str, Path]:
    rng = random.Random(0)
    stop_at: Dict[str, int] = {}

    def rollout_fn(requests: List[Any], config: Any) -> List[RolloutOutput]:
        outs = []
        for r in requests:
            done = sum(1 for m in r.messages if m['role'] == 'assistant') + 1
            reason = 'length' if done >= stop_at.setdefault(r.uuid, rng.randint(1, 8)) else 'stop'
            ids = list(range(rng.randint(5, 40)))
            choice = make_choice('x' * len(ids), token_ids=ids, logprobs=[-0.1] * len(ids), finish_reason=reason)
            outs.append(RolloutOutput(response=make_response(choice)))
        return outs

    requests = [RolloutInferRequest(uuid=f'req-{i:05d}', messages=[{'role': 'user', 'content': 'q'}]) for i in range(n)]
    result = mtflow.Executor(OneTool(), rollout_fn, max_turns=8).run(requests)
    paths = {'trace': directory / f'trace{n}.jsonl', 'traj': directory / f'traj{n}.jsonl'}
    result.trace.write_jsonl(paths['trace'])
    write_trajectories(paths['traj'], trajectories_from_result(result, requests))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--n', type=int, nargs='+', default=[500, 2000, 5000], help='requests per run')
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.n:
            paths = make_run(n, Path(tmp))
            t = time.perf_counter()
            trace = Trace.read_jsonl(paths['trace'])
            read_s = time.perf_counter() - t
            t = time.perf_counter()
            text = format_trace(trace)
            show_s = time.perf_counter() - t
            t = time.perf_counter()
            page = render_html(trace, trajectories=read_trajectories(paths['traj']))
            html_s = time.perf_counter() - t
            rows.append((n, len(trace), read_s, show_s, len(text.splitlines()), html_s, len(page.encode()) / 2**20,
                         paths['trace'].stat().st_size / 2**20))
    print('| requests | events | read s | terminal s | terminal lines | html s (with trajectories) | page MiB | trace MiB |')
    print('|---------:|-------:|-------:|-----------:|---------------:|---------------------------:|---------:|----------:|')
    for n, ev, rd, sh, lines, ht, mib, tmib in rows:
        print(f'| {n:8d} | {ev:6d} | {rd:6.2f} | {sh:10.2f} | {lines:14d} | {ht:26.2f} | {mib:8.1f} | {tmib:9.1f} |')


if __name__ == '__main__':
    main()
