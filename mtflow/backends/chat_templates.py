"""Chat templates: where the one a backend renders with comes from, and whether it shows the model
the whole conversation, checked when a run loads, before the first turn.

**Where it comes from** (:func:`resolve_chat_template`): a backend's ``chat_template`` option is
a bundled name (``chatml``, ``qwen3_think``, ``llama3``: ``mtflow/data/templates``), a Jinja file,
or Jinja text; left out, the tokenizer's own. A value that is none of these (a path to a file
that is not there, a file that holds no Jinja) is an error naming it: given as text, a path is a
"template" that renders every prompt as the path's few characters, silently.

**What it shows** (:func:`template_problems`): the template renders a probe conversation that
holds every part a tool-use run sends, each part a marker string of its own: a system message,
a user message, an assistant message with a tool call (its text, and the call in OpenAI's
``tool_calls`` shape, ``arguments`` a dict as transformers' templates expect, ids of nine
alphanumeric characters as Mistral's require), the tool's result (``role: tool``, with
``tool_call_id`` and ``name``), and a last assistant answer. A template that raises on it (with
``arguments`` a dict, and again as a JSON string), that leaves out a part (the system message, the
user's words, the call, the tool's result, the answer), or that writes no generation prompt after
a user message or a tool result while it writes text before an assistant message there, is
refused in one line naming the template, the role and what is missing. A template that opens no
assistant turn there at all (Mistral's after ``[/INST]``, DeepSeek-V3.1's after a tool output: the
model's text follows at once) passes. With ``text_calls`` (a YAML scheduler that writes ``tool``
messages after calls it read from the text) the template must also take that conversation, with
the calls in the assistant's text or as ``tool_calls`` (:func:`call_form`: the run carries them the
way the template takes them).

``mtflow run`` checks the backend's template once it is built (the tokenizer comes with the
model) and before the first turn; ``mtflow validate`` and ``mtflow check-tokens --template`` run
the same function (``docs/declarative.md``, "Templates").
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from mtflow.backends.base import BackendError

__all__ = ['TemplateSource', 'BUNDLED', 'TEMPLATE_DIR', 'bundled_template', 'looks_like_jinja',
           'resolve_chat_template', 'template_problems', 'foreign_markers', 'call_form', 'PROBE_MESSAGES', 'PROBE_TOOLS']

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / 'data' / 'templates'
#: bundled templates: name -> file in mtflow/data/templates
BUNDLED = {'chatml': 'chatml.jinja', 'qwen3_think': 'qwen3_think.jinja', 'llama3': 'llama3.jinja'}


@dataclass(frozen=True)
class TemplateSource:
    """A chat template and where it came from. ``text`` is ``None`` for the tokenizer's own;
    ``name`` names it in messages (the file, the bundled name); ``origin`` says which kind of
    value it was (what ``mtflow run`` reports it used)."""
    text: Optional[str]
    name: str
    origin: str

    def describe(self) -> str:
        return self.origin if self.name == self.origin else f'{self.name} ({self.origin})'


#: the tokenizer's own template (no ``chat_template`` given)
TOKENIZER_OWN = TemplateSource(None, "the tokenizer's own template", "the tokenizer's own template")


def bundled_template(name: str) -> str:
    if name not in BUNDLED:
        raise KeyError(f'no bundled template {name!r}; bundled: {", ".join(BUNDLED)}')
    return (TEMPLATE_DIR / BUNDLED[name]).read_text(encoding='utf-8')


def looks_like_jinja(text: str) -> bool:
    """Whether ``text`` is Jinja (it has an expression or a statement), not a name or a path."""
    return '{{' in text or '{%' in text


def resolve_chat_template(value: Union[None, str, TemplateSource], base_dir: Optional[Union[str, Path]] = None,
                          where: str = 'chat_template') -> TemplateSource:
    """``value`` as a :class:`TemplateSource`: ``None`` (or ``'model'``) the tokenizer's own, a
    bundled name, Jinja text, or a file (relative to ``base_dir``, else the current directory).
    :class:`BackendError` naming ``where`` for a value that is none of these."""
    if isinstance(value, TemplateSource):
        return value
    if value is None or value in ('', 'model'):
        return TOKENIZER_OWN
    if not isinstance(value, str):
        raise BackendError(f'{where}: must be a file, a bundled template name or Jinja text, not '
                           f'{type(value).__name__}')
    if value in BUNDLED:
        return TemplateSource(bundled_template(value), value, f'bundled template {value}')
    if looks_like_jinja(value):
        return TemplateSource(value, 'the inline template', f'Jinja text given inline ({len(value)} characters)')
    path = Path(value).expanduser()
    if not path.is_absolute() and base_dir is not None and (Path(base_dir) / path).exists():
        path = Path(base_dir) / path
    if path.is_dir():
        raise BackendError(f'{where}: {value} is a directory, not a template file')
    if not path.is_file():
        raise BackendError(f'{where}: {value!r} is not a file (no such file: {path.resolve()}), a bundled template '
                           f'({", ".join(BUNDLED)}) or Jinja text (it has no {{{{ or {{%)')
    try:
        text = path.read_text(encoding='utf-8')
    except (OSError, UnicodeDecodeError) as exc:
        raise BackendError(f'{where}: cannot read {path}: {exc}') from None
    if not looks_like_jinja(text):
        raise BackendError(f'{where}: {path} holds no Jinja (no {{{{ or {{% in its {len(text)} characters): '
                           'it is not a chat template')
    return TemplateSource(text, str(path), 'a template file')


# ---- the probe ----------------------------------------------------------------------------------
_MARK = 'q7x'  # in every marker, so that a template's own text never holds one by chance
SYSTEM, USER = f'probe-system-{_MARK}', f'probe-user-{_MARK}'
CALL_TEXT, CALL_ARG = f'probe-call-{_MARK}', f'probe-argument-{_MARK}'
RESULT, ANSWER = f'probe-tool-result-{_MARK}', f'probe-answer-{_MARK}'
CALL_ID = 'prob3q7x1'  # nine alphanumeric characters (Mistral's templates refuse other ids)
PROBE_TOOLS: List[Dict[str, Any]] = [{'type': 'function', 'function': {
    'name': 'probe_lookup', 'description': 'Look a word up.',
    'parameters': {'type': 'object', 'properties': {'query': {'type': 'string'}}, 'required': ['query']}}}]
#: the probe conversation: every part a tool-use run sends, each with its marker
PROBE_MESSAGES: List[Dict[str, Any]] = [
    {'role': 'system', 'content': f'{SYSTEM} You can call tools.'},
    {'role': 'user', 'content': f'{USER} Look it up.'},
    {'role': 'assistant', 'content': f'{CALL_TEXT} Looking it up.', 'tool_calls': [
        {'id': CALL_ID, 'type': 'function', 'function': {'name': 'probe_lookup', 'arguments': {'query': CALL_ARG}}}]},
    {'role': 'tool', 'tool_call_id': CALL_ID, 'name': 'probe_lookup', 'content': RESULT},
    {'role': 'assistant', 'content': f'{ANSWER} It is found.'},
]
#: the same conversation as a YAML scheduler writes it from a call parsed in the text, in the
#: ``text`` form (``mtflow.declarative.call_messages``): the call is the assistant's text, the tool
#: message answers its id
TEXT_CALL_MESSAGES: List[Dict[str, Any]] = [
    PROBE_MESSAGES[0], PROBE_MESSAGES[1],
    {'role': 'assistant', 'content': f'{CALL_TEXT} <tool_call>{{"name": "probe_lookup", "arguments": '
                                     f'{{"query": "{CALL_ARG}"}}}}</tool_call>'},
    {'role': 'tool', 'tool_call_id': CALL_ID, 'name': 'probe_lookup', 'content': RESULT},
    PROBE_MESSAGES[4],
]
#: ``call_form``'s answers: the calls read from the text stay in it, or go in OpenAI's ``tool_calls``
TEXT, OPENAI = 'text', 'openai'
#: each part of the probe: (what it is, the role named in a refusal, markers of which one must show)
_PARTS = [
    ('the system message', 'system', (SYSTEM, )),
    ("the user's message", 'user', (USER, )),
    ('the tool call (neither its text nor its tool_calls)', 'assistant', (CALL_TEXT, CALL_ARG)),
    ("the tool's result", 'tool', (RESULT, )),
    ("the assistant's answer", 'assistant', (ANSWER, )),
]


def _render(tokenizer: Any, text: Optional[str], messages: List[Dict[str, Any]], generation_prompt: bool) -> str:
    kwargs: Dict[str, Any] = {'chat_template': text} if text is not None else {}
    return tokenizer.apply_chat_template(messages, tools=PROBE_TOOLS, tokenize=False,
                                         add_generation_prompt=generation_prompt, **kwargs)


def _with_string_arguments(messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The probe with each call's ``arguments`` a JSON string (DeepSeek-V3's template
    concatenates them; transformers' convention, a dict, is tried first)."""
    out = []
    for m in messages:
        if m.get('tool_calls'):
            m = dict(m, tool_calls=[dict(c, function=dict(c['function'], arguments=json.dumps(
                c['function']['arguments']))) for c in m['tool_calls']])
        out.append(m)
    return out


