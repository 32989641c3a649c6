"""Text templates of the YAML (observations, errors, the system prompt): ``{name}`` placeholders
with Python's format syntax, checked when the file is validated.

A placeholder the template does not offer (``{reslt}``) is an error, not text the model reads
verbatim; ``{{`` and ``}}`` write literal braces (JSON in a template: ``{{"result": {result}}}``).
Placeholders are plain names only: ``{result.__class__}`` or ``{result[0]}`` are refused, so a
template can never reach into the objects it is given."""
from __future__ import annotations

import re
import string
from typing import Any, Dict

_NAME = re.compile(r'[A-Za-z_]\w*')

#: template field -> its placeholders and a sample value of each (what rendering will pass)
FIELDS: Dict[str, Dict[str, Any]] = {
    'observation.template': {'name': 'calculator', 'result': '4', 'index': 1},
    'observation.error_template': {'name': 'calculator', 'error': 'division by zero', 'index': 1},
    'system_prompt': {'tools': '<tools>'},
}


def check_template(text: str, fields: Dict[str, Any]) -> str:
    """``text`` when every placeholder is one of ``fields`` and it renders with sample values;
    ``ValueError`` naming the first problem otherwise."""
    known = ', '.join('{' + f + '}' for f in fields)
    escape = 'write {{ and }} for literal braces'
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise ValueError(f'{exc} ({escape})') from None
    for _, field, _, _ in parsed:
        if field is None:
            continue
        if not _NAME.fullmatch(field):
            raise ValueError(f'placeholder {{{field}}} is not a plain name (known: {known}; {escape})')
        if field not in fields:
            raise ValueError(f'unknown placeholder {{{field}}} (known: {known}; {escape})')
    try:
        text.format(**fields)
    except Exception as exc:  # a bad format spec, e.g. {index:q}
        raise ValueError(f'template does not render: {type(exc).__name__}: {exc}') from None
    return text


def render(text: str, **fields: Any) -> str:
    """Fill a checked template (values are inserted as they are; braces in them stay)."""
    return text.format(**fields)
