"""Reading YAML that may be hostile: one loader for scheduler files and run configs.

``yaml.safe_load`` builds no Python objects from tags, but it still accepts inputs that hurt:

- **alias bombs** ("billion laughs"): a 1 KB file whose aliases expand to 10**9 nodes. pyyaml
  itself shares the aliased objects, but everything that walks the data afterwards (line maps,
  pydantic, ``json.dumps``) expands them, and hangs;
- **duplicate keys**, where the last one silently wins;
- **YAML 1.1 scalars**: ``yes``/``no``/``on``/``off`` as booleans, ``1:30`` as 90, ``010`` as 8,
  dates as ``datetime``;
- bytes that are not UTF-8 (a ``UnicodeDecodeError`` traceback), huge files, deep nesting.

:func:`load_yaml` is safe *by construction*: the composer counts every node the document would
expand to **while composing** (an alias costs the size of what it names, memoised per node), so
it stops at the first alias that pushes the document past ``max_nodes``, before anything walks
the data; a recursive alias is refused the same way. Scalars follow the YAML 1.2 core schema
(``true``/``false`` only, decimal/``0o``/``0x`` ints, no timestamps). Every problem is a
:class:`YamlProblem` with its 1-based line; duplicate keys are all reported (both lines), the
other problems stop the read.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import yaml
from yaml.composer import ComposerError
from yaml.events import AliasEvent, MappingStartEvent, ScalarEvent, SequenceStartEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

__all__ = ['YamlProblem', 'YamlLoadError', 'load_yaml', 'load_yaml_file', 'MAX_BYTES', 'MAX_NODES', 'MAX_DEPTH']

#: the largest file read (a scheduler or run config is a few KB)
MAX_BYTES = 1 << 20
#: the most nodes a document may expand to, aliases included
MAX_NODES = 100_000
#: the deepest nesting of mappings and lists
MAX_DEPTH = 64

Loc = Tuple[Union[str, int], ...]


@dataclass(frozen=True)
class YamlProblem:
    """One thing wrong with the YAML itself (not with what it means)."""
    line: Optional[int]
    path: Loc
    message: str


class YamlLoadError(ValueError):
    """The document cannot be used; ``problems`` says why (with lines)."""

    def __init__(self, problems: List[YamlProblem]) -> None:
        self.problems = problems
        super().__init__('; '.join(p.message for p in problems))


class _Stop(Exception):
    """Raised inside the composer to abandon the document at once."""

    def __init__(self, line: Optional[int], message: str) -> None:
        super().__init__(message)
        self.line, self.message = line, message


class _CoreResolver(yaml.resolver.Resolver):
    """YAML 1.2 core schema resolvers (no YAML 1.1 booleans, sexagesimals, octal ``010`` or dates)."""


_CoreResolver.yaml_implicit_resolvers = {}
for _tag, _regexp, _first in (
    ('tag:yaml.org,2002:bool', r'^(?:true|True|TRUE|false|False|FALSE)$', 'tTfF'),
    ('tag:yaml.org,2002:int', r'^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$', '-+0123456789'),
    ('tag:yaml.org,2002:float', r'^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?'
     r'|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$', '-+0123456789.'),
    ('tag:yaml.org,2002:null', r'^(?:~|null|Null|NULL|)$', ['~', 'n', 'N', '']),
):
    _CoreResolver.add_implicit_resolver(_tag, re.compile(_regexp), list(_first))
_CoreResolver.add_implicit_resolver('tag:yaml.org,2002:merge', re.compile(r'^(?:<<)$'), ['<'])


class _CoreConstructor(yaml.constructor.SafeConstructor):
    """Safe constructors, with YAML 1.2 ints (``0o17``, ``0x1F``; a leading zero is decimal)."""

    def construct_yaml_int(self, node: Node) -> int:
        value = self.construct_scalar(node).replace('_', '')
        sign = -1 if value.startswith('-') else 1
        value = value.lstrip('+-')
        if value.startswith('0o'):
            return sign * int(value[2:], 8)
        if value.startswith('0x'):
            return sign * int(value[2:], 16)
        return sign * int(value, 10)


_CoreConstructor.add_constructor('tag:yaml.org,2002:int', _CoreConstructor.construct_yaml_int)


class _Anchors(dict):
    """The composer's anchor table, noting each anchored node as open when it is registered."""

    def __init__(self, open_nodes: set) -> None:
        super().__init__()
        self.open_nodes = open_nodes

    def __setitem__(self, key: str, node: Node) -> None:
        self.open_nodes.add(id(node))
        super().__setitem__(key, node)