def _error(exc: Exception) -> str:
    return f'{type(exc).__name__}: {" ".join(str(exc).split())[:200]}'


def call_form(tokenizer: Any, source: Union[None, str, TemplateSource] = None) -> Optional[str]:
    """How a scheduler's calls read from the text must reach this template (``mtflow.declarative.
    call_messages``): ``'text'`` when it shows the tool-use conversation with the calls in the
    assistant's text (nothing changes for it), ``'openai'`` when only with the calls as ``tool_calls``
    (gpt-oss's, MiniMax-M2's, Mistral Small 3.2's: they refuse a tool message after an assistant
    message without them), ``None`` when neither (:func:`template_problems` says why)."""
    source = resolve_chat_template(source)
    tries = ((TEXT, TEXT_CALL_MESSAGES), (OPENAI, PROBE_MESSAGES), (OPENAI, _with_string_arguments(PROBE_MESSAGES)))
    for form, messages in tries:
        try:
            if not _dropped('', _render(tokenizer, source.text, messages, False), ''):
                return form
        except Exception:
            continue
    return None


def template_problems(tokenizer: Any, source: Union[None, str, TemplateSource] = None,
                      text_calls: bool = False) -> List[str]:
    """What is wrong with the chat template ``source`` (default the tokenizer's own) under
    ``tokenizer``: one line per problem, each naming the template and the role (see the module
    docstring); ``[]`` for a template that shows the model every part of the probe.
    ``text_calls``: the run's scheduler writes tool messages for calls it parsed from the text:
    the template must take them in one of the two forms of :func:`call_form` (the run then uses
    that one)."""
    source = resolve_chat_template(source)
    name = f'chat template {source.name}'
    if source.text is None and not getattr(tokenizer, 'chat_template', None):
        return [f'{name}: the tokenizer has no chat template; give backend_options.chat_template (a file, a '
                'bundled name or Jinja text)']
    messages = PROBE_MESSAGES
    try:
        whole = _render(tokenizer, source.text, messages, False)
    except Exception as exc:
        try:
            messages = _with_string_arguments(PROBE_MESSAGES)
            whole = _render(tokenizer, source.text, messages, False)
        except Exception:
            return [f'{name}: fails on a tool-use conversation (system, user, assistant with a tool call, tool '
                    f'result, assistant): {_error(exc)}']
    problems = _dropped(name, whole, '')
    if text_calls and not problems and call_form(tokenizer, source) is None:  # neither form: say the text form's
        try:
            problems += _dropped(name, _render(tokenizer, source.text, TEXT_CALL_MESSAGES, False),
                                 ' as this scheduler writes it (the call as text; as tool_calls it fails too)')
        except Exception as exc:
            problems.append(f'{name}: fails on tool results as this scheduler writes them (the call as the '
                            f"assistant's text; as tool_calls too; role tool): {_error(exc)}")
    try:
        problems += _generation_prompt_problems(tokenizer, source.text, name, messages)
    except Exception as exc:
        problems.append(f'{name}: fails on a shorter conversation (system, user): {_error(exc)}')
    return problems


