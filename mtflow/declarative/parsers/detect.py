"""Which tool-call format a reply looks like, so that a call written in a format the scheduler
does not read gets an error observation naming both formats instead of silence."""
from __future__ import annotations

import re
from typing import Iterable, List, Optional

from mtflow.declarative.parsers.base import json_values, looks_like_call_object, strip_thinking

#: parser name -> formats it reads (a format detected but read by the configured parser is no mistake)
READS = {
    'hermes': {'hermes'},
    'llama3_json': {'llama3_json', 'json'},
    'pythonic': {'pythonic'},
    'mistral': {'mistral', 'json'},
    'deepseek': {'deepseek'},
    'react': {'react'},
    'json': {'json'},
    'qwen3_coder': {'qwen3_coder', 'hermes'},
    'glm45': {'glm45', 'hermes'},
    'kimi_k2': {'kimi_k2'},
    'deepseek_v32': {'deepseek_v32'},
    'minimax_m2': {'minimax_m2'},
    'harmony': {'harmony'},
}

_MARKERS = [
    ('qwen3_coder', re.compile(r'<function=[^>\n]+>')),
    ('glm45', re.compile(r'<arg_key>')),
    ('hermes', re.compile(r'<tool_call>')),
    ('kimi_k2', re.compile(re.escape('<|tool_call_begin|>'))),
    ('deepseek_v32', re.compile(r'<[｜|]DSML[｜|]')),
    ('minimax_m2', re.compile(r'<minimax:tool_call>')),
    ('harmony', re.compile(r'to=functions\.')),
    ('llama3_json', re.compile(re.escape('<|python_tag|>'))),
    ('mistral', re.compile(re.escape('[TOOL_CALLS]'))),
    ('deepseek', re.compile(r'<[｜|]tool[▁_ ]calls?[▁_ ]begin[｜|]>')),
    ('react', re.compile(r'(?im)^[ \t]*(?:[#>*_]+[ \t]*)?action(?:[ \t]*\d+)?[ \t]*(?:\*\*|__|\*)?[ \t]*:')),
]
_PYTHONIC = re.compile(r'^\s*\[\s*([A-Za-z_][\w.]*)\(.*\)\s*\]\s*$', re.DOTALL)
_JSON_START = re.compile(r'[\[{]\s*"(?:name|function|type)"')


def detect_formats(text: str, tool_names: Iterable[str] = ()) -> List[str]:
    """The formats ``text`` (reasoning removed) looks like a tool call in, strongest first.

    Special markers always count (and then only they); a pythonic list or a bare JSON call object counts only when it
    names one of ``tool_names`` (an answer that happens to be JSON is not a call)."""
    text = strip_thinking(text or '')
    names = set(tool_names)
    found = [fmt for fmt, rx in _MARKERS if rx.search(text)]
    if found:  # JSON inside a marked format is that format's, not plain JSON
        return found
    m = _PYTHONIC.match(text)
    if m and m.group(1) in names:
        found.append('pythonic')
    j = _JSON_START.search(text)
    if j is not None:
        values, _, _ = json_values(text, j.start())
        for value in values:
            items = value if isinstance(value, list) else [value]
            if looks_like_call_object(value) and any(
                    (i.get('function', i) or {}).get('name') in names for i in items if isinstance(i, dict)):
                found.append('json')
                break
    return found


def foreign_format(text: str, parser_name: str, tool_names: Iterable[str] = ()) -> Optional[str]:
    """The first format ``text`` looks like that the parser ``parser_name`` does not read, or None."""
    reads = READS.get(parser_name, {parser_name})
    for fmt in detect_formats(text, tool_names):
        if fmt not in reads:
            return fmt
    return None
