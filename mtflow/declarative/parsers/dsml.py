"""DeepSeek-V3.2: DSML blocks, each parameter saying whether its value is a string.

::

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Hangzhou</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

``string="true"``: the value is the text as written; ``string="false"``: it is JSON (a number,
a boolean, an object, a list), and one that does not decode is a malformed call. (The bars are
U+FF5C; ASCII ``|`` is accepted too.)
"""
from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mtflow.declarative.parsers.base import ToolCall, ToolCallParser, strip_thinking
from mtflow.declarative.parsers.invokes import InvokeFormat, invoke_calls

DSML = '｜DSML｜'
_BAR = '[｜|]DSML[｜|]'
OPEN, CLOSE = f'<{DSML}function_calls>', f'</{DSML}function_calls>'


def _value(body: str, attrs: Dict[str, str]) -> Tuple[Any, Optional[str]]:
    if attrs.get('string', 'true').lower() != 'false':
        return body, None
    try:
        return json.loads(body), None
    except ValueError as exc:
        return None, f'string="false" but the value is not JSON ({exc.msg})'
    except RecursionError:
        return None, 'string="false" but the value is nested too deeply'


FORMAT = InvokeFormat(re.compile(f'<{_BAR}function_calls>'), re.compile(f'</{_BAR}function_calls>'),
                      re.compile(f'<{_BAR}invoke\\s+([^>]*)>'), re.compile(f'</{_BAR}invoke>'),
                      re.compile(f'<{_BAR}parameter\\s+([^>]*)>'), re.compile(f'</{_BAR}parameter>'), _value)


class DeepSeekV32Parser(ToolCallParser):
    """DeepSeek-V3.2 DSML calls: ``<｜DSML｜invoke name="NAME">`` with ``<｜DSML｜parameter
    name="K" string="true|false">`` values, several per block, between text."""
    name = 'deepseek_v32'
    expected = (f'{OPEN}\n<{DSML}invoke name="<tool>">\n<{DSML}parameter name="<name>" string="true">text'
                f'</{DSML}parameter>\n<{DSML}parameter name="<name>" string="false">JSON</{DSML}parameter>\n'
                f'</{DSML}invoke>\n{CLOSE}')

    def parse(self, text: str) -> List[ToolCall]:
        return invoke_calls(strip_thinking(text or ''), FORMAT)

    def render_tools(self, tools: Sequence[Dict[str, Any]]) -> str:
        specs = '\n'.join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ('## Tools\n\nYou can call these functions, given within <functions></functions>:\n<functions>\n' + specs
                + '\n</functions>\n\nTo call them, write (string="true" for a text value, string="false" for JSON):\n'
                + self.expected)

    def render_calls(self, calls: Sequence[Tuple[str, Any]]) -> str:
        def param(k: str, v: Any) -> str:
            text, is_str = (v, 'true') if isinstance(v, str) else (json.dumps(v, ensure_ascii=False), 'false')
            return f'<{DSML}parameter name="{k}" string="{is_str}">{text}</{DSML}parameter>\n'

        invokes = ''.join(f'<{DSML}invoke name="{name}">\n' + ''.join(param(k, v) for k, v in (args or {}).items()) +
                          f'</{DSML}invoke>\n' for name, args in calls)
        return f'{OPEN}\n{invokes}{CLOSE}' if calls else ''
