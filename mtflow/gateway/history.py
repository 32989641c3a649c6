"""Does a session's next call extend what the model saw? If not, how it differs.

A call extends the session when its canonical messages start with the session's conversation
as the model saw it (the last output applied) and its tools are the same: the next prompt then
continues the exact ids (token-in/token-out). Anything else starts a new exact segment, and the
trace records why, with the first differing position (:func:`transition`):

=====================  ============================================================================
kind                   the new messages ...
=====================  ============================================================================
``retry``              are a prefix of the conversation: an earlier prompt sent again
``new_conversation``   differ at the system prompt or the task (a sub-agent, or a new episode)
``thinking_stripped``  hold an earlier assistant message with its ``<think>`` blocks removed
``assistant_edited``   hold an earlier assistant message changed otherwise
``tool_result_edited`` hold an earlier tool result changed
``compaction``         are shorter than the conversation and differ inside it (a summary)
``history_edited``     differ inside the conversation otherwise
``tools_changed``      come with other tools (``at``: the first message that differs, if any)
``images_edited``      hold an earlier image changed (``at``: the image's index)
=====================  ============================================================================
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from mtflow.declarative.parsers import strip_thinking

__all__ = ['transition', 'KINDS']

KINDS = ('retry', 'new_conversation', 'thinking_stripped', 'assistant_edited', 'tool_result_edited', 'compaction',
         'history_edited', 'tools_changed', 'images_edited')


def _head(messages: List[Dict[str, Any]]) -> int:
    """The index of the task: the first user message (the system messages come before it)."""
    for k, m in enumerate(messages):
        if m.get('role') == 'user':
            return k
    return 0


def _first_char(a: Any, b: Any) -> Optional[int]:
    if not isinstance(a, str) or not isinstance(b, str):
        return None
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return min(len(a), len(b))


def transition(old: List[Dict[str, Any]], old_tools: Any, new: List[Dict[str, Any]],
               new_tools: Any, old_images: Sequence[Any] = (), new_images: Sequence[Any] = ()) -> Optional[Dict[str, Any]]:
    """``None`` when ``new`` (with ``new_tools`` and ``new_images``, the images of the
    placeholders in order) extends ``old``; else ``{'kind', 'at' (message index), 'char' (first
    differing character of that message, when both are text), 'messages_before', 'messages_after'}``."""
    n = len(old)
    extends = len(new) >= n and new[:n] == old
    images_kept = list(new_images[:len(old_images)]) == list(old_images)
    if extends and (old_tools or None) == (new_tools or None) and images_kept:
        return None
    info: Dict[str, Any] = {'messages_before': n, 'messages_after': len(new)}
    if extends and not images_kept:
        at = next(k for k, (a, b) in enumerate(zip(old_images, new_images)) if a != b) \
            if len(new_images) >= len(old_images) else len(new_images)
        return {'kind': 'images_edited', 'at': at, **info}
    if extends:
        return {'kind': 'tools_changed', 'at': None, **info}
    at = next((k for k, (a, b) in enumerate(zip(old, new)) if a != b), min(n, len(new)))
    if at >= len(new):  # every new message is the old one at its place
        return {'kind': 'retry', 'at': at, **info}
    was, now = (old[at] if at < n else None), new[at]
    char = _first_char(was.get('content'), now.get('content')) if was is not None else None
    if (old_tools or None) != (new_tools or None):  # (their text may be in the system prompt: tools_in_system)
        kind = 'tools_changed'
    elif at <= _head(old):
        kind = 'new_conversation'
    elif was is not None and was.get('role') == now.get('role') == 'assistant':
        stripped = isinstance(was.get('content'), str) and strip_thinking(was['content']).strip() == \
            str(now.get('content') or '').strip()
        kind = 'thinking_stripped' if stripped else 'assistant_edited'
    elif was is not None and was.get('role') == now.get('role') == 'tool':
        kind = 'tool_result_edited'
    elif len(new) < n:
        kind = 'compaction'
    else:
        kind = 'history_edited'
    return {'kind': kind, 'at': at, 'char': char, **info}