#: what a template's special tokens look like: ``<|im_start|>``, ``<|eot_id|>``, DeepSeek's ``<｜User｜>``
_SPECIAL_LOOKING = re.compile(r'<\|[^|<>\s]{1,40}\|>|<\uff5c[^\uff5c<>\s]{1,40}\uff5c>')


def foreign_markers(tokenizer: Any, source: Union[None, str, TemplateSource] = None) -> List[str]:
    """The markers that look like special tokens (``<|...|>``, ``<｜...｜>``) which the template
    ``source`` writes and which are not one token of ``tokenizer``: a template of another model
    family (Llama 3's ``<|start_header_id|>`` under a ChatML tokenizer) shows every part of the
    conversation, yet in a format the model never learnt, spelt in pieces of ordinary text."""
    encode = getattr(tokenizer, 'encode', None)
    if not callable(encode):  # a server's renderer: its template is its model's own
        return []
    source = resolve_chat_template(source)
    try:
        text = _render(tokenizer, source.text, PROBE_MESSAGES, True)
    except Exception:
        try:
            text = _render(tokenizer, source.text, _with_string_arguments(PROBE_MESSAGES), True)
        except Exception:
            return []  # template_problems says why
    found = []
    for marker in dict.fromkeys(_SPECIAL_LOOKING.findall(text)):
        try:
            ids = encode(marker, add_special_tokens=False)
        except TypeError:
            ids = encode(marker)
        if len(ids) != 1:
            found.append(marker)
    return found


def _dropped(name: str, rendered: str, how: str) -> List[str]:
    return [f'{name}: drops {what} (role {role}){how}: the probe conversation rendered through it lacks that '
            f'message\'s text ({markers[0]!r})' for what, role, markers in _PARTS if not any(m in rendered for m in markers)]


def _generation_prompt_problems(tokenizer: Any, text: Optional[str], name: str,
                                messages: List[Dict[str, Any]]) -> List[str]:
    """After a user message and after a tool result, ``add_generation_prompt`` must write the
    opening of the model's turn, or the template must open none there at all: an assistant
    message follows the message before it at once (Mistral's ``[/INST]``, DeepSeek's tool output)."""
    out = []
    for after_what, head in (('a user message', messages[:2]), ('a tool result', messages[:4])):
        without = _render(tokenizer, text, head, False)
        if _render(tokenizer, text, head, True) != without:
            continue
        answered = _render(tokenizer, text, head + [messages[-1]], False)
        at = answered.find(ANSWER)
        if answered.startswith(without) and at >= len(without) and not answered[len(without):at].strip():
            continue
        opening = answered[len(without):at].strip() if answered.startswith(without) and at >= len(without) else ''
        shown = f'it writes {opening[:60]!r} before an assistant message there' if opening else \
            'an assistant message there changes how the messages before it render'
        out.append(f"{name}: writes no generation prompt after {after_what} (add_generation_prompt adds nothing), yet "
                   f"{shown}: the prompt would end before the model's turn (role assistant) opens")
    return out
