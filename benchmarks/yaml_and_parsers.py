"""Cost of the hostile-YAML reader and the tool-call parsers.

Table 1: reading scheduler-sized documents and alias bombs with ``mtflow.core.safe_yaml.load_yaml``
against ``yaml.safe_load`` (the baseline, same process), and what a consumer that walks the data
(as the line map and pydantic do) costs after each: for bombs the baseline walk is capped at 2 s
and reported as "> 2 s" (uncapped it runs for hours and grows past 10 GB).

Table 2: parse cost per format, hermes the baseline in the same run: over the real-shaped fixtures of
each format in ``tests/data/tool_calls``, and over the same three calls (code with newlines and quotes,
unicode, nested JSON, typed values) written in each format by its own ``render_calls`` (the fair
comparison: same content, another format). Parsing goes through ``parse_calls``, the path the scheduler
and the gateway take (the XML formats' values typed by the tools' schemas). ``harmony`` needs
openai-harmony and its vocabulary (``scripts/harmony_vocab.py``); without them its row says so.

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

from mtflow.declarative.parsers import get_parser, parse_calls  # noqa: E402
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


#: the tools the fixtures call, and the calls every format writes for the "same calls" column
SPECS = [{'type': 'function', 'function': {'name': n, 'parameters': {'type': 'object', 'properties': {
    k: {'type': t} for k, t in props.items()}}}} for n, props in (
        ('get_weather', {'city': 'string', 'days': 'integer'}), ('python', {'code': 'string'}),
        ('search', {'query': 'string', 'limit': 'integer', 'exact': 'boolean', 'threshold': 'number',
                    'filters': 'object', 'fields': 'array'}))]
SAME_CALLS = [('python', {'code': 'import json\nprint(json.dumps({"q": \'say "hi"\'}))\nfor i in range(3):\n'
                                   '    print(i)'}),
              ('get_weather', {'city': 'Zürich 東京', 'days': 3}),
              ('search', {'query': 'mtflow', 'limit': 10, 'exact': True,
                          'filters': {'lang': ['en'], 'meta': {'y': 2024}}})]
FAMILY_ORDER = ['hermes', 'qwen3_coder', 'glm45', 'kimi_k2', 'deepseek_v32', 'minimax_m2', 'harmony', 'deepseek',
                'llama3_json', 'mistral', 'pythonic', 'json', 'react']


def per_reply(parser: Any, texts: list, repeats: int) -> float:
    """Seconds to parse one reply (best of ``repeats`` runs over ``texts``)."""
    n = max(1, 400 // len(texts))

    def run() -> None:
        for _ in range(n):
            for t in texts:
                parse_calls(parser, t, SPECS)

    return best(run, repeats) / (n * len(texts))


def parser_table(repeats: int) -> None:
    here = os.path.join(ROOT, 'tests', 'data', 'tool_calls')
    with open(os.path.join(here, 'expected.yaml'), encoding='utf-8') as f:
        cases = yaml.safe_load(f)
    by_parser: dict = {}
    for c in cases:
        if c.get('foreign') or not c['calls']:
            continue
        try:
            name = get_parser(c['parser']).name
        except (ImportError, RuntimeError):
            continue
        with open(os.path.join(here, c['file']), encoding='utf-8') as f:
            by_parser.setdefault(name, []).append(f.read())
    print('\n| parser | fixtures | us per fixture reply | x hermes | us per reply, same 3 calls | x hermes |')
    print('|---|---:|---:|---:|---:|---:|')
    base_fix = base_same = None
    for name in FAMILY_ORDER:
        try:
            parser = get_parser(name)
        except (ImportError, RuntimeError) as exc:
            print(f'| {name} | - | not measured: {exc} | | | |')
            continue
        fix = per_reply(parser, by_parser[name], repeats) if by_parser.get(name) else None
        same = None
        if name not in ('react', 'json', 'pythonic', 'mistral', 'llama3_json', 'deepseek'):
            same = per_reply(parser, [parser.render_calls(SAME_CALLS)], repeats)
        if name == 'hermes':
            base_fix, base_same = fix, same
        ratio = lambda v, b: f'{v / b:.2f}' if v is not None and b else '-'  # noqa: E731
        show = lambda v: f'{v * 1e6:.1f}' if v is not None else '-'  # noqa: E731
        print(f'| {name} | {len(by_parser.get(name, []))} | {show(fix)} | {ratio(fix, base_fix)} | {show(same)} | '
              f'{ratio(same, base_same)} |')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--repeats', type=int, default=5)
    args = ap.parse_args()
    yaml_table(args.repeats)
    parser_table(args.repeats)


if __name__ == '__main__':
    main()
