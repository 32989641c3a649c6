"""Prompt datasets for ``mtflow run``: a small bundled one, and the JSONL reader.

``prompts.jsonl`` (package data) holds 16 guess-the-number games: an opening user message and
``data_dict.target`` (the hidden number), so the default run is the same on every machine (the
scheduler, ``schedulers/guess_number.yaml``, adds its own system prompt).

One line of a dataset is one request::

    {"uuid": "q1", "messages": [{"role": "user", "content": "..."}], "tools": [...], "data_dict": {...}}

Instead of ``messages`` a line may give ``prompt`` (or ``query``): one user message, with an
optional ``system``. ``uuid`` (or ``id``) is optional (``<file stem>-<line>`` otherwise) but must
be unique. Any other key goes into ``data_dict``, where schedulers read per-prompt data (answers,
targets). A NeMo Gym row (``responses_create_params`` with ``input`` and ``tools``, and its task's
own fields) is read as it is (:func:`nemo_gym_row`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from mtflow.core.errors import UserError
from mtflow.core.protocol import RolloutInferRequest

__all__ = ['DatasetError', 'bundled_dataset', 'read_prompts', 'iter_prompts', 'iter_located_prompts', 'count_prompts',
           'nemo_gym_row', 'responses_tools']

_KNOWN = {'uuid', 'id', 'messages', 'prompt', 'query', 'system', 'tools', 'data_dict', 'images', 'chat_template_kwargs'}


class DatasetError(UserError):
    """A dataset line that is not a request; the message names the file and line."""


def bundled_dataset() -> Path:
    """The path of the bundled prompt dataset."""
    return Path(__file__).with_name('prompts.jsonl')


def responses_tools(tools: Any) -> List[Dict[str, Any]]:
    """Responses API tools (``{type, name, parameters, ...}``) as chat-completions tools."""
    out = []
    for tool in tools or []:
        if isinstance(tool, dict) and tool.get('type', 'function') == 'function' and 'function' not in tool:
            out.append({'type': 'function', 'function': {k: tool[k] for k in ('name', 'description', 'parameters')
                                                         if k in tool}})
        else:
            out.append(tool)
    return out


def nemo_gym_row(item: Dict[str, Any], where: str) -> Dict[str, Any]:
    """A NeMo Gym JSONL row as a line of this format: ``responses_create_params.input`` (its
    ``developer`` messages as ``system``) is the conversation, its ``tools`` (Responses API) the
    request's tools; the whole row stays in ``data_dict`` (a resources server reads it back)."""
    params = item['responses_create_params']
    inputs = params.get('input')
    if isinstance(inputs, str):
        inputs = [{'role': 'user', 'content': inputs}]
    if not isinstance(inputs, list) or not inputs:
        raise DatasetError(f"{where}: responses_create_params.input must be a non-empty list of messages")
    messages = []
    for k, m in enumerate(inputs):
        if not isinstance(m, dict) or not isinstance(m.get('role'), str):
            raise DatasetError(f'{where}: responses_create_params.input[{k}] is not a message with a role')
        content = m.get('content')
        if isinstance(content, list):  # [{type: input_text, text}]
            content = ''.join(str(p.get('text', '')) for p in content if isinstance(p, dict))
        messages.append({'role': 'system' if m['role'] == 'developer' else m['role'], 'content': content or ''})
    out = {k: v for k, v in item.items() if k in _KNOWN}
    out.update(messages=messages, data_dict={**{k: v for k, v in item.items() if k not in ('uuid', 'data_dict')},
                                             **(item.get('data_dict') or {})})
    if params.get('tools') and 'tools' not in item:
        out['tools'] = responses_tools(params['tools'])
    return out


def _request(item: Dict[str, Any], where: str, default_uuid: str) -> RolloutInferRequest:
    if 'messages' not in item and 'prompt' not in item and 'query' not in item and \
            isinstance(item.get('responses_create_params'), dict):
        item = nemo_gym_row(item, where)
    if 'messages' in item:
        messages = item['messages']
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get('role'), str) for m in messages):
            raise DatasetError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
        messages = [dict(m) for m in messages]
    else:
        prompt = item.get('prompt', item.get('query'))
        if not isinstance(prompt, str):
            raise DatasetError(f"{where}: a line needs 'messages' or a string 'prompt'")
        messages = ([{'role': 'system', 'content': str(item['system'])}] if item.get('system') else []) + [{
            'role': 'user',
            'content': prompt
        }]
    data = item.get('data_dict') or {}
    if not isinstance(data, dict):
        raise DatasetError(f"{where}: 'data_dict' must be an object")
    data = {**{k: v for k, v in item.items() if k not in _KNOWN}, **data}
    tools = item.get('tools')
    if tools is not None and not isinstance(tools, list):
        raise DatasetError(f"{where}: 'tools' must be a list")
    uuid = item.get('uuid', item.get('id'))
    return RolloutInferRequest(
        messages=messages,
        tools=tools,
        data_dict=data,
        images=item.get('images') or [],
        chat_template_kwargs=item.get('chat_template_kwargs') or {},
        uuid=str(uuid) if uuid is not None else default_uuid)