class _BoundedLoader(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser, yaml.composer.Composer,
                     _CoreConstructor, _CoreResolver):
    """pyyaml's safe loader with a composer that counts expanded nodes and depth as it goes."""

    def __init__(self, stream: str, max_nodes: int, max_depth: int) -> None:
        yaml.reader.Reader.__init__(self, stream)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        yaml.composer.Composer.__init__(self)
        _CoreConstructor.__init__(self)
        _CoreResolver.__init__(self)
        self.max_nodes, self.max_depth = max_nodes, max_depth
        self.expanded = 0  # nodes the document expands to so far
        self.depth = 0
        self.sizes: Dict[int, int] = {}  # id(node) -> expanded size, for finished nodes
        self.open: set = set()  # ids of anchored collection nodes still being composed
        # pyyaml registers an anchored collection before composing its children (which may alias
        # it): note it as open there, so that a recursive alias is refused, not expanded
        self.anchors = _Anchors(self.open)

    def compose_node(self, parent: Optional[Node], index: Any) -> Node:
        if self.check_event(AliasEvent):
            event = self.peek_event()
            line = event.start_mark.line + 1
            node = super().compose_node(parent, index)
            if id(node) in self.open:
                raise _Stop(line, f'alias *{event.anchor} refers to a node that contains it (a recursive alias)')
            self._spend(self.sizes[id(node)], line, f'alias *{event.anchor}')
            return node
        event = self.peek_event()
        line = event.start_mark.line + 1
        collection = isinstance(event, (SequenceStartEvent, MappingStartEvent))
        if collection:
            self.depth += 1
            if self.depth > self.max_depth:
                raise _Stop(line, f'nesting deeper than {self.max_depth} levels')
        self._spend(1, line, None)
        node = super().compose_node(parent, index)
        if collection:
            self.depth -= 1
            self.open.discard(id(node))
            if isinstance(node, SequenceNode):
                self.sizes[id(node)] = 1 + sum(self.sizes[id(c)] for c in node.value)
            else:
                self.sizes[id(node)] = 1 + sum(self.sizes[id(k)] + self.sizes[id(v)] for k, v in node.value)
        else:
            self.sizes[id(node)] = 1
        return node

    def _spend(self, n: int, line: int, alias: Optional[str]) -> None:
        self.expanded += n
        if self.expanded > self.max_nodes:
            what = f'{alias} expands' if alias else 'the document has'
            raise _Stop(line, f'{what} past {self.max_nodes} nodes (alias bombs are refused)')


def _duplicate_keys(node: Node, loc: Loc = (), seen_nodes: Optional[set] = None) -> List[YamlProblem]:
    """Every duplicate key of every mapping, with both lines (a shared, aliased node once)."""
    seen_nodes = set() if seen_nodes is None else seen_nodes
    if id(node) in seen_nodes:
        return []
    seen_nodes.add(id(node))
    problems: List[YamlProblem] = []
    if isinstance(node, MappingNode):
        first: Dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, ScalarNode) else None
            sub = loc + (str(key), ) if key is not None else loc
            if key is not None and key_node.tag != 'tag:yaml.org,2002:merge':
                line = key_node.start_mark.line + 1
                if key in first:
                    problems.append(YamlProblem(line, sub, f'duplicate key {key!r} (first at line {first[key]})'))
                else:
                    first[key] = line
            problems += _duplicate_keys(value_node, sub, seen_nodes)
    elif isinstance(node, SequenceNode):
        for i, item in enumerate(node.value):
            problems += _duplicate_keys(item, loc + (i, ), seen_nodes)
    return problems


_STR = 'tag:yaml.org,2002:str'
_MERGE = 'tag:yaml.org,2002:merge'


def _non_string_keys(node: Node) -> List[YamlProblem]:
    """Mapping keys that are not strings (``1:``, ``true:``, ``? [a]``): config keys are names."""
    problems: List[YamlProblem] = []
    seen: set = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if isinstance(n, MappingNode):
            for k, v in n.value:
                if not (isinstance(k, ScalarNode) and k.tag in (_STR, _MERGE)):
                    shown = k.value if isinstance(k, ScalarNode) else type(k).__name__.replace('Node', '').lower()
                    problems.append(YamlProblem(k.start_mark.line + 1, (), f'key {shown!r} is not a string; '
                                                'quote it (keys are names)'))
                stack.append(v)
        elif isinstance(n, SequenceNode):
            stack.extend(n.value)
    return sorted(problems, key=lambda p: p.line or 0)


