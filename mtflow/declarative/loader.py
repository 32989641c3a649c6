"""Loading and validating scheduler YAML, so that every problem names its file, line and field
path, and every problem of a file is reported at once, before anything runs.

The file is read by :mod:`mtflow.core.safe_yaml` (bounded aliases, duplicate keys, UTF-8, YAML 1.2
scalars, a size limit); its node tree gives the line numbers. Then, in order: the ``plugins:``
modules are imported (their ``register_*`` calls must run before names are checked), the schema
is validated (pydantic, strict types), the sections are checked against each other, and what
only building finds is tried section by section on the raw data (a built-in's options, a
parser's options, an environment's kwargs, ``scheduler_class``), so a problem in one section
never hides another's.
"""
from __future__ import annotations

import os
import typing
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import yaml
from pydantic import BaseModel, ValidationError

from mtflow.core.keys import unknown_key_message
from mtflow.core.registry import import_plugins, loaded_entry_points, resolve_reference
from mtflow.core.safe_yaml import YamlLoadError, YamlProblem, load_yaml_file
from mtflow.declarative.envs import env_kind, make_env_factory
from mtflow.declarative.gym import ENVS
from mtflow.declarative.parsers import PARSERS, get_parser
from mtflow.declarative.reasoning import family_mismatch, reasoning_parser
from mtflow.declarative.scheduler import YamlScheduler
from mtflow.declarative.schema import EnvConfig, SchedulerConfig, cross_problems
from mtflow.tools.registry import TOOLS, check_builtin_options, make_builtin
from mtflow.tools.tool import parameters_problems

