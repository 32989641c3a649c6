"""Hypothesis fuzz of the YAML loader and the tool-call parsers, run by ``test_fuzz.py`` in a child
process whose address space is capped (``RLIMIT_AS``) and whose every case has an alarm, so that
a hang or a memory blow-up fails the test instead of stalling or killing CI.

Properties: any YAML document (random text, or random data dumped with anchors, aliases and
alias bombs) gives problems or a config, never an exception; any tool-call string gives calls or
calls with errors, for every parser, and the YAML scheduler turns it into an observation or a
stop, never a crash. Modules a fuzzed config names are never imported (random ``plugins:`` or ``impl:``
values must not import whatever happens to be installed): only already-loaded ones resolve."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import signal
import sys
import tempfile
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CASE_SECONDS = 20  # generous: a case takes milliseconds; this only turns a hang into a failure
SETTINGS = settings(max_examples=int(os.environ.get('MTFLOW_FUZZ_EXAMPLES', '150')), deadline=None,
                    suppress_health_check=list(HealthCheck), database=None, derandomize=True)


class _OnlyLoadedModules:
    """Stands in for ``importlib`` in mtflow's reference resolver: a module a fuzzed config names
    is returned only when it is already loaded, never imported."""
    util = importlib.util

    @staticmethod
    def import_module(name: str) -> Any:
        if name in sys.modules:
            return sys.modules[name]
        raise ModuleNotFoundError(f'fuzzing: importing {name!r} is refused', name=name)


@contextlib.contextmanager
def bounded():
    def alarm(signum, frame):
        raise TimeoutError(f'a fuzz case ran past {CASE_SECONDS} s')

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---- YAML ----------------------------------------------------------------------------------------
KEYS = ['name', 'tools', 'parser', 'max_turns', 'stop', 'on_length', 'regex', 'observation', 'template', 'mode',
        'options', 'timeout_s', 'memory_mb', 'builtin', 'impl', 'env', 'kwargs', 'tips', 'text', 'when', 'answer',
        'finish_policy', 'length', 'plugins', 'scheduler_class', 'system_prompt', 'max_turn', 'x']
TOKENS = KEYS + [': ', '\n', '  ', '- ', '[', ']', '{', '}', ', ', '&a ', '*a', '&b ', '*b', '<<: ', '!!python/name:os.system',
                 '!!str ', '!!binary ', '"', "'", '#', '|', '>', '---\n', '...', 'yes', 'no', 'on', 'true', '1:30',
                 '010', '0x1F', '.inf', '~', 'null', '{reslt}', '{{', '}}', 'calculator', 'python', 'hermes', '-5',
                 'lots', '3', '\t', '\x00', '\xe9', 'é', '\ufeff', '%YAML 1.1\n', '%TAG ! tag:x,2000:\n', '?', '@']
SAFE_REFS = ['math:sqrt', 'json:dumps', 'collections:OrderedDict', 'nope_module:x', 'math:nothing', 'json']

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=False),
                    st.text(max_size=20), st.sampled_from(KEYS + SAFE_REFS))
data = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=5),
                                                    st.dictionaries(st.sampled_from(KEYS), kids, max_size=6)),
                    max_leaves=30)


def _bomb(width: int, depth: int, recursive: bool) -> str:
    doc = 'name: fuzz\nl0: &l0 [' + ', '.join(['lol'] * width) + ']\n'
    for i in range(1, depth):
        doc += f'l{i}: &l{i} [' + ', '.join([f'*l{i - 1}'] * width) + ']\n'
    if recursive:
        doc += 'r: &r [*r]\n'
    return doc


documents = st.one_of(
    st.lists(st.sampled_from(TOKENS), max_size=60).map(''.join),
    data.map(lambda d: __import__('yaml').safe_dump(d, allow_unicode=True)),
    st.builds(_bomb, st.integers(1, 12), st.integers(1, 12), st.booleans()),
    st.binary(max_size=200),
)


@SETTINGS
@given(documents)
def fuzz_yaml_documents(doc):
    from mtflow.declarative import inspect_file
    from mtflow.run.config import RunConfigError, load_run_config

    with tempfile.TemporaryDirectory() as d, bounded():
        path = os.path.join(d, 'f.yaml')
        with open(path, 'wb') as f:
            f.write(doc if isinstance(doc, bytes) else doc.encode('utf-8', 'surrogatepass'))
        report = inspect_file(path)  # never raises
        for p in report.problems:
            assert p.file == path and isinstance(p.message, str) and p.message
            assert p.line is None or p.line >= 1
        try:
            load_run_config(path)
        except RunConfigError as exc:
            assert str(exc)


# ---- tool calls ------------------------------------------------------------------------------------
CALL_TOKENS = ['<tool_call>', '</tool_call>', '[TOOL_CALLS]', '[ARGS]', '[CALL_ID]', '<|python_tag|>', '<|eom_id|>',
               '<｜tool▁calls▁begin｜>', '<｜tool▁call▁begin｜>', '<｜tool▁sep｜>', '<｜tool▁call▁end｜>', 'function',
               '```json\n', '```', '<think>', '</think>', 'Action:', 'Action Input:', '**Action:**', 'action input:',
               'Observation:', 'Final Answer:', '{"name": "calculator", "arguments": ', '{"name": "python", "parameters": ',
               '{"expression": "1+1"}', '{', '}', '[', ']', '"', ':', ',', ';', '\n', ' ', 'calculator(', 'expression=',
               '"2*3"', ')', 'calculator', 'python', '1', 'x', '\\', '\\u00', '[' * 50, '{"a":' * 30, 'é', '\x00']
completions = st.one_of(st.lists(st.sampled_from(CALL_TOKENS), max_size=40).map(''.join), st.text(max_size=200))


@SETTINGS
@given(completions)
def fuzz_parsers(text):
    from mtflow.declarative.parsers import ToolCall, detect_formats, get_parser, parser_names

    with bounded():
        for name in parser_names():
            calls = get_parser(name).parse(text)
            assert isinstance(calls, list)
            for c in calls:
                assert isinstance(c, ToolCall)
                assert (c.error is None and isinstance(c.name, str) and c.name) or isinstance(c.error, str)
        assert isinstance(detect_formats(text, ['calculator', 'python']), list)


@SETTINGS
@given(completions, st.sampled_from(['hermes', 'llama3_json', 'pythonic', 'mistral', 'deepseek', 'react', 'json']),
       st.sampled_from(['stop', 'length']))
def fuzz_scheduler_turns(text, parser, finish_reason):
    from mtflow import Executor
    from mtflow.declarative import load_scheduler
    from tests.declarative.util import model_out, tok
    from tests.helpers import Scripted, req

    with bounded():
        s = load_scheduler({'name': 'fuzz', 'parser': parser, 'tools': [{'name': 'calculator'}], 'max_turns': 2,
                            'stop': {'on_length': False}, 'observation': {'mode': 'message', 'role': 'user'}},
                           tokenizer=tok())
        res = Executor(s, Scripted({'a': [model_out(text, finish_reason=finish_reason), model_out('done')]}),
                       on_error='return').run([req('a')])
        assert res.failures == [], res.failures
        assert res.finish_reasons[0] in ('stop_rule:no_tool_call', 'max_turns')


def main() -> int:
    import mtflow.declarative  # noqa: F401  (everything the cases use, before imports are refused)
    import mtflow.declarative.parsers  # noqa: F401
    import mtflow.run.config  # noqa: F401
    import mtflow.tools.calculator  # noqa: F401
    import tests.declarative.util  # noqa: F401
    import tests.helpers  # noqa: F401
    from mtflow.declarative.parsers import get_parser
    from tests.declarative.util import tok

    tok()  # build the shared tokenizer before imports are refused
    get_parser('hermes')
    import mtflow.tools.registry as registry

    registry.importlib = _OnlyLoadedModules  # type: ignore[assignment]
    for case in (fuzz_yaml_documents, fuzz_parsers, fuzz_scheduler_turns):
        case()
        print(f'{case.__name__}: ok', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
