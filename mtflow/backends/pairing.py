"""What a backend and a scheduler must agree on before the first turn, settled once both are built
(``mtflow run``, each Ray actor, ``mtflow replay``; in Python, call :func:`fit_scheduler` yourself):

* **special tokens the parsers read.** gpt-oss's harmony markers (``<|channel|>``, ``<|message|>``,
  ``<|call|>``...) and Kimi-K2's section markers are special tokens of those models' tokenizers; a
  backend that decodes replies without special tokens (vLLM's default, and the HF backend's) hands
  the parser a text without them, and every request ends with ``stop_rule:no_tool_call`` without a
  word. The scheduler says which markers its parsers read (``special_markers``); those that are
  special tokens of the backend's tokenizer (all of them when the backend has none to ask) make the
  backend keep special tokens (``Backend.keep_special_tokens``), or the run is refused in one line
  naming the parser, the backend and what to do.
* **how calls read from the text are carried** (``mtflow.declarative.call_messages``): in the
  assistant's text, or as OpenAI ``tool_calls``, the way the template the prompts are rendered with
  takes them (:func:`~mtflow.backends.chat_templates.call_form`): mtflow's template, or in chat mode
  the server's, asked through the server (:mod:`mtflow.backends.server_template`); a server that
  cannot be asked gets the calls as text, as before.

Both are asked of the scheduler by attribute (a Python scheduler without them is left alone).
"""
from __future__ import annotations

from typing import Any, List

from mtflow.backends.base import BackendError, reports_of
from mtflow.backends.chat_templates import call_form
from mtflow.declarative.parsers.base import special_marker_ids

__all__ = ['fit_scheduler', 'keep_markers', 'markers_refusal']


def fit_scheduler(backend: Any, scheduler: Any, backend_name: str = '') -> List[str]:
    """Settle what ``backend`` and ``scheduler`` must agree on (the module docstring); the lines
    that say what was set, or :class:`BackendError` with the line that says why they cannot go
    together. ``backend_name``: how the refusal names the backend (default its ``name``)."""
    notes = keep_markers(backend, getattr(scheduler, 'parser', None), getattr(scheduler, 'special_markers', ()),
                         backend_name)
    form = _call_form(backend, scheduler)
    if form is not None:
        scheduler.carry_calls(form)
        if form == 'openai':
            notes.append('tool calls read from the text are carried as OpenAI tool_calls, each answered by its '
                         'tool message (the chat template takes tool results only so)')
    return notes


def keep_markers(backend: Any, parser: Any, markers: Any, backend_name: str = '') -> List[str]:
    """Have ``backend`` keep those of ``markers`` (what ``parser`` reads) that are special tokens of its
    tokenizer: the line that says so (``[]`` when there is nothing to keep), or :class:`BackendError`
    naming the parser and the backend (:func:`fit_scheduler`; the gateway's ``tool_parser``)."""
    markers = tuple(markers or ())
    if not markers:
        return []
    tokenizer = reports_of(backend).tokenizer
    special = list(special_marker_ids(tokenizer, markers).values()) if tokenizer is not None else list(markers)
    if not special:  # plain text in this tokenizer: no decode removes them
        return []
    keep = getattr(backend, 'keep_special_tokens', None)
    if not callable(keep):  # a plain rollout_fn: the scheduler checks each reply's ids against its text
        return []
    why = keep()
    parser = getattr(parser, 'name', None) or 'the configured'
    name = backend_name or getattr(backend, 'name', type(backend).__name__)
    if why is not None:
        raise BackendError(markers_refusal(parser, special, name, why))
    return [f'replies decoded with their special tokens ({_shown(special)}): the {parser} parser reads them']


def _shown(markers: List[str]) -> str:
    return ', '.join(markers[:4]) + (', ...' if len(markers) > 4 else '')


def markers_refusal(parser: str, markers: List[str], backend_name: str, why: str) -> str:
    """The line that refuses a backend that cannot return the markers ``parser`` reads."""
    return (f'parser {parser} reads {_shown(markers)}, special tokens of the model\'s tokenizer, which the '
            f'{backend_name} backend removes from the replies: {why}')


def _call_form(backend: Any, scheduler: Any) -> Any:
    if not getattr(scheduler, 'answers_each_call', False) or not callable(getattr(scheduler, 'carry_calls', None)):
        return None
    reports = reports_of(backend)
    prompter = reports.prompter
    if prompter is not None:
        return call_form(prompter.tokenizer, prompter.template_source)  # None: the template checks say why
    renderer = reports.chat_renderer  # a server's own template, asked through the server
    return call_form(renderer) if renderer is not None else None