Loc = Tuple[Union[str, int], ...]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config file."""
    file: str
    line: Optional[int]
    path: str
    message: str

    @property
    def field(self) -> str:
        """The field path (same as ``path``), e.g. ``tools[0].impl``."""
        return self.path

    def __str__(self) -> str:
        where = f'{self.file}:{self.line}' if self.line else self.file
        return f'{where}: {self.path or "<root>"}: {self.message}'


class ConfigError(ValueError):
    """A config with problems; ``problems`` lists all of them."""

    def __init__(self, problems: List[Problem]) -> None:
        self.problems = problems
        super().__init__('\n'.join(map(str, problems)))


def format_path(loc: Loc) -> str:
    out = ''
    for part in loc:
        out += f'[{part}]' if isinstance(part, int) else (f'.{part}' if out else str(part))
    return out


def _line_map(node: Any, loc: Loc = (), lines: Optional[Dict[Loc, int]] = None) -> Dict[Loc, int]:
    """``loc -> 1-based line``: a mapping entry's line is its key's, a list item's its own."""
    if lines is None:
        lines = {(): node.start_mark.line + 1 if node is not None else 1}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value
            sub = loc + (key, )
            lines[sub] = key_node.start_mark.line + 1
            _line_map(value_node, sub, lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            sub = loc + (i, )
            lines[sub] = item.start_mark.line + 1
            _line_map(item, sub, lines)
    return lines


def line_of(lines: Dict[Loc, int], loc: Loc) -> Optional[int]:
    """The line of ``loc`` in a file's line map, else of the nearest key above it."""
    for n in range(len(loc), -1, -1):
        if loc[:n] in lines:
            return lines[loc[:n]]
    return None


def _clean_loc(loc: Loc) -> Loc:
    """pydantic adds union/function tags to locations; keep only real keys and indices."""
    return tuple(p for p in loc if isinstance(p, int) or not (str(p).startswith('function-') or '[' in str(p)))


def _message(err: Dict[str, Any], model: Any) -> str:
    kind, msg = err['type'], err['msg']
    if kind == 'extra_forbidden':
        loc = _clean_loc(tuple(err['loc']))
        known = _known_keys(model, loc[:-1])
        return unknown_key_message(str(loc[-1]), known) if known else f'unknown key {loc[-1]!r}'
    if kind == 'missing':
        return f'missing required key {err["loc"][-1]!r}'
    if msg.startswith('Value error, '):
        msg = msg[len('Value error, '):]
    if kind not in ('value_error', 'assertion_error') and 'input' in err and not isinstance(err['input'], (dict, list)):
        msg += f' (got {err["input"]!r})'
        if isinstance(err['input'], str) and err['input'].lower() in _YAML11_WORDS:
            msg += '; YAML 1.1 words are plain strings here: write true or false'
    return msg


_YAML11_WORDS = {'yes', 'no', 'on', 'off', 'y', 'n'}


def _models_in(annotation: Any) -> List[type]:
    """The pydantic models an annotation holds (``Optional[M]``, ``List[M]``, ``Dict[str, M]``,
    unions), outermost first."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: List[type] = []
    for arg in typing.get_args(annotation):
        out += _models_in(arg)
    return out


def _known_keys(model: Any, loc: Loc) -> List[str]:
    """The keys the mapping at ``loc`` of a ``model`` document may have (``[]``: not a model)."""
    models = [model]
    for part in loc:
        if isinstance(part, int):
            continue  # a list item: the same models
        nxt: List[type] = []
        for m in models:
            field = getattr(m, 'model_fields', {}).get(part)
            if field is not None:
                nxt += _models_in(field.annotation)
        models = nxt
        if not models:
            return []
    keys: List[str] = []
    for m in models:
        keys += [k for k in m.model_fields if k not in keys]
    return keys


def validation_problems(exc: ValidationError, file: str, lines: Dict[Loc, int],
                        model: Any = SchedulerConfig) -> List[Problem]:
    """A pydantic validation of a ``model`` document (a scheduler file, an episode file) as
    problems, each at its file, line and field path (an unknown key with the closest known one)."""
    problems = []
    for err in exc.errors(include_url=False):
        loc = _clean_loc(tuple(err['loc']))
        problems.append(Problem(file, line_of(lines, loc), format_path(loc), _message(err, model)))
    return problems


def _problem(file: str, p: YamlProblem) -> Problem:
    return Problem(file, p.line, format_path(p.path), p.message)


def read_yaml(path: str) -> Tuple[Any, Dict[Loc, int], List[Problem], bool]:
    """``(data, line map, problems, fatal)`` for one file. ``fatal``: the YAML itself is unusable
    (syntax, encoding, size, an alias bomb), ``problems`` says why; otherwise ``problems`` holds
    the duplicate keys (the data keeps the last value) and checking goes on."""
    try:
        data, node, duplicates = load_yaml_file(path)
    except YamlLoadError as exc:
        return None, {}, [_problem(path, p) for p in exc.problems], True
    return data, _line_map(node) if node is not None else {(): 1}, [_problem(path, p) for p in duplicates], False


def _under(loc: Loc, problems: List[Problem]) -> bool:
    """Whether a problem was already reported at ``loc`` or below it."""
    path = format_path(loc)
    return any(p.path == path or p.path.startswith(path + '.') or p.path.startswith(path + '[') for p in problems)


def _plugin_problems(data: Dict[str, Any], base_dir: Optional[str]) -> List[Tuple[Loc, str]]:
    """Import the ``plugins:`` modules first, so that the names they register are known."""
    plugins = data.get('plugins')
    if not isinstance(plugins, list) or not all(isinstance(m, str) for m in plugins):
        return []  # the schema reports the type
    return [(('plugins', i), msg) for i, msg in import_plugins(plugins, base_dir)]


def check_data(data: Any, file: str, lines: Dict[Loc, int], base_dir: Optional[str],
               resolve: bool = True) -> Tuple[Optional[SchedulerConfig], List[Problem]]:
    """Validate a mapping; return the config (when valid) and every problem found."""
    if not isinstance(data, dict):
        got = 'an empty file' if data is None else type(data).__name__
        return None, [Problem(file, 1, '', f'a scheduler config must be a mapping, got {got}')]
    problems: List[Problem] = []
    if resolve:
        problems += [Problem(file, line_of(lines, loc), format_path(loc), msg)
                     for loc, msg in _plugin_problems(data, base_dir)]
    config = None
    try:
        config = SchedulerConfig.model_validate(data, context={'base_dir': base_dir, 'resolve': resolve,
                                                               'cross_check': False})
    except ValidationError as exc:
        problems.extend(validation_problems(exc, file, lines))
    for loc, msg in cross_problems(data):
        problems.append(Problem(file, line_of(lines, loc), format_path(loc), msg))
    if resolve:
        for loc, msg in _build_problems(data, base_dir, problems):
            problems.append(Problem(file, line_of(lines, loc), format_path(loc), msg))
    problems.sort(key=lambda p: p.line or 0)
    return (config if not problems else None), problems


def _build_problems(data: Dict[str, Any], base_dir: Optional[str], found: List[Problem]) -> List[Tuple[Loc, str]]:
    """What only building finds, tried section by section on the raw mapping (a section the
    schema already flagged is skipped): a built-in's options, a tool's declared parameters against
    its function's signature, a parser's options, an environment's kwargs, and ``scheduler_class`` being a :class:`YamlScheduler` subclass."""
    out: List[Tuple[Loc, str]] = []
    tools = data.get('tools') if isinstance(data.get('tools'), list) else []
    for i, tc in enumerate(tools):
        if isinstance(tc, dict):
            out += _tool_problems(('tools', i), tc, base_dir, found)
    parser, options = data.get('parser', 'hermes'), data.get('parser_options', {})
    if isinstance(parser, str) and isinstance(options, dict) and not _under(('parser', ), found) and \
            not _under(('parser_options', ), found):
        try:
            get_parser(parser, options, base_dir)
        except (ImportError, RuntimeError) as exc:  # a missing package or what it needs (harmony's vocabulary)
            out.append((('parser', ), str(exc)))
        except Exception as exc:
            out.append((('parser_options', ), f'{type(exc).__name__}: {exc}'))
    reasoning = data.get('reasoning', 'auto')
    reasoning = reasoning.get('parser', 'auto') if isinstance(reasoning, dict) else reasoning
    parser_failed = any(loc == ('parser', ) for loc, _ in out)  # (harmony: the same missing package, said once)
    if isinstance(reasoning, str) and isinstance(parser, str) and not _under(('reasoning', ), found) and \
            not parser_failed:
        try:
            reasoning_parser(reasoning, parser, base_dir=base_dir)
        except Exception as exc:
            out.append((('reasoning', ), str(exc) if isinstance(exc, (ImportError, RuntimeError)) else
                        f'{type(exc).__name__}: {exc}'))
        else:
            mismatch = family_mismatch(reasoning, parser)
            if mismatch:
                out.append((('reasoning', ), mismatch))
    env = data.get('env')
    if isinstance(env, dict) and not _under(('env', ), found):
        out += _env_problems(env, base_dir)
    ref = data.get('scheduler_class')
    if isinstance(ref, str) and not _under(('scheduler_class', ), found):
        try:
            cls = resolve_reference(ref, base_dir)
        except Exception:
            cls = None  # the schema reports it
        if cls is not None and not (isinstance(cls, type) and issubclass(cls, YamlScheduler)):
            what = f'class {cls.__module__}.{cls.__qualname__}' if isinstance(cls, type) else type(cls).__name__
            out.append((('scheduler_class', ), f'{ref} is not a mtflow.declarative.YamlScheduler subclass (got {what})'))
    return out


def _tool_problems(at: Loc, tc: Dict[str, Any], base_dir: Optional[str], found: List[Problem]) -> List[Tuple[Loc, str]]:
    """What building one ``tools`` entry finds: a built-in's options, and declared ``parameters``
    that its function's signature would refuse (:func:`mtflow.tools.tool.parameters_problems`),
    each at the line of the parameter."""
    out: List[Tuple[Loc, str]] = []
    fn = None
    if tc.get('impl'):
        try:
            fn = resolve_reference(tc['impl'], base_dir) if isinstance(tc['impl'], str) else None
        except Exception:
            fn = None  # the schema reports it
    elif not _under(at + ('options', ), found):
        name, options = tc.get('builtin') or tc.get('name'), tc.get('options', {})
        if not isinstance(name, str) or name not in TOOLS.names() or not isinstance(options, dict):
            return out
        try:
            bad = check_builtin_options(name, options)
            if not bad:
                fn = make_builtin(name, options)
        except ImportError as exc:  # an installed plugin's entry point that does not load
            return [(at, str(exc))]
        except (KeyError, ValueError, TypeError) as exc:
            return [(at + ('options', ), str(exc).strip('"'))]
        except Exception as exc:  # the factory itself failed
            return [(at + ('options', ), f'{type(exc).__name__}: {exc}')]
        out += [(at + ('options', ) + tuple(loc), msg) for loc, msg in bad]
    params = tc.get('parameters')
    if callable(fn) and isinstance(params, dict) and not _under(at + ('parameters', ), found):
        out += [(at + ('parameters', ) + where, f'tool {tc.get("name")!r}: {msg}')
                for where, msg in parameters_problems(fn, params)]
    return out


def _env_problems(env: Dict[str, Any], base_dir: Optional[str]) -> List[Tuple[Loc, str]]:
    """Build the ``env`` section's factory once, whatever its kind (impl, gym, openenv,
    textarena, skyrl_gym, gem, nemo_gym, verifiers), as the scheduler will: the class's kwargs,
    a game or environment id, a missing extra.
    Nothing is launched or connected (an OpenEnv pool starts its servers at the first session)."""
    try:
        env_cfg = EnvConfig.model_validate(env, context={'base_dir': base_dir, 'resolve': True})
    except ValidationError:
        return []  # the schema reports it, with its lines
    kind = env_kind(env_cfg)
    what = getattr(env_cfg, kind)
    name = what if isinstance(what, str) else getattr(what, 'id', None) or getattr(what, 'taskset', kind)
    try:
        factory = make_env_factory(env_cfg, base_dir)
    except ImportError as exc:  # a missing extra, or an entry point that does not load
        return [(('env', kind), str(exc))]
    except Exception as exc:
        return [(('env', 'kwargs' if kind in ('impl', 'gym') else kind),
                 f'cannot create environment {name!r}: {type(exc).__name__}: {exc}')]
    checks = getattr(factory, 'problems', None)  # what the kind checks without starting anything
    found = [(('env', kind, field), msg) for field, msg in checks()] if callable(checks) else []
    close = getattr(factory, 'close', None)
    if callable(close):
        close()
    return found


#: the keys that name Python code (``module:attribute``) the scheduler will import
_REF_FIELDS: Tuple[Loc, ...] = (('parser', ), ('reward', ), ('turn_reward', ), ('scheduler_class', ),
                               ('stop', 'predicate'), ('answer', 'compare'), ('env', 'impl'), ('env', 'gym'),
                               ('env', 'openenv', 'launch'), ('env', 'skyrl_gym', 'id'), ('branch', 'at', 'hook'),
                               ('observation', 'images_from', 'impl'))


def imports_of(data: Any) -> List[Tuple[str, str]]:
    """``(field path, reference)`` of every Python module or callable the config makes mtflow
    import: the safety list ``mtflow validate`` prints (that code runs with your rights)."""
    if not isinstance(data, dict):
        return []
    out: List[Tuple[str, str]] = []
    for i, mod in enumerate(data.get('plugins') or [] if isinstance(data.get('plugins'), list) else []):
        if isinstance(mod, str):
            out.append((format_path(('plugins', i)), mod))
    for i, tc in enumerate(data.get('tools') if isinstance(data.get('tools'), list) else []):
        if isinstance(tc, dict) and isinstance(tc.get('impl'), str):
            out.append((format_path(('tools', i, 'impl')), tc['impl']))
    for i, tip in enumerate(data.get('tips') if isinstance(data.get('tips'), list) else []):
        for key in ('predicate', 'images_impl'):
            if isinstance(tip, dict) and isinstance(tip.get(key), str):
                out.append((format_path(('tips', i, key)), tip[key]))
    for loc in _REF_FIELDS:
        value: Any = data
        for key in loc:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, str) and ':' in value:
            out.append((format_path(loc), value))
    return sorted(out)


