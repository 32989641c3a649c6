"""Cost of the hostile-YAML reader and the tool-call parsers.

Table 1: reading scheduler-sized documents and alias bombs with ``mtflow.core.safe_yaml.load_yaml``
against ``yaml.safe_load`` (the baseline, same process), and what a consumer that walks the data
(as the line map and pydantic do) costs after each: for bombs the baseline walk is capped at 2 s
and reported as "> 2 s" (uncapped it runs for hours and grows past 10 GB).

Table 2: parse throughput per format over the real-shaped fixtures in ``tests/data/tool_calls``.

    .venv/bin/python benchmarks/yaml_and_parsers.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from mtflow.declarative.parsers import get_parser  # noqa: E402
from mtflow.core.safe_yaml import YamlLoadError, load_yaml  # noqa: E402


def bomb(width: int, depth: int) -> str:
    doc = 'l0: &l0 [' + ', '.join(['lol'] * width) + ']\n'
    for i in range(1, depth):
        doc += f'l{i}: &l{i} [' + ', '.join([f'*l{i - 1}'] * width) + ']\n'
    return doc


class _TooLong(Exception):
    pass


def walk(value: Any, deadline: float, count: list) -> None:
    """What a consumer of the data does: visit every node (aliases expanded)."""
    count[0] += 1
    if count[0] % 10000 == 0 and time.perf_counter() > deadline:
        raise _TooLong
    if isinstance(value, dict):
        for k, v in value.items():
            walk(v, deadline, count)
    elif isinstance(value, list):
        for v in value:
            walk(v, deadline, count)


def best(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def yaml_table(repeats: int) -> None:
    with open(os.path.join(ROOT, 'schedulers', 'hermes_tools.yaml'), encoding='utf-8') as f:
        real = f.read()
    docs = [('hermes_tools.yaml', real), ('hermes_tools.yaml + 20 flow mappings', real + ''.join(
        f'extra{i}: {{a: [1, 2, 3], b: {{c: d}}}}\n' for i in range(20))),
            ('bomb 9x5 (6e4 nodes)', bomb(9, 5)), ('bomb 9x9 (4e8 nodes)', bomb(9, 9))]
    print('| document | bytes | yaml.safe_load ms | + walk | safe_yaml.load_yaml ms | + walk |')
    print('|---|---:|---:|---:|---:|---:|')
    for name, doc in docs:
        base = best(lambda: yaml.safe_load(doc), repeats) * 1e3
        data = yaml.safe_load(doc)
        count = [0]
        t = time.perf_counter()
        try:
            walk(data, t + 2.0, count)
            base_walk = f'{(time.perf_counter() - t) * 1e3:.2f} ms'
        except _TooLong:
            base_walk = f'> 2 s ({count[0]:.1e} nodes seen)'

        def ours() -> Any:
            try:
                return load_yaml(doc)[0]
            except YamlLoadError as exc:
                return exc

        safe = best(ours, repeats) * 1e3
        result = ours()
        if isinstance(result, YamlLoadError):
            safe_walk = 'refused: ' + result.problems[0].message.split(' (')[0]
        else:
            t = time.perf_counter()
            walk(result, t + 2.0, [0])
            safe_walk = f'{(time.perf_counter() - t) * 1e3:.2f} ms'
        print(f'| {name} | {len(doc.encode())} | {base:.2f} | {base_walk} | {safe:.2f} | {safe_walk} |')


def parser_table(repeats: int) -> None:
    here = os.path.join(ROOT, 'tests', 'data', 'tool_calls')
    with open(os.path.join(here, 'expected.yaml'), encoding='utf-8') as f:
        cases = yaml.safe_load(f)
    by_parser: dict = {}
    for c in cases:
        if c.get('foreign') or not c['calls']:
            continue
        with open(os.path.join(here, c['file']), encoding='utf-8') as f:
            by_parser.setdefault(get_parser(c['parser']).name, []).append(f.read())
    print('\n| parser | fixtures | us per reply | replies/s |')
    print('|---|---:|---:|---:|')
    for name, texts in sorted(by_parser.items()):
        parser = get_parser(name)
        n = 200

        def run() -> None:
            for _ in range(n):
                for t in texts:
                    parser.parse(t)

        s = best(run, repeats)
        per = s / (n * len(texts))
        print(f'| {name} | {len(texts)} | {per * 1e6:.1f} | {1 / per:,.0f} |')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--repeats', type=int, default=5)
    args = ap.parse_args()
    yaml_table(args.repeats)
    parser_table(args.repeats)


if __name__ == '__main__':
    main()
