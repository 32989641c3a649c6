"""The chat template and context of an OpenAI-compatible server in chat mode, read from the server:
in chat mode the server renders every prompt with its own template, which mtflow never sees, so
the checks a run makes before its first turn (``mtflow.run.chat_check``) ask the server.

vLLM's server has what it takes: ``GET /v1/models`` lists each model's ``max_model_len``, and
``POST /tokenize`` (at the server's root) renders a conversation through the server's template
(``messages``, ``tools``, ``add_generation_prompt``...) into token ids, which ``POST /detokenize``
turns back into the prompt's text. :class:`ServerTemplate` offers them as the part of a
transformers tokenizer the checks use (``apply_chat_template``, calling it on text), so the same
probe that checks a local template checks the server's, and the dataset's longest prompts are
counted as the server would count them. A server without ``/tokenize`` (SGLang's differs, hosted
APIs have none) is not asked: the run says what it did not check.

Plain ``urllib``, as :mod:`mtflow.backends.server_check`; a few calls before the first turn.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional

from mtflow.backends.server_check import PREFLIGHT_TIMEOUT_S

__all__ = ['ServerTemplate', 'ServerFacts', 'served_context_length', 'CHAT_MODE_STRIPS']

#: why an OpenAI backend in chat mode cannot hand a parser the special tokens it reads, and what to do
CHAT_MODE_STRIPS = ('in chat mode the server decodes the reply without special tokens; use token mode '
                    "(backend_options.tokenizer: the model's tokenizer, flavor: vllm), or start the server with its "
                    'own tool-call parser (vllm serve --enable-auto-tool-choice --tool-call-parser ...) and set '
                    'backend_options.server_tool_calls: true')


def _root(base_url: str) -> str:
    url = base_url.rstrip('/')
    return url[:-len('/v1')] if url.endswith('/v1') else url


def _call(url: str, body: Optional[Dict[str, Any]], headers: Optional[Dict[str, str]], timeout_s: float) -> Any:
    """The JSON answer of ``url`` (GET without ``body``); ``OSError`` with the server's words."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={'Content-Type': 'application/json', **(headers or {})},
                                     method='POST' if body is not None else 'GET')
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return json.loads(resp.read() or b'{}')
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read() or b'{}').get('error', {})
            message = detail.get('message', detail) if isinstance(detail, dict) else detail
        except (ValueError, AttributeError):
            message = exc.reason
        raise OSError(f'HTTP {exc.code}: {message}') from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise OSError(f'{type(exc).__name__}: {exc}') from None