@dataclass
class FileReport:
    """What ``mtflow validate`` says about one file: its problems, and the Python it imports
    (``(field, reference)``, entry points of installed packages included)."""
    file: str
    problems: List[Problem]
    imports: List[Tuple[str, str]]


def inspect_file(path: Union[str, os.PathLike]) -> FileReport:
    """Every problem of a scheduler YAML file and every Python reference it names."""
    path = os.fspath(path)
    try:
        data, lines, problems, fatal = read_yaml(path)
    except OSError as exc:
        return FileReport(path, [Problem(path, None, '', f'cannot read: {exc.strerror or exc}')], [])
    if fatal:
        return FileReport(path, problems, [])
    base_dir = os.path.dirname(os.path.abspath(path))
    _, more = check_data(data, path, lines, base_dir)
    problems = sorted(problems + more, key=lambda p: p.line or 0)
    imports = imports_of(data)
    for (group, name), value in loaded_entry_points().items():
        if _names(data, group, name):
            imports.append((f'{group} entry point {name!r}', value))
    return FileReport(path, problems, imports)


def _names(data: Any, group: str, name: str) -> bool:
    """Whether the config names entry point ``name`` of ``group``."""
    if not isinstance(data, dict):
        return False
    if group == PARSERS.group:
        return data.get('parser') == name
    if group == ENVS.group:
        return isinstance(data.get('env'), dict) and data['env'].get('impl') == name
    tools = data.get('tools') if isinstance(data.get('tools'), list) else []
    return any(isinstance(t, dict) and not t.get('impl') and (t.get('builtin') or t.get('name')) == name for t in tools)


