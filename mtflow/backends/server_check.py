"""Is an OpenAI-compatible server there, and does it serve the model? Asked once before a run
builds anything (``GET <url>/models``, a short timeout), so that a wrong ``base_url`` or model
name is one line at the start instead of every request failing after the backend's retries (and
a run directory left behind that blocks the rerun).

Plain ``urllib`` (no client library needed to ask), with the same bearer token the backend sends."""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional, Sequence

from mtflow.backends.base import PreflightProblem
from mtflow.core.keys import closest_key

__all__ = ['served_models', 'server_problems', 'options_problems', 'PREFLIGHT_TIMEOUT_S']

#: seconds one ``GET /models`` may take before the server counts as not answering
PREFLIGHT_TIMEOUT_S = 3.0


def served_models(url: str, api_key: Optional[str] = None, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> List[str]:
    """The model ids ``GET <url>/models`` lists; ``OSError`` (with a readable message) when the
    server does not answer or answers with an error."""
    request = urllib.request.Request(url.rstrip('/') + '/models',
                                     headers={'Authorization': f'Bearer {api_key}'} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            data = json.loads(resp.read() or b'{}')
    except urllib.error.HTTPError as exc:
        raise OSError(f'HTTP {exc.code} {exc.reason}') from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        raise OSError(getattr(reason, 'strerror', None) or str(reason)) from None
    except (OSError, ValueError) as exc:  # a timeout, a reset, a reply that is not JSON
        raise OSError(f'{type(exc).__name__}: {exc}' if str(exc) else type(exc).__name__) from None
    items = data.get('data') if isinstance(data, dict) else None
    return [str(m['id']) for m in items or [] if isinstance(m, dict) and m.get('id')]


def server_problems(urls: Sequence[str], model: Optional[str], api_key: Optional[str] = None,
                    timeout_s: float = PREFLIGHT_TIMEOUT_S) -> List[PreflightProblem]:
    """What is wrong with serving ``model`` from ``urls``: none of them answers ``GET /models``
    (one of several may be down: the router waits for it), or one that answers does not list
    ``model`` (with the models it lists and the closest). ``[]``: all is well."""
    answered, down, problems = 0, [], []
    for url in urls:
        try:
            models = served_models(url, api_key, timeout_s)
        except OSError as exc:
            down.append(f'GET {url.rstrip("/")}/models: {exc}')
            continue
        answered += 1
        if model is not None and models and model not in models:
            close = closest_key(model, models)
            problems.append(PreflightProblem(f'{url} does not serve model {model!r} (GET /models lists: '
                                             f'{", ".join(models)}' + (f"; did you mean {close!r}?)" if close else ')')))
    if not answered:
        problems.insert(0, PreflightProblem(f'no server answers ({"; ".join(down)}): start it, or fix base_url/urls',
                                            unreachable=True))
    return problems


def options_problems(model: Optional[str], options: Dict[str, Any], default_url: str) -> List[PreflightProblem]:
    """:func:`server_problems` for the servers an OpenAI backend built from ``options`` would ask
    (``urls``, else ``base_url``, else ``MTFLOW_OPENAI_BASE_URL``, else ``default_url``), with its
    ``api_key`` (or ``OPENAI_API_KEY``), within its ``timeout`` when that is shorter."""
    urls = options.get('urls')
    if not isinstance(urls, (list, tuple)) or not urls:
        urls = [options.get('base_url') or os.environ.get('MTFLOW_OPENAI_BASE_URL') or default_url]
    if not all(isinstance(u, str) for u in urls):
        return []  # the backend's constructor says what is wrong with them
    key = options.get('api_key') if options.get('api_key') is not None else os.environ.get('OPENAI_API_KEY')
    timeout = options.get('timeout')
    limit = min(float(timeout), PREFLIGHT_TIMEOUT_S) if isinstance(timeout, (int, float)) and timeout > 0 \
        else PREFLIGHT_TIMEOUT_S
    return server_problems([u.rstrip('/') for u in urls], model, key, limit)