def _decode(data: bytes) -> str:
    try:
        return data.decode('utf-8-sig')
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b'\n') + 1
        raise YamlLoadError([YamlProblem(line, (), f'not UTF-8 text: byte 0x{data[exc.start]:02x} at line {line} '
                                         f'cannot be decoded (save the file as UTF-8)')]) from None


def load_yaml(source: Union[str, bytes], max_bytes: int = MAX_BYTES, max_nodes: int = MAX_NODES,
              max_depth: int = MAX_DEPTH) -> Tuple[Any, Optional[Node], List[YamlProblem]]:
    """``(data, root node, duplicate-key problems)`` of one YAML document.

    Raises :class:`YamlLoadError` for a document that cannot be used at all: too large, not UTF-8,
    a syntax error, an alias bomb or recursive alias, nesting past ``max_depth``, a tag the safe
    loader refuses (``!!python/...``), several documents. Duplicate keys do not stop the read:
    they are returned (the data keeps the last value) so the caller reports them with the rest."""
    size = len(source.encode('utf-8') if isinstance(source, str) else source)
    if size > max_bytes:
        raise YamlLoadError([YamlProblem(None, (), f'file is {size} bytes; the limit is {max_bytes}')])
    text = _decode(source) if isinstance(source, bytes) else source
    try:
        loader = _BoundedLoader(text, max_nodes, max_depth)
    except yaml.reader.ReaderError as exc:  # control characters (checked before parsing starts)
        line = text[:exc.position].count('\n') + 1
        raise YamlLoadError([YamlProblem(line, (), f'character 0x{exc.character:02x} at line {line} is not allowed in '
                                         'YAML (control characters)')]) from None
    try:
        try:
            node = loader.get_single_node()
        except _Stop as exc:
            raise YamlLoadError([YamlProblem(exc.line, (), exc.message)]) from None
        except ComposerError as exc:
            mark = exc.problem_mark or exc.context_mark
            what = f'{exc.context}; {exc.problem}' if exc.context else exc.problem
            raise YamlLoadError([YamlProblem(mark.line + 1 if mark else None, (), f'YAML error: {what}')]) from None
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            raise YamlLoadError([YamlProblem(mark.line + 1 if mark else None, (),
                                             f'YAML syntax error: {exc.problem or exc}')]) from None
        except yaml.reader.ReaderError as exc:  # control characters further in the stream
            line = text[:exc.position].count('\n') + 1
            raise YamlLoadError([YamlProblem(line, (), f'character 0x{exc.character:02x} at line {line} is not '
                                             'allowed in YAML (control characters)')]) from None
        except yaml.YAMLError as exc:
            raise YamlLoadError([YamlProblem(None, (), f'YAML error: {exc}')]) from None
        except RecursionError:
            raise YamlLoadError([YamlProblem(None, (), f'nesting deeper than {max_depth} levels')]) from None
        if node is None:
            return None, None, []
        bad_keys = _non_string_keys(node)
        if bad_keys:
            raise YamlLoadError(bad_keys)
        duplicates = _duplicate_keys(node)
        try:
            data = loader.construct_document(node)
        except yaml.constructor.ConstructorError as exc:
            mark = exc.problem_mark or exc.context_mark
            raise YamlLoadError([YamlProblem(mark.line + 1 if mark else None, (),
                                             f'YAML error: {exc.problem or exc}')]) from None
        except (ValueError, TypeError, OverflowError) as exc:  # e.g. an unhashable or huge key
            raise YamlLoadError([YamlProblem(None, (), f'YAML error: {exc}')]) from None
        return data, node, duplicates
    finally:
        loader.dispose()


def load_yaml_file(path: str, **limits: Any) -> Tuple[Any, Optional[Node], List[YamlProblem]]:
    """:func:`load_yaml` of a file, reading at most one byte past the size limit.

    Raises ``OSError`` when the file cannot be read."""
    max_bytes = limits.get('max_bytes', MAX_BYTES)
    with open(path, 'rb') as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise YamlLoadError([YamlProblem(None, (), f'file is larger than the limit of {max_bytes} bytes')])
    return load_yaml(data, **limits)