def validate_file(path: Union[str, os.PathLike]) -> List[Problem]:
    """Every problem in a scheduler YAML file (empty when it is valid): unusable YAML (syntax,
    encoding, size, alias bombs), duplicate keys, unknown keys, wrong types (strict: no YAML 1.1
    booleans, no bool for an int), unknown tools, parsers or environments, unresolvable imports
    and plugins, regexes that do not compile, unknown template placeholders, options a built-in
    rejects, environment kwargs the class rejects, a ``scheduler_class`` that is no YamlScheduler."""
    return inspect_file(path).problems


def load_config(source: Union[str, os.PathLike, Dict[str, Any], SchedulerConfig],
                base_dir: Optional[str] = None) -> Tuple[SchedulerConfig, Optional[str]]:
    """``(config, base_dir)`` from a YAML path, a mapping or a config; raises
    :class:`ConfigError` listing every problem (with lines when read from a file)."""
    if isinstance(source, SchedulerConfig):
        return source, base_dir
    lines: Dict[Loc, int] = {}
    problems: List[Problem] = []
    if isinstance(source, (str, os.PathLike)):
        file = os.fspath(source)
        base_dir = base_dir or os.path.dirname(os.path.abspath(file))
        try:
            data, lines, problems, fatal = read_yaml(file)
        except OSError as exc:
            raise ConfigError([Problem(file, None, '', f'cannot read: {exc.strerror or exc}')]) from None
        if fatal:
            raise ConfigError(problems)
    elif isinstance(source, dict):
        data, file = source, '<dict>'
    else:
        raise TypeError(f'a scheduler config is a YAML path, a dict or a SchedulerConfig, not {type(source).__name__}')
    config, more = check_data(data, file, lines, base_dir)
    problems = sorted(problems + more, key=lambda p: p.line or 0)
    if problems or config is None:
        raise ConfigError(problems)
    return config, base_dir


__all__ = [
    'Problem', 'ConfigError', 'FileReport', 'validate_file', 'inspect_file', 'imports_of', 'load_config', 'read_yaml',
    'check_data', 'format_path', 'line_of', 'validation_problems'
]
