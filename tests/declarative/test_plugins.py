"""Plugins the ecosystem's way: entry points of an installed distribution (a real ``dist-info``
on ``sys.path``, found by ``importlib.metadata``) and the ``plugins:`` key of a YAML file, from
the Python API and from the CLI (``mtflow validate`` and ``mtflow run``)."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest

from mtflow.cli import main as cli
from mtflow.declarative import ConfigError, load_scheduler, validate_file
from mtflow.declarative.parsers import parser_names
from mtflow.tools.registry import builtin_names

PKG = textwrap.dedent('''\
    """An installed plugin package."""
    from mtflow.declarative import Env
    from mtflow.declarative.parsers import ToolCall, ToolCallParser


    def shout(text: str) -> str:
        """Shout the text.

        Args:
            text: what to shout
        """
        return text.upper() + '!'


    class BangParser(ToolCallParser):
        """Calls written as ``!tool text``."""
        name = 'bang'
        expected = '!tool text'

        def parse(self, text):
            if not text.startswith('!'):
                return []
            name, _, arg = text[1:].partition(' ')
            return [ToolCall(name, {'text': arg}, text)]


    class CountdownEnv(Env):
        def __init__(self, start: int = 2):
            self.left = start

        def step(self, action):
            self.left -= 1
            return f'{self.left} left', 0.0, self.left <= 0, {}
    ''')


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A distribution 'mtflow-test-plugin' declaring one tool, one parser, one env, and a broken one."""
    site = tmp_path / 'site'
    (site / 'mtflow_test_plugin').mkdir(parents=True)
    (site / 'mtflow_test_plugin' / '__init__.py').write_text(PKG)
    dist = site / 'mtflow_test_plugin-1.0.dist-info'
    dist.mkdir()
    (dist / 'METADATA').write_text('Metadata-Version: 2.1\nName: mtflow-test-plugin\nVersion: 1.0\n')
    (dist / 'entry_points.txt').write_text(textwrap.dedent('''\
        [mtflow.tools]
        shout = mtflow_test_plugin:shout
        broken_tool = mtflow_test_plugin_missing:nothing
        [mtflow.parsers]
        bang = mtflow_test_plugin:BangParser
        [mtflow.envs]
        countdown = mtflow_test_plugin:CountdownEnv
        '''))
    monkeypatch.syspath_prepend(str(site))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith('mtflow_test_plugin')]:
        del sys.modules[name]


def test_entry_points_are_listed_without_importing(installed):
    assert 'shout' in builtin_names() and 'broken_tool' in builtin_names()
    assert 'bang' in parser_names()
    assert 'mtflow_test_plugin' not in sys.modules  # nothing imported until a config names it


def test_entry_point_tool_parser_and_env_from_yaml(installed):
    cfg = installed / 's.yaml'
    cfg.write_text('name: plug\nparser: bang\ntools:\n  - name: shout\n')
    assert validate_file(cfg) == []
    s = load_scheduler(str(cfg))
    assert s.tool_specs[0]['function']['description'] == 'Shout the text.'
    assert [c.name for c in s.parser.parse('!shout hi')] == ['shout']
    env = installed / 'e.yaml'
    env.write_text('name: env\nenv: {impl: countdown, kwargs: {start: 3}}\n')
    assert validate_file(env) == []


def test_broken_entry_point_is_reported_only_when_named(installed):
    cfg = installed / 's.yaml'
    cfg.write_text('name: plug\ntools:\n  - name: broken_tool\n')
    (problem, ) = validate_file(cfg)
    assert problem.line == 3 and problem.path == 'tools[0]'
    assert 'entry point mtflow.tools:broken_tool' in problem.message and 'mtflow-test-plugin' in problem.message


def test_validate_lists_the_code_a_file_imports(installed, capsys):
    (installed / 'mine.py').write_text('def f(x: int) -> int:\n    """F."""\n    return x\n')
    cfg = installed / 's.yaml'
    cfg.write_text('name: plug\ntools:\n  - name: shout\n  - name: f\n    impl: mine:f\n')
    assert cli(['validate', str(cfg)]) == 0
    text = capsys.readouterr().out
    assert 'imports (this Python code runs with your rights)' in text
    assert 'mine:f  (tools[1].impl)' in text
    assert "mtflow_test_plugin:shout (mtflow-test-plugin)  (mtflow.tools entry point 'shout')" in text


REGISTERING = textwrap.dedent('''\
    from mtflow.tools import register_tool
    from mtflow.declarative import register_parser
    from mtflow.declarative.parsers import HermesParser


    @register_tool('double')
    def double(x: int) -> int:
        """Double x."""
        return 2 * x


    class Tagged(HermesParser):
        name = 'tagged_hermes'


    register_parser('tagged_hermes', Tagged)
    ''')