def iter_prompts(path: Optional[Union[str, Path]] = None, limit: Optional[int] = None, *,
                 check_unique: bool = True) -> Iterator[RolloutInferRequest]:
    """Yield the requests of a JSONL prompt dataset one at a time (the bundled one when ``path``
    is ``None``), so a run of a million prompts never holds them all. Errors name file and line;
    a repeated uuid is an error (only the uuids are kept to check that; ``check_unique=False``
    keeps none, for a second pass over a file already checked)."""
    return (req for _, req in iter_located_prompts(path, limit, check_unique=check_unique))


def iter_located_prompts(path: Optional[Union[str, Path]] = None, limit: Optional[int] = None, *,
                         check_unique: bool = True) -> Iterator[Tuple[str, RolloutInferRequest]]:
    """:func:`iter_prompts` with where each request comes from (``file:line``), for checks that
    name the line (``answer.field`` against the first lines, :mod:`mtflow.run.preflight`)."""
    path = bundled_dataset() if path is None else Path(path)
    if path.is_dir():
        raise DatasetError(f'dataset {path} is a directory; give a JSONL file (one JSON object with messages per line)')
    if not path.is_file():
        raise DatasetError(f'dataset not found: {path}')
    seen: Dict[str, int] = {}
    count = 0
    with open(path, 'rb') as f:
        for no, raw_bytes in enumerate(f, 1):
            try:
                raw = raw_bytes.decode('utf-8')
            except UnicodeDecodeError as exc:
                raise DatasetError(f'{path}:{no}: not UTF-8 text: byte 0x{raw_bytes[exc.start]:02x} at column '
                                   f'{exc.start + 1} cannot be decoded (save the file as UTF-8)') from None
            if limit is not None and count >= limit:
                break
            if not raw.strip():
                continue
            where = f'{path}:{no}'
            try:
                item = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise DatasetError(_not_json_lines(path, no, raw, count)
                                   or f'{where}: not valid JSON: {exc.msg} (column {exc.colno})') from exc
            if not isinstance(item, dict):
                raise DatasetError(_not_json_lines(path, no, raw, count) or f'{where}: each line must be a JSON object')
            req = _request(item, where, f'{path.stem}-{no}')
            if check_unique:
                if req.uuid in seen:
                    raise DatasetError(f'{where}: uuid {req.uuid!r} repeats line {seen[req.uuid]}')
                seen[req.uuid] = no
            count += 1
            yield where, req
    if not count:
        raise DatasetError(f'{path}: no prompts')


def _not_json_lines(path: Path, no: int, raw: str, count: int) -> Optional[str]:
    """The one line for a dataset that is one JSON document rather than JSON Lines, found at its
    first line (``count``: prompts read before it): a JSON array (``[{...}, {...}]``, on one line
    or pretty-printed), or an object spread over several lines; ``None`` for any other bad line."""
    if count:
        return None
    head = raw.strip()
    lines = path.with_suffix('.jsonl') if path.suffix != '.jsonl' else path.with_name(f'{path.stem}-lines.jsonl')
    convert = f"jq -c '.[]' {path} > {lines}"
    if head.startswith('['):
        return (f'{path}:{no}: the file is a JSON array, not JSON Lines: a dataset holds one JSON object per line '
                f'(convert it: {convert})')
    if head.startswith('{') and not head.endswith('}'):
        return (f'{path}:{no}: a JSON object spread over several lines: a dataset is JSON Lines, one whole JSON '
                f'object per line (convert it: jq -c . {path} > {lines})')
    return None


def count_prompts(path: Optional[Union[str, Path]] = None, limit: Optional[int] = None) -> int:
    """Check every line of a dataset (as :func:`iter_prompts`) and count the requests, keeping
    none of them: a bad line is reported before a run starts, not hours into it."""
    return sum(1 for _ in iter_prompts(path, limit))


def read_prompts(path: Optional[Union[str, Path]] = None, limit: Optional[int] = None) -> List[RolloutInferRequest]:
    """Read a JSONL prompt dataset (the bundled one when ``path`` is ``None``) into requests."""
    return list(iter_prompts(path, limit))
