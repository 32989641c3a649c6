"""A run's chat checks, before its first turn: the chat template the backend renders with shows the
model every part of the conversation (:func:`mtflow.backends.chat_templates.template_problems`),
and ``max_tokens`` after the dataset's longest prompt fits the model's context.

The context check stands in for a ``context:`` block (``docs/context.md``), which budgets every
turn; without one, a turn-1 prompt plus ``max_tokens`` beyond the model's context would run
silently (a 64-position model asked for 453 new tokens). The longest prompt is measured on the
dataset's longest texts (the :data:`MEASURED` longest by characters), each rendered as the run
renders it: the scheduler's system prompt and tools added, through the chat template.

``mtflow run`` checks once the backend is built and the scheduler made (:func:`prepare_loaded`:
first what the two must agree on, :func:`mtflow.backends.pairing.fit_scheduler`, then
:func:`check_loaded`), and so does each actor of ``--ray``, before its first turn;
``mtflow validate`` (and the driver of ``--ray``, before the fan-out) with the tokenizer and the
model's ``config.json`` read from disk, without the weights, where they are there
(:func:`check_offline`). Both call :func:`chat_problems`."""
from __future__ import annotations

import copy
import heapq
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Tuple

from mtflow.backends import BackendError, resolve_backend
from mtflow.backends.base import prepare_chat, reports_of
from mtflow.backends.chat_templates import (TOKENIZER_OWN, TemplateSource, call_form, foreign_markers,
                                            resolve_chat_template, template_problems)
from mtflow.backends.openai_server import chat_mode_strips
from mtflow.backends.pairing import fit_scheduler, markers_refusal
from mtflow.backends.models import cached_model_dir, load_tokenizer
from mtflow.backends.tokens import render_text
from mtflow.core.errors import RunSetupError
from mtflow.data import DatasetError
from mtflow.data.sources import iter_requests
from mtflow.run.config import RunConfig

__all__ = ['ChatSetup', 'MEASURED', 'chat_problems', 'check_loaded', 'check_offline', 'prepare_loaded']

#: how many of the dataset's longest prompts (by characters) are rendered and counted in tokens
MEASURED = 8


@dataclass
class ChatSetup:
    """What the checks need of a backend: its tokenizer, its template, the model's context (and
    where that figure comes from) and the ``max_tokens`` of a request config without one."""
    tokenizer: Any
    source: TemplateSource
    context_length: Optional[int]
    context_from: str
    default_max_tokens: int


def _max_tokens(cfg: RunConfig, setup: ChatSetup) -> Tuple[int, str]:
    given = cfg.request_config.get('max_tokens')
    if isinstance(given, int):
        return given, cfg.where('request_config.max_tokens')
    return setup.default_max_tokens, (f'{cfg.where("request_config.max_tokens")} (not set: the backend\'s '
                                      f'default_max_tokens)')


def _longest_prompt(cfg: RunConfig, setup: ChatSetup, scheduler: Any) -> Tuple[int, str]:
    """``(tokens, uuid)`` of the longest turn-1 prompt among the dataset's longest texts."""
    def chars(request: Any) -> int:
        return sum(len(str(m.get('content') or '')) for m in request.messages) + len(json.dumps(request.tools or []))

    requests = iter_requests(cfg.dataset, cfg.dataset_path(), cfg.limit, check_unique=False)
    best, uuid = 0, ''
    for request in heapq.nlargest(MEASURED, requests, key=chars):
        request = copy.deepcopy(request)
        prepare = getattr(scheduler, 'prepare', None)
        if callable(prepare):  # a YAML scheduler's system prompt, with its tools
            prepare(request)
        text = render_text(setup.tokenizer, prepare_chat(request), None, setup.source.text,
                           where=f'request {request.uuid!r}')
        n = len(setup.tokenizer(text, add_special_tokens=False)['input_ids'])
        if n > best:
            best, uuid = n, str(request.uuid)
    return best, uuid


def _context_problem(cfg: RunConfig, setup: ChatSetup, scheduler: Any) -> Tuple[Optional[str], str]:
    """The context check's problem (``None``: it fits, or there is nothing to check) and what it
    found, for the line that says the run was checked."""
    if setup.context_length is None or cfg.context is not None:
        return None, ''
    max_tokens, where = _max_tokens(cfg, setup)
    try:
        prompt, uuid = _longest_prompt(cfg, setup, scheduler)
    except (DatasetError, BackendError):
        return None, ''  # reported as the dataset's or the template's own problem
    context, source = setup.context_length, setup.context_from
    found = f'longest prompt {prompt} + max_tokens {max_tokens} <= context {context}'
    if prompt + max_tokens <= context:
        return None, found
    if prompt >= context:
        return (f'{cfg.where("dataset")}: the longest prompt (request {uuid!r}, {prompt} tokens through '
                f'{setup.source.name}) does not fit the model\'s context of {context} tokens ({source}); shorten it '
                'or set a context: block (docs/context.md)'), found
    return (f'{where}: {max_tokens} new tokens after the longest prompt (request {uuid!r}, {prompt} tokens) need '
            f'{prompt + max_tokens}, more than the model\'s context of {context} tokens ({source}); set max_tokens '
            f'to at most {context - prompt}, or a context: block (docs/context.md)'), found