def test_plugins_key_makes_register_calls_work_from_the_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'my_registry_plugin.py').write_text(REGISTERING)
    (tmp_path / 's.yaml').write_text('name: reg\nplugins: [my_registry_plugin]\nparser: tagged_hermes\n'
                                     'tools:\n  - name: double\n')
    (tmp_path / 'bad.yaml').write_text('name: reg\ntools:\n  - name: triple\n')
    assert cli(['validate', 's.yaml']) == 0
    out = capsys.readouterr().out
    assert 's.yaml: OK' in out and 'my_registry_plugin  (plugins[0])' in out
    assert cli(['validate', 'bad.yaml']) == 1
    assert "bad.yaml:3: tools[0]: unknown built-in tool 'triple'" in capsys.readouterr().out
    prompts = tmp_path / 'p.jsonl'
    prompts.write_text(json.dumps({'uuid': 'u1', 'prompt': 'double 21'}) + '\n')
    (tmp_path / 'script.jsonl').write_text(json.dumps('<tool_call>{"name": "double", "arguments": {"x": 21}}'
                                                      '</tool_call>') + '\n' + json.dumps('42') + '\n')
    (tmp_path / 'run.yaml').write_text('scheduler: s.yaml\nbackend: scripted\nmodel: script.jsonl\n'
                                       'dataset: p.jsonl\nout: out\nmax_turns: 3\n')
    assert cli(['run', 'run.yaml', '-q']) == 0
    line = json.loads((tmp_path / 'out' / 'trajectories.jsonl').read_text().splitlines()[0])
    assert {'role': 'tool', 'name': 'double', 'content': '42'} in [{k: v for k, v in m.items() if k != 'tool_call_id'}
                                                                 for m in line['messages']]


def test_plugin_that_raises_is_a_problem_with_its_line(tmp_path):
    (tmp_path / 'boom_plugin.py').write_text('raise ValueError("no")\n')
    cfg = tmp_path / 's.yaml'
    cfg.write_text('name: x\nplugins:\n  - json\n  - boom_plugin\n')
    (problem, ) = validate_file(cfg)
    assert (problem.line, problem.path) == (4, 'plugins[1]')
    assert "importing plugin 'boom_plugin' failed: ValueError: no" in problem.message
    with pytest.raises(ConfigError, match='boom_plugin'):
        load_scheduler(str(cfg))


def test_a_registered_tool_can_declare_an_options_model(tmp_path):
    """``register_tool(factory=True, options=Model)``: each bad option is reported at its own line."""
    from pydantic import BaseModel, ConfigDict, Field

    from mtflow.tools import register_tool

    class GreetOptions(BaseModel):
        model_config = ConfigDict(extra='forbid', strict=True)
        greeting: str = 'hello'
        times: int = Field(1, ge=1)

    @register_tool('greet_with_options', factory=True, options=GreetOptions)
    def make(options):
        opts = GreetOptions(**options)

        def greet(name: str) -> str:
            """Greet."""
            return f'{opts.greeting} {name}' * opts.times

        return greet

    cfg = tmp_path / 's.yaml'
    cfg.write_text('name: g\ntools:\n  - name: greet_with_options\n    options:\n      times: 0\n      greeting: 3\n'
                   '      colour: red\n      greetin: hi\n')
    got = sorted((p.line, p.path, p.message.split(' (')[0]) for p in validate_file(cfg))
    assert got == [(5, 'tools[0].options.times', 'greet_with_options tool: Input should be greater than or equal to 1'),
                   (6, 'tools[0].options.greeting', 'greet_with_options tool: Input should be a valid string'),
                   (7, 'tools[0].options.colour', "greet_with_options tool: unknown key 'colour'"),
                   (8, 'tools[0].options.greetin',
                    "greet_with_options tool: unknown key 'greetin'; did you mean 'greeting'?")]
    assert all(p.message.endswith('(known: greeting, times)') for p in validate_file(cfg) if 'unknown key' in p.message)
    cfg.write_text('name: g\ntools:\n  - name: greet_with_options\n    options: {times: 2}\n')
    assert load_scheduler(str(cfg)).runner.tools['greet_with_options'].fn('Ann') == 'hello Annhello Ann'


def test_a_registered_tool_can_check_its_options_itself_and_a_plain_one_takes_none(tmp_path):
    """``register_tool(factory=True, options=check)``: the check's problems are reported at their
    keys; a plain function (no factory) takes no options, and each one given is reported."""
    from mtflow.tools import register_tool

    def check(options):
        return [((key, ), f'option {key!r} must be even, got {value!r}') for key, value in options.items()
                if value % 2]

    @register_tool('even_counter', factory=True, options=check)
    def make(options):
        def count(n: int) -> int:
            """Count."""
            return n + sum(options.values())

        return count

    @register_tool('plain_echo')
    def plain_echo(text: str) -> str:
        """Echo."""
        return text

    cfg = tmp_path / 's.yaml'
    cfg.write_text('name: g\ntools:\n  - name: even_counter\n    options:\n      a: 2\n      b: 3\n'
                   '  - name: plain_echo\n    options:\n      loud: true\n')
    got = [(p.line, p.path, p.message) for p in validate_file(cfg)]
    assert got == [(6, 'tools[0].options.b', "even_counter tool: option 'b' must be even, got 3"),
                   (9, 'tools[1].options.loud', "plain_echo tool: unknown key 'loud': this tool takes no options")]
    cfg.write_text('name: g\ntools:\n  - name: even_counter\n    options: {a: 2}\n  - name: plain_echo\n')
    tools = load_scheduler(str(cfg)).runner.tools
    assert (tools['even_counter'].fn(1), tools['plain_echo'].fn('hi')) == (3, 'hi')
