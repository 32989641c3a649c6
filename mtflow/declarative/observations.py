"""The ``observation`` section: how one turn's tool results reach the model, as messages (one per
call, or joined) or as text appended to the assistant message (``inline``, loss mask 0)."""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional

from mtflow.core.images import place_images
from mtflow.declarative.schema import ObservationConfig
from mtflow.declarative.templates import render
from mtflow.tools.bounds import Cut, cut_text
from mtflow.tools.runner import ToolResult
from mtflow.tools.tool import Tool

__all__ = ['Rendered', 'render_result', 'add_observations']


class Rendered(NamedTuple):
    """One result as the model reads it, and the cut that bounded it (``None``: shown whole)."""
    text: str
    cut: Optional[Cut]


def render_result(obs: ObservationConfig, tools: Dict[str, Tool], tokenizer: Any, result: ToolResult,
                  index: int) -> Rendered:
    """One result's text: ``error_template`` for a failed call, else ``template`` with the output
    cut to the tool's ``max_observation`` (tokens with a tokenizer, else characters; a marker says
    how much was dropped, :mod:`mtflow.tools.bounds`)."""
    if not result.ok:
        return Rendered(render(obs.error_template, name=result.name, error=result.error, index=index), None)
    tool = tools.get(result.name)
    text, cut = result.output, None
    if tool is not None:
        text, cut = cut_text(text, tool.max_observation, tool.truncate_side, tokenizer, result.output_chars)
    text = place_images(text, len(result.images))  # after the cut: every image keeps its placeholder
    return Rendered(render(obs.template, name=result.name, result=text, index=index), cut)


def add_observations(obs: ObservationConfig, messages: List[Dict[str, Any]], results: List[ToolResult],
                     texts: List[str], call_ids: Optional[List[str]] = None) -> str:
    """Add the rendered results to ``messages``; the text appended inline (``''`` in message mode),
    which the scheduler encodes with loss mask 0. ``call_ids``: the ids of calls the server
    returned structured; each ``tool`` message then answers its call (``tool_call_id``), as the
    server's chat template and OpenAI's API expect."""
    if obs.mode == 'inline':
        inline_text = obs.prefix + obs.separator.join(texts) + obs.suffix
        messages[-1]['content'] += inline_text
        return inline_text
    if obs.role == 'tool' and obs.one_message_per_call:
        for k, (r, text) in enumerate(zip(results, texts)):
            message = {'role': 'tool', 'content': obs.prefix + text + obs.suffix}
            if r.name:
                message['name'] = r.name
            if call_ids is not None and k < len(call_ids):
                message['tool_call_id'] = call_ids[k]
            messages.append(message)
    else:
        messages.append({'role': obs.role, 'content': obs.prefix + obs.separator.join(texts) + obs.suffix})
    return ''