def chat_problems(cfg: RunConfig, setup: ChatSetup, scheduler: Any = None) -> Tuple[List[str], str]:
    """Every problem of the template and the context (one line each, naming the config's key,
    the template and the role), and a line saying what was checked."""
    key = 'backend_options.chat_template' if 'chat_template' in cfg.backend_options else 'model'
    at = cfg.where(key)
    text_calls = bool(getattr(scheduler, 'writes_tool_messages', False))
    problems = [f'{at}: {p}' for p in template_problems(setup.tokenizer, setup.source, text_calls=text_calls)]
    if text_calls and not problems and not getattr(scheduler, 'answers_each_call', True) and \
            call_form(setup.tokenizer, setup.source) != 'text':
        problems.append(f'{at}: chat template {setup.source.name} takes tool results only after calls given as '
                        'tool_calls, each answered by a tool message of its own, but the scheduler joins the results of '
                        'a turn into one tool message (observation.one_message_per_call: false): set it true')
    foreign = foreign_markers(setup.tokenizer, setup.source) if not problems else []
    if foreign:
        problems.append(f"{at}: chat template {setup.source.name} writes {', '.join(foreign[:4])}"
                        f"{', ...' if len(foreign) > 4 else ''}, which the model's tokenizer does not have as tokens "
                        "(each is spelt in several): it is another model family's template; leave chat_template out "
                        "for the tokenizer's own, or give one written for this model")
    context, found = _context_problem(cfg, setup, scheduler) if not problems else (None, '')
    problems += [context] if context else []
    shown = setup.source.describe() if setup.source.text is not None or setup.source.name != TOKENIZER_OWN.name \
        else f"the tokenizer's own ({cfg.model or 'the default model'})"
    note = f'chat template: {shown}: shows every part of a tool-use conversation' + (
        f'; {found}' if found else '')
    return problems, note


def check_loaded(cfg: RunConfig, backend: Any, scheduler: Any) -> Optional[str]:
    """The checks of ``mtflow run``, once the backend and the scheduler are built: a
    :class:`RunSetupError` listing the problems, else the line that says what was checked
    (``None`` for a backend that renders nothing here: a server in chat mode)."""
    reports = reports_of(backend)
    prompter, renderer = reports.prompter, None
    default_max_tokens = getattr(backend, 'default_max_tokens', 256)
    if prompter is not None:
        setup = ChatSetup(prompter.tokenizer, prompter.template_source, reports.context_length,
                          f'as the {cfg.backend} backend reports it', default_max_tokens)
    else:  # a server renders: its template and tokenizer through the server (vLLM's /tokenize), where it has them
        renderer = reports.chat_renderer
        if renderer is None:
            return _max_tokens_only(cfg, reports.context_length, default_max_tokens)
        setup = ChatSetup(renderer, TemplateSource(None, renderer.describe(), renderer.describe()),
                          reports.context_length, 'as GET /v1/models reports it, max_model_len', default_max_tokens)
    problems, note = chat_problems(cfg, setup, scheduler)
    if problems:
        raise RunSetupError('\n'.join(problems))
    return note


def _max_tokens_only(cfg: RunConfig, context: Optional[int], default_max_tokens: int) -> Optional[str]:
    """A server that renders the prompts and cannot be asked to (no ``/tokenize``): ``max_tokens``
    alone against the context it reports; the line says what was not checked."""
    if context is None or cfg.context is not None:
        return None
    max_tokens, where = _max_tokens(cfg, ChatSetup(None, TOKENIZER_OWN, context, '', default_max_tokens))
    if max_tokens >= context:
        raise RunSetupError(f'{where}: {max_tokens} new tokens do not fit the served model\'s context of {context} '
                            'tokens (as GET /v1/models reports it, max_model_len) even after an empty prompt; set '
                            'max_tokens lower, or a context: block (docs/context.md)')
    return (f"chat template: the server's, not checked (it has no /tokenize endpoint to render with), nor the prompts' "
            f'lengths; max_tokens {max_tokens} < context {context}')


