"""How much of a tool's text a run keeps: every observation is bounded, and the cut is visible.

A tool may return anything: a ``cat`` of a log, a web page, 100 MB. Kept whole, it goes into the
next prompt, the trajectory line and the trace (a 100 MB result was 203 MiB on disk for one
request), and tokenizing it took a real tokenizer to 19 GB. So each tool has a bound,
``max_observation`` (:data:`DEFAULT_MAX_OBSERVATION` unless its YAML says otherwise): tokens when
the scheduler has a tokenizer, else characters. The cut happens twice, each time once:

* :func:`keep_window` as the call returns (:class:`mtflow.tools.ToolRunner`): the text beyond
  ``WINDOW_CHARS_PER_UNIT * max_observation`` characters (at least ``MIN_WINDOW_CHARS``) is dropped
  at once, so nothing larger is ever held, tokenized, or written (the trace's ``tool_io`` keeps the
  window: a replay renders the same observation from it); the result remembers how long the text was;
* :func:`cut_text` when the observation is rendered: the window cut to ``max_observation``
  tokens (or characters), with a marker the model reads, ``[... N tokens truncated]`` (characters
  when the window cut first: the tokens of text never tokenized are not known).

Each cut is reported (:class:`Cut`: in the step's trace ``calls``, and counted in the summary).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

__all__ = ['DEFAULT_MAX_OBSERVATION', 'WINDOW_CHARS_PER_UNIT', 'MIN_WINDOW_CHARS', 'Cut', 'window_chars',
           'keep_window', 'cut_text']

#: a tool's ``max_observation`` when its YAML gives none (tokens with a tokenizer, else characters)
DEFAULT_MAX_OBSERVATION = 8192
#: characters of a result kept per unit of ``max_observation`` as the call returns (a token is
#: rarely longer than 8 characters; a text of longer tokens is cut below ``max_observation`` tokens)
WINDOW_CHARS_PER_UNIT = 8
#: the window is never smaller than this: a result of up to 64 KiB characters is cut in tokens only
MIN_WINDOW_CHARS = 65536


@dataclass(frozen=True)
class Cut:
    """One observation cut to its bound: what was kept and dropped, in ``unit``."""
    kept: int
    dropped: int
    unit: str  # 'tokens' or 'characters'

    def to_info(self) -> Dict[str, Any]:
        return {'kept': self.kept, 'dropped': self.dropped, 'unit': self.unit}


def window_chars(limit: int) -> int:
    """The characters of a result kept as the call returns, for a bound of ``limit``."""
    return max(limit * WINDOW_CHARS_PER_UNIT, MIN_WINDOW_CHARS)


def keep_window(text: str, limit: int, side: str = 'right') -> str:
    """``text`` cut to the characters a bound of ``limit`` can ever show (``side='right'`` keeps
    the beginning, ``'left'`` the end); unchanged when it fits."""
    window = window_chars(limit)
    if len(text) <= window:
        return text
    return text[:window] if side == 'right' else text[-window:]


def _marked(body: str, dropped: int, unit: str, side: str) -> str:
    marker = f'[... {dropped} {unit} truncated]'
    return f'{body}\n{marker}' if side == 'right' else f'{marker}\n{body}'


def cut_text(text: str, limit: Optional[int], side: str = 'right', tokenizer: Any = None,
             total_chars: Optional[int] = None) -> Tuple[str, Optional[Cut]]:
    """``text`` cut to ``limit`` tokens (with a tokenizer) or characters, a marker saying how much
    was dropped, and the :class:`Cut` (``None`` when it fits). ``total_chars``: how long the text
    was before :func:`keep_window` cut it (the marker then counts what the window dropped too)."""
    total = max(total_chars or 0, len(text))
    windowed = total > len(text)
    if not limit:
        return text, None
    if tokenizer is not None and not windowed:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= limit:
            return text, None
        kept = ids[:limit] if side == 'right' else ids[-limit:]
        return _marked(tokenizer.decode(kept), len(ids) - limit, 'tokens', side), Cut(limit, len(ids) - limit,
                                                                                       'tokens')
    if tokenizer is not None:  # the window cut first: its tokens are counted, the rest in characters
        ids = tokenizer.encode(text, add_special_tokens=False)
        kept_ids = ids[:limit] if side == 'right' else ids[-limit:]
        body = tokenizer.decode(kept_ids)
        return _marked(body, total - len(body), 'characters', side), Cut(len(body), total - len(body), 'characters')
    if total <= limit:
        return text, None
    body = text[:limit] if side == 'right' else text[-limit:]
    return _marked(body, total - limit, 'characters', side), Cut(limit, total - limit, 'characters')
