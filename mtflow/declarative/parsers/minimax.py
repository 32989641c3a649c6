"""MiniMax-M2 (and M2.1): ``<minimax:tool_call>`` blocks of ``invoke`` elements, text values.

::

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

Values are kept as written (a newline around a code value included, as vLLM reads them) and typed
by the tool's schema (:mod:`.schema_types`; a number or a boolean may have whitespace around it).
"""
from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mtflow.declarative.parsers.base import ToolCall, ToolCallParser, strip_thinking
from mtflow.declarative.parsers.invokes import InvokeFormat, invoke_calls

OPEN, CLOSE = '<minimax:tool_call>', '</minimax:tool_call>'


def _text(body: str, attrs: Dict[str, str]) -> Tuple[Any, Optional[str]]:
    return body, None


FORMAT = InvokeFormat(re.compile(re.escape(OPEN)), re.compile(re.escape(CLOSE)), re.compile(r'<invoke\s+([^>]*)>'),
                      re.compile(r'</invoke>'), re.compile(r'<parameter\s+([^>]*)>'), re.compile(r'</parameter>'),
                      _text, text_values='text')


class MiniMaxM2Parser(ToolCallParser):
    """``<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter></invoke>
    </minimax:tool_call>``: several invokes per block, several blocks per reply, between text."""
    name = 'minimax_m2'
    expected = f'{OPEN}\n<invoke name="<tool>">\n<parameter name="<name>">value</parameter>\n</invoke>\n{CLOSE}'

    def parse(self, text: str) -> List[ToolCall]:
        return invoke_calls(strip_thinking(text or ''), FORMAT)

    def render_tools(self, tools: Sequence[Dict[str, Any]]) -> str:
        specs = '\n'.join(f'<tool>{json.dumps(t, ensure_ascii=False)}</tool>' for t in tools)
        return ('# Tools\nYou may call one or more tools. They are, within <tools></tools>:\n<tools>\n' + specs +
                '\n</tools>\n\nTo call tools, write:\n' + self.expected + '\n(values that are not strings as JSON)')

    def render_calls(self, calls: Sequence[Tuple[str, Any]]) -> str:
        invokes = ''.join(
            f'<invoke name="{name}">\n' + ''.join(
                f'<parameter name="{k}">{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</parameter>\n'
                for k, v in (args or {}).items()) + '</invoke>\n' for name, args in calls)
        return f'{OPEN}\n{invokes}{CLOSE}' if calls else ''