def prepare_loaded(cfg: RunConfig, backend: Any, scheduler: Any) -> List[str]:
    """Before the first turn, once the backend and the scheduler are built: what they must agree
    on (special tokens kept, how calls are carried), then :func:`check_loaded`; the lines that say
    what was set and checked, or a :class:`RunSetupError` (``mtflow run`` and each Ray actor)."""
    try:
        notes = fit_scheduler(backend, scheduler, cfg.backend if isinstance(cfg.backend, str) else '')
    except BackendError as exc:
        raise RunSetupError(f'{cfg.where("backend")}: {exc}') from None
    checked = check_loaded(cfg, backend, scheduler)
    return notes + ([checked] if checked else [])


def _offline_setup(cfg: RunConfig) -> Tuple[Optional[ChatSetup], Optional[str]]:
    """The setup of the config's backend read from disk: the tokenizer and ``config.json`` of the
    model (hf, vllm) or of the ``tokenizer`` option (openai in token mode, scripted), without
    loading weights; ``(None, why)`` where they are not on disk (a hub id, an unconverted GGUF)."""
    options = cfg.resolved_backend_options()
    try:
        cls = resolve_backend(cfg.backend, cfg.base_dir)
    except Exception:
        return None, None  # reported by the backend's own checks
    default_max_tokens = options.get('default_max_tokens') or getattr(cls, 'default_max_tokens', 256)
    if cfg.backend in ('hf', 'vllm'):
        name = cfg.resolved_model() or 'embedded'
    elif cfg.backend in ('openai', 'scripted') and isinstance(options.get('tokenizer'), str):
        name = options['tokenizer']
        if cfg.backend == 'openai' and options.get('prompt_mode') == 'chat':
            return None, None  # the server renders
    else:
        return None, None
    directory = cached_model_dir(name)
    if directory is None:
        return None, (f'chat template: not checked here ({name!r} is not on disk yet); mtflow run checks it once the '
                      'model loads')
    try:
        tokenizer = load_tokenizer(str(directory))
        source = resolve_chat_template(options.get('chat_template'))
    except BackendError as exc:
        return None, f'chat template: not checked here: {exc}'
    context, context_from = None, ''
    if cfg.backend in ('hf', 'vllm'):
        context_from = 'max_position_embeddings in its config.json'
        max_model_len = (options.get('engine_kwargs') or {}).get('max_model_len')
        if isinstance(max_model_len, int):
            context, context_from = max_model_len, 'engine_kwargs.max_model_len'
        else:
            context = _max_positions(directory / 'config.json')
    return ChatSetup(tokenizer, source, context, context_from, int(default_max_tokens)), None


def _chat_mode_markers(cfg: RunConfig, scheduler_factory: Any) -> List[str]:
    """An ``openai`` backend in chat mode and a parser that reads special tokens (gpt-oss's, Kimi's):
    the refusal ``mtflow run`` makes once the backend is built (``mtflow.backends.pairing``)."""
    why = chat_mode_strips(cfg.resolved_backend_options()) if cfg.backend == 'openai' else None
    if why is None or scheduler_factory is None:
        return []
    try:
        scheduler = scheduler_factory(None)
    except Exception:
        return []  # its problems are the scheduler's own
    try:
        markers = list(getattr(scheduler, 'special_markers', ()) or ())
        parser = getattr(getattr(scheduler, 'parser', None), 'name', None) or 'the configured'
    finally:
        close = getattr(scheduler, 'close', None)
        if callable(close):
            close()
    return [f'{cfg.where("backend")}: {markers_refusal(parser, markers, "openai", why)}'] if markers else []


def _max_positions(path: Path) -> Optional[int]:
    try:
        value = json.loads(path.read_text(encoding='utf-8')).get('max_position_embeddings')
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def check_offline(cfg: RunConfig, scheduler_factory: Any = None) -> Tuple[List[str], List[str]]:
    """The checks of ``mtflow validate``: ``(problems, notes)``; ``scheduler_factory(tokenizer)``
    builds the scheduler whose system prompt and tool messages the checks take into account."""
    setup, why = _offline_setup(cfg)
    if setup is None:
        return _chat_mode_markers(cfg, scheduler_factory), [why] if why else []
    scheduler = None
    if scheduler_factory is not None:
        try:
            scheduler = scheduler_factory(setup.tokenizer)
        except Exception:
            scheduler = None  # its problems are the scheduler's own
    try:
        problems, note = chat_problems(cfg, setup, scheduler)
    finally:
        close = getattr(scheduler, 'close', None)
        if callable(close):
            close()
    return problems, [] if problems else [note]