def served_context_length(base_url: str, model: Optional[str], headers: Optional[Dict[str, str]] = None,
                          timeout_s: float = PREFLIGHT_TIMEOUT_S) -> Optional[int]:
    """``max_model_len`` of ``model`` (else of the first model) as ``GET <base_url>/models`` lists
    it (vLLM's server does); ``None`` when the server does not say or does not answer."""
    try:
        data = _call(base_url.rstrip('/') + '/models', None, headers, timeout_s)
    except OSError:
        return None
    cards = [c for c in (data.get('data') if isinstance(data, dict) else None) or [] if isinstance(c, dict)]
    card = next((c for c in cards if c.get('id') == model), cards[0] if cards and model is None else None)
    value = (card or {}).get('max_model_len')
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class ServerTemplate:
    """A server's chat template and tokenizer, through ``/tokenize`` and ``/detokenize`` (see the
    module docstring). ``describe()`` names it in the run's messages."""
    #: truthy: the checks ask this object's template (the server's own)
    chat_template = "the server's template"

    def __init__(self, base_url: str, model: Optional[str], headers: Optional[Dict[str, str]] = None,
                 timeout_s: float = PREFLIGHT_TIMEOUT_S) -> None:
        self.root, self.model, self.headers, self.timeout_s = _root(base_url), model, headers, timeout_s

    def _post(self, path: str, body: Dict[str, Any]) -> Any:
        if self.model is not None:
            body = dict(body, model=self.model)
        return _call(self.root + path, body, self.headers, self.timeout_s)

    def available(self) -> bool:
        """Whether the server has the endpoints (one ``/tokenize`` of a short text)."""
        try:
            data = self._post('/tokenize', {'prompt': 'probe', 'add_special_tokens': False})
        except OSError:
            return False
        return isinstance(data, dict) and isinstance(data.get('tokens'), list)

    def describe(self) -> str:
        return f"the server's template ({self.root}/tokenize)"

    def apply_chat_template(self, messages: List[Dict[str, Any]], tools: Any = None, tokenize: bool = False,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            chat_template: Optional[str] = None, **kwargs: Any) -> Any:
        """The prompt the server renders for ``messages`` (its text; its ids with ``tokenize``).
        A template error is the server's 400, raised as ``ValueError`` as a local template's is."""
        body: Dict[str, Any] = {'messages': messages, 'add_generation_prompt': add_generation_prompt,
                                'continue_final_message': continue_final_message, 'add_special_tokens': False}
        if tools:
            body['tools'] = tools
        if chat_template is not None:
            body['chat_template'] = chat_template
        if kwargs:
            body['chat_template_kwargs'] = kwargs
        try:
            ids = self._post('/tokenize', body)['tokens']
            return ids if tokenize else self._post('/detokenize', {'tokens': ids})['prompt']
        except (OSError, KeyError, TypeError) as exc:
            raise ValueError(f'the server could not render it: {exc}') from None

    def __call__(self, text: str, add_special_tokens: bool = False, **kwargs: Any) -> Dict[str, List[int]]:
        """``{'input_ids': ...}`` of ``text``, as the server tokenizes it."""
        return {'input_ids': list(self._post('/tokenize', {'prompt': text, 'add_special_tokens': add_special_tokens})
                                  ['tokens'])}


class ServerFacts:
    """What an OpenAI backend reads of its server, and what it can ask of it, for the run's checks
    (a mixin of :class:`~mtflow.backends.openai_server.OpenAIBackend`: ``base_url``,
    ``served_model``, ``_headers``, ``flavor``, ``prompter``, ``skip_special_tokens`` and
    ``server_tool_calls`` are its own); each fact asked once.

    The backend's options: ``skip_special_tokens`` (token mode: ``False`` sends vLLM's
    ``skip_special_tokens: false`` with each token prompt, so the reply's text keeps them; ``mtflow
    run`` sets it for a parser that reads them) and ``server_tool_calls`` (the server parses the
    model's calls itself, ``vllm serve --enable-auto-tool-choice --tool-call-parser ...``: in chat
    mode a parser's special tokens are then not needed)."""

    def keep_special_tokens(self) -> Optional[str]:
        """Token mode: ask for replies with their special tokens (``skip_special_tokens: false``,
        vLLM's field). Chat mode: the server decodes the reply without them, and mtflow cannot ask
        every server otherwise (vLLM's gpt-oss path parses the ids itself), so this holds only when
        the server returns the calls structured (``server_tool_calls``)."""
        if self.prompter is not None:
            self.skip_special_tokens = False
            return None
        return None if self.server_tool_calls else CHAT_MODE_STRIPS

    def _asked(self) -> Dict[str, Any]:
        return self.__dict__.setdefault('_server_facts', {})

    @property
    def context_length(self) -> Optional[int]:
        """The served model's ``max_model_len`` as ``GET /v1/models`` lists it (vLLM's server);
        ``None`` when the server does not say."""
        asked = self._asked()
        if 'context_length' not in asked:
            asked['context_length'] = served_context_length(self.base_url, self.served_model, self._headers)
        return asked['context_length']

    @property
    def chat_renderer(self) -> Optional[ServerTemplate]:
        """In chat mode, the server's template through its ``/tokenize`` endpoint (vLLM's), for the
        checks before the first turn; ``None`` in token mode (mtflow renders) or when the server has
        no such endpoint."""
        asked = self._asked()
        if 'chat_renderer' not in asked:
            renderer = None
            if self.prompter is None and self.flavor == 'vllm':
                renderer = ServerTemplate(self.base_url, self.served_model, self._headers)
                renderer = renderer if renderer.available() else None
            asked['chat_renderer'] = renderer
        return asked['chat_renderer']
