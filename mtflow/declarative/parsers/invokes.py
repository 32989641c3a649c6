"""The ``invoke``/``parameter`` shape that MiniMax-M2 and DeepSeek-V3.2 (DSML) share: a block of
calls, each ``<invoke name="NAME">`` holding ``<parameter name="KEY" ...>VALUE</parameter>``
elements, and how each family reads one value (:class:`InvokeFormat`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Pattern, Tuple

from mtflow.declarative.parsers.base import ToolCall
from mtflow.declarative.parsers.tags import attributes, spans, unquote

#: (value text, the parameter tag's attributes) -> (value, error)
ValueReader = Callable[[str, Dict[str, str]], Tuple[Any, Optional[str]]]


@dataclass
class InvokeFormat:
    """The tags of one family (regexes whose group 1 is the tag's attribute text) and its value reader."""
    block_open: Pattern[str]
    block_close: Pattern[str]
    invoke_open: Pattern[str]
    invoke_close: Pattern[str]
    param_open: Pattern[str]
    param_close: Pattern[str]
    read_value: ValueReader
    #: what a value without a schema becomes (``ToolCall.text_values``); None: the reader typed it
    text_values: Optional[str] = None


def invoke_calls(text: str, fmt: InvokeFormat) -> List[ToolCall]:
    """Every ``invoke`` of every block of ``text``; a block or invoke cut off is ``complete=False``."""
    calls: List[ToolCall] = []
    for block in spans(text, fmt.block_open, fmt.block_close):
        found = list(spans(text, fmt.invoke_open, fmt.invoke_close, block.body_start, block.body_end))
        if not found:
            calls.append(ToolCall('', None, block.raw, 'no <invoke name="..."> in the tool call block', block.closed))
        for inv in found:
            calls.append(_invoke(text, inv, fmt, block.closed))
    return calls


def _invoke(text: str, inv: Any, fmt: InvokeFormat, block_closed: bool) -> ToolCall:
    closed = inv.closed and block_closed
    raw = inv.raw
    name = unquote(attributes(inv.opening.group(1)).get('name', inv.opening.group(1)))
    if not name:
        return ToolCall('', None, raw, 'the invoke names no function (name="...")', closed)
    args: Dict[str, Any] = {}
    for p in spans(text, fmt.param_open, fmt.param_close, inv.body_start, inv.body_end):
        attrs = attributes(p.opening.group(1))
        key = unquote(attrs.get('name', p.opening.group(1)))
        if not p.closed:
            return ToolCall(name, None, raw, f'the value of parameter {key!r} is not closed', False)
        value, error = fmt.read_value(p.body, attrs)
        if error is not None:
            return ToolCall(name, None, raw, f'parameter {key!r}: {error}', closed)
        args[key] = value
    return ToolCall(name, args, raw, None, closed, text_values=fmt.text_values)
