"""Loading and validating scheduler YAML: ``yaml.safe_load`` for the data, and the node tree
(``yaml.compose`` with the safe loader, which builds no Python objects) for line numbers, so
every problem names its file, line and field path.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import yaml
from pydantic import ValidationError

from .schema import SchedulerConfig, cross_problems

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


def _line_of(lines: Dict[Loc, int], loc: Loc) -> Optional[int]:
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
        return f'unknown key {err["loc"][-1]!r}'
    if kind == 'missing':
        return f'missing required key {err["loc"][-1]!r}'
    if msg.startswith('Value error, '):
        msg = msg[len('Value error, '):]
    if kind not in ('value_error', 'assertion_error') and 'input' in err and not isinstance(err['input'], (dict, list)):
        msg += f' (got {err["input"]!r})'
    return msg


def _problems_from_validation(exc: ValidationError, file: str, lines: Dict[Loc, int]) -> List[Problem]:
    problems = []
    for err in exc.errors(include_url=False):
        loc = _clean_loc(tuple(err['loc']))
        problems.append(Problem(file, _line_of(lines, loc), format_path(loc), _message(err, SchedulerConfig)))
    return problems


def read_yaml(path: str) -> Tuple[Any, Dict[Loc, int], List[Problem]]:
    """(data, line map, problems) for one file; a YAML syntax error is one problem with its line."""
    with open(path, encoding='utf-8') as f:
        text = f.read()
    try:
        data = yaml.safe_load(text)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        return None, {}, [Problem(path, line, '', f'YAML syntax error: {exc.problem or exc}')]
    except yaml.YAMLError as exc:
        return None, {}, [Problem(path, None, '', f'YAML error: {exc}')]
    return data, _line_map(node) if node is not None else {(): 1}, []


def check_data(data: Any, file: str, lines: Dict[Loc, int], base_dir: Optional[str],
               resolve: bool = True) -> Tuple[Optional[SchedulerConfig], List[Problem]]:
    """Validate a mapping; return the config (when valid) and every problem found."""
    if not isinstance(data, dict):
        got = 'an empty file' if data is None else type(data).__name__
        return None, [Problem(file, 1, '', f'a scheduler config must be a mapping, got {got}')]
    problems: List[Problem] = []
    config = None
    try:
        config = SchedulerConfig.model_validate(data, context={'base_dir': base_dir, 'resolve': resolve,
                                                               'cross_check': False})
    except ValidationError as exc:
        problems.extend(_problems_from_validation(exc, file, lines))
    for loc, msg in cross_problems(data):
        problems.append(Problem(file, _line_of(lines, loc), format_path(loc), msg))
    problems.sort(key=lambda p: p.line or 0)
    return (config if not problems else None), problems


def build_problems(config: SchedulerConfig, file: str, lines: Dict[Loc, int],
                   base_dir: Optional[str]) -> List[Problem]:
    """Problems only building finds: a built-in tool's options, a parser's options, an
    environment's kwargs (each is tried once, as the scheduler will build it)."""
    from ..tools.registry import make_builtin
    from .envs import make_env_factory
    from .parsers import get_parser

    found: List[Tuple[Loc, str]] = []
    for i, tc in enumerate(config.tools):
        if tc.builtin:
            try:
                make_builtin(tc.builtin, tc.options)
            except (KeyError, ValueError, TypeError) as exc:
                found.append((('tools', i, 'options'), str(exc).strip('"')))
    try:
        get_parser(config.parser, config.parser_options, base_dir)
    except Exception as exc:
        found.append((('parser_options', ), f'{type(exc).__name__}: {exc}'))
    if config.env is not None:
        try:
            make_env_factory(config.env, base_dir)
        except Exception as exc:
            from .envs import env_kind
            kind = env_kind(config.env)
            what = getattr(config.env, kind)
            name = what if isinstance(what, str) else getattr(what, 'id', kind)
            found.append((('env', 'kwargs' if kind in ('impl', 'gym') else kind),
                          f'cannot create environment {name!r}: {type(exc).__name__}: {exc}'))
    return [Problem(file, _line_of(lines, loc), format_path(loc), msg) for loc, msg in found]


def validate_file(path: Union[str, os.PathLike]) -> List[Problem]:
    """Every problem in a scheduler YAML file (empty when it is valid): YAML syntax, unknown keys,
    wrong types, unknown tools, parsers or environments, unresolvable imports, regexes that do not
    compile, options a built-in rejects."""
    path = os.fspath(path)
    try:
        data, lines, problems = read_yaml(path)
    except OSError as exc:
        return [Problem(path, None, '', f'cannot read: {exc.strerror or exc}')]
    if problems:
        return problems
    base_dir = os.path.dirname(os.path.abspath(path))
    config, problems = check_data(data, path, lines, base_dir)
    if config is not None:
        problems = build_problems(config, path, lines, base_dir)
    return problems


def load_config(source: Union[str, os.PathLike, Dict[str, Any], SchedulerConfig],
                base_dir: Optional[str] = None) -> Tuple[SchedulerConfig, Optional[str]]:
    """``(config, base_dir)`` from a YAML path, a mapping or a config; raises
    :class:`ConfigError` listing every problem (with lines when read from a file)."""
    if isinstance(source, SchedulerConfig):
        return source, base_dir
    lines: Dict[Loc, int] = {}
    if isinstance(source, (str, os.PathLike)):
        file = os.fspath(source)
        base_dir = base_dir or os.path.dirname(os.path.abspath(file))
        data, lines, problems = read_yaml(file)
        if problems:
            raise ConfigError(problems)
    elif isinstance(source, dict):
        data, file = source, '<dict>'
    else:
        raise TypeError(f'a scheduler config is a YAML path, a dict or a SchedulerConfig, not {type(source).__name__}')
    config, problems = check_data(data, file, lines, base_dir)
    if config is not None:
        problems = build_problems(config, file, lines, base_dir)
    if problems:
        raise ConfigError(problems)
    return config, base_dir


__all__ = ['Problem', 'ConfigError', 'validate_file', 'load_config', 'read_yaml', 'check_data', 'format_path']
