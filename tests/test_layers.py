"""The layering of docs/architecture.md, checked against the package's own imports.

Every import of an mtflow module (at module level or inside a function; not under
``if TYPE_CHECKING:``) must name the importing module's own package or a lower layer; the modules
of one package must not import each other in a circle; and an import of mtflow's own modules made
inside a function must say why on its line (``# lazy: ...``), since the only good reasons are an
optional heavy dependency or a start-up cost."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / 'mtflow'
MAX_LAZY = 15


def layer_ranks() -> Dict[str, int]:
    text = (ROOT / 'docs' / 'architecture.md').read_text()
    table = text[text.index('<!-- layers: begin'):text.index('<!-- layers: end')]
    ranks = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip('|').split('|')]
        if len(cells) >= 2 and cells[0].isdigit():
            for name in re.findall(r'`([\w.]+)`', cells[1]):
                ranks[name] = int(cells[0])
    return ranks


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix('').parts)
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def modules() -> Dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob('*.py'))}


def layer_of(module: str, ranks: Dict[str, int]) -> str:
    """The longest layer name that is ``module`` or one of its parents."""
    parts = module.split('.')
    for i in range(len(parts), 0, -1):
        name = '.'.join(parts[:i])
        if name in ranks:
            return name
    raise AssertionError(f'{module} is in no layer of docs/architecture.md')


def imports(path: Path, module: str, known: Dict[str, Path]) -> List[Tuple[int, str, bool, str]]:
    """``(line, target module, inside a function, source line)`` for each import of mtflow."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        up, inside, guarded = parents.get(node), False, False
        while up is not None:
            inside = inside or isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef))
            guarded = guarded or (isinstance(up, ast.If) and 'TYPE_CHECKING' in ast.unparse(up.test))
            up = parents.get(up)
        if guarded:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = module.split('.') if path.name == '__init__.py' else module.split('.')[:-1]
            base = base[:len(base) - (node.level - 1)] if node.level else []
            parent = '.'.join(base + ([node.module] if node.module else []))
            targets = [f'{parent}.{a.name}' if f'{parent}.{a.name}' in known else parent for a in node.names]
        resolved = set()
        for target in targets:
            while target not in known and '.' in target:
                target = target.rsplit('.', 1)[0]
            if target in known and target != module and target.split('.')[0] == 'mtflow':
                resolved.add(target)
        found.extend((node.lineno, target, inside, lines[node.lineno - 1]) for target in sorted(resolved))
    return found


def test_every_import_runs_down_the_layers():
    ranks, known = layer_ranks(), modules()
    upward = []
    for module, path in known.items():
        here = layer_of(module, ranks)
        for line, target, _, _ in imports(path, module, known):
            there = layer_of(target, ranks)
            if module.startswith(target + '.'):  # a module may use its own package's face
                continue
            if ranks[there] > ranks[here] or (ranks[there] == ranks[here] and there != here):
                upward.append(f'{path.relative_to(ROOT)}:{line} {module} ({here}, {ranks[here]}) imports '
                              f'{target} ({there}, {ranks[there]})')
    assert not upward, 'imports that run back up a layer:\n' + '\n'.join(upward)


def test_no_import_circles():
    known = modules()
    edges: Dict[str, Set[str]] = {m: set() for m in known}
    for module, path in known.items():
        for _, target, _, _ in imports(path, module, known):
            if not module.startswith(target + '.'):  # a package face re-exporting its children
                edges[module].add(target)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    circles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(' <-> '.join(sorted(component)))

    for module in sorted(known):
        if module not in index:
            visit(module)
    assert not circles, 'import circles:\n' + '\n'.join(circles)


def test_imports_inside_functions_say_why_and_are_few():
    known = modules()
    lazy, silent = [], []
    for module, path in known.items():
        for line, target, inside, text in imports(path, module, known):
            if inside:
                lazy.append(f'{path.relative_to(ROOT)}:{line} {target}')
                if '# lazy:' not in text:
                    silent.append(f'{path.relative_to(ROOT)}:{line} {text.strip()}')
    assert not silent, "imports of mtflow inside functions without a '# lazy: <why>' comment:\n" + '\n'.join(silent)
    assert len(lazy) < MAX_LAZY, f'{len(lazy)} imports of mtflow inside functions:\n' + '\n'.join(lazy)


def test_every_package_is_in_a_layer():
    ranks = layer_ranks()
    for module in modules():
        layer_of(module, ranks)
