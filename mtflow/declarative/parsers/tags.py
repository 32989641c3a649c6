"""Tagged spans, as the XML-like tool-call formats write them: ``<open> body </close>``, where a
span whose closing tag never comes runs to the next opening tag or the end of the text (a reply cut
by ``max_tokens``), and ``name="value"`` attributes."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterator, Pattern, Union

Tag = Union[str, Pattern[str]]


@dataclass
class Span:
    """One tagged span of ``text``: ``text[start:end]`` whole, ``text[body_start:body_end]`` inside
    the tags; ``closed`` is False when no closing tag ended it."""
    text: str
    start: int
    body_start: int
    body_end: int
    end: int
    closed: bool
    #: the opening tag's match (its groups: a name written in the tag)
    opening: 're.Match[str]'

    @property
    def body(self) -> str:
        return self.text[self.body_start:self.body_end]

    @property
    def raw(self) -> str:
        return self.text[self.start:self.end]


def _rx(tag: Tag) -> Pattern[str]:
    return re.compile(re.escape(tag)) if isinstance(tag, str) else tag


def spans(text: str, opening: Tag, closing: Tag, start: int = 0, stop: int = -1) -> Iterator[Span]:
    """The spans of ``text[start:stop]`` between ``opening`` and ``closing`` (strings or regexes),
    in order; one without its closing tag ends at the next opening tag (or ``stop``)."""
    open_rx, close_rx = _rx(opening), _rx(closing)
    stop = len(text) if stop < 0 else stop
    m = open_rx.search(text, start, stop)
    while m is not None:
        body = m.end()
        close = close_rx.search(text, body, stop)
        nxt = open_rx.search(text, body, stop)
        closed = close is not None and (nxt is None or close.start() < nxt.start())
        body_end = close.start() if closed else (nxt.start() if nxt is not None else stop)
        end = close.end() if closed else body_end
        yield Span(text, m.start(), body, body_end, end, closed, m)
        m = nxt if not closed else open_rx.search(text, end, stop)


_ATTR = re.compile(r'([\w:-]+)\s*=\s*(?:"([^"]*)"|\'([^\']*)\'|([^\s>"\']+))')


def attributes(tag_text: str) -> Dict[str, str]:
    """``name="value"`` pairs of an opening tag's text (quotes optional)."""
    return {m.group(1): next(g for g in m.groups()[1:] if g is not None) for m in _ATTR.finditer(tag_text)}


def unquote(name: str) -> str:
    """A name as a tag writes it, without whitespace and one pair of quotes."""
    name = name.strip()
    if len(name) >= 2 and name[0] == name[-1] and name[0] in '"\'':
        return name[1:-1]
    return name
