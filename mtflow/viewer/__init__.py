"""Trace views: the terminal timeline and summary (:mod:`.terminal`), the one-page HTML viewer
(:mod:`.html`, with its results part: :mod:`.results`, :mod:`.plots`), ``--where``/``--sort``
(:mod:`.query`) and the state graph as SVG (:mod:`.svg`), all computed from one view model
(:mod:`.model`). Imported only when a view is asked for (``rich`` is loaded on use)."""
from mtflow.viewer.model import RequestView, Summary, TurnCell, request_views, select_views, summarize

__all__ = ['RequestView', 'Summary', 'TurnCell', 'request_views', 'select_views', 'summarize']
