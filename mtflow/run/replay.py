"""The recorded model outputs of a run, served as the model of a new run (``mtflow replay``).

:class:`ReplayBackend` is a ``rollout_fn`` that answers request ``uuid`` at its ``t``-th model call
with the output recorded for that uuid and turn (text, exact token ids, logprobs, finish reason:
the line's ``turns``, ``mtflow/run/turn_log.py``), **only when the prompt it gets is the prompt
that output answered** (equal :func:`~mtflow.run.turn_log.prompt_digest`). When it is not (the
environment, a tool or the scheduler now answers differently, or the record has no such turn),
the recorded output no longer answers the prompt, and the request either finishes with
``replay_diverged`` at that turn (an output whose ``finish_reason`` is ``replay_diverged``: the
executor ends the request without applying it, ``mtflow/core/stop.py``), or, with a ``live``
backend (``--continue-with``), continues from there with that model.

Memory: the record is indexed once (uuid -> byte offset); a request's turns are read when it
first asks and dropped when it finishes (:meth:`forget`), so the backend holds only the requests
in flight whatever the size of the run.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

from mtflow.backends.base import Backend, BackendError, build_output, sampling_options
from mtflow.backends.models import load_tokenizer
from mtflow.backends.tokens import TokenPrompter, commit_outputs
from mtflow.core.machine import REPLAY_DIVERGED
from mtflow.run.diff import index_lines
from mtflow.run.turn_log import TURNS_KEY, expand_turns, prompt_digest

__all__ = ['ReplayBackend', 'run_prompter']


class ReplayBackend(Backend):
    """Recorded outputs as the model (see the module docstring).

    Args:
        trajectories: the recorded run's ``trajectories.jsonl``.
        live: the backend that continues a diverged request (``None``: it finishes as
            ``replay_diverged``).

    Attributes:
        served: outputs served from the record; ``diverged``: uuids whose prompt differed (or
            had no recorded turn); ``live_calls``: outputs the live backend generated.
    """
    name = 'replay'

    def __init__(self, trajectories: Path, live: Optional[Any] = None, tokenizer: Any = None,
                 prompter: Optional[TokenPrompter] = None) -> None:
        super().__init__()
        self.path = Path(trajectories)
        self.model_name = f'replay:{self.path.parent.name or self.path.name}'
        self.index = index_lines(self.path)
        self._file = open(self.path, 'rb')
        self.live = live
        self.tokenizer = tokenizer if tokenizer is not None else getattr(live, 'tokenizer', None)
        #: rebuilds the exact-id token record the run's backend kept (``None``: the run kept none)
        self.prompter = prompter if prompter is not None else getattr(live, 'prompter', None)
        self._turns: Dict[str, List[Dict[str, Any]]] = {}
        self._calls: Dict[str, int] = {}
        self._live: Set[str] = set()
        self.served = 0
        self.live_calls = 0
        self.diverged: List[str] = []
        self._checked_format = False
        #: id(request) -> (request, its prompt digest) for the requests of the latest call
        #: (:meth:`known_digest`); holding the request keeps its id from being reused
        self._digests: Dict[int, Tuple[Any, str]] = {}

    def keep_special_tokens(self) -> Optional[str]:
        """The recorded text is served as it was returned (the live backend's is asked too)."""
        keep = getattr(self.live, 'keep_special_tokens', None)
        return keep() if callable(keep) else None

    def _recorded(self, uuid: str) -> List[Dict[str, Any]]:
        turns = self._turns.get(uuid)
        if turns is None:
            offset = self.index.get(uuid)
            if offset is None:
                turns = []
            else:
                self._file.seek(offset)
                line = json.loads(self._file.readline())
                if TURNS_KEY not in line:
                    raise BackendError(f'{self.path}: request {uuid} has no "{TURNS_KEY}": the run was written '
                                       f'before mtflow recorded what replay needs (replay_format 1); run it again')
                turns = expand_turns(line)
            self._turns[uuid] = turns
        return turns

    def fork(self, parent: str, children: List[str]) -> None:
        """Request ``parent`` was forked (``docs/branching.md``): each child goes on from the
        parent's turn (its recorded line holds the parent's turns before its own), live when the
        parent went live."""
        for child in children:
            self._calls[str(child)] = self._calls.get(str(parent), 0)
            if str(parent) in self._live:
                self._live.add(str(child))

    def forget(self, uuid: str) -> None:
        """A request finished: drop what was kept for it."""
        self._turns.pop(uuid, None)
        self._calls.pop(uuid, None)
        self._live.discard(uuid)

    def known_digest(self, request: Any) -> Optional[str]:
        """The prompt digest this backend computed for ``request`` in its latest call (``None``
        for another request): the turn log (``mtflow/run/turn_log.py``) notes it instead of
        computing it again. The request's messages are not changed in between: the replay
        backend does not touch them, and a live-continued request has no entry."""
        entry = self._digests.pop(id(request), None)
        return entry[1] if entry is not None and entry[0] is request else None

    def __call__(self, requests: List[Any], request_config: Any = None) -> List[Any]:
        t0 = time.perf_counter()
        digests = self._digests
        digests.clear()
        options = sampling_options(request_config, self.default_max_tokens)
        outputs: List[Any] = [None] * len(requests)
        live_at: List[int] = []
        for k, request in enumerate(requests):
            uuid = str(getattr(request, 'uuid', None))
            turn = self._calls[uuid] = self._calls.get(uuid, 0) + 1
            if uuid in self._live:
                live_at.append(k)
                continue
            turns = self._recorded(uuid)
            rec = turns[turn - 1] if turn <= len(turns) else None
            digest = prompt_digest(getattr(request, 'messages', None))
            if rec is None or rec['prompt'] != digest:
                self.diverged.append(uuid)
                if self.live is not None:
                    self._live.add(uuid)
                    live_at.append(k)
                    continue
                outputs[k] = _diverged_output(self.model_name)
                continue
            lps = rec['logprobs'] if options.logprobs else None
            plan = self.prompter.plan(request) if self.prompter is not None else None
            out = build_output(rec['text'], rec['token_ids'], rec['finish_reason'], logprobs=lps,
                               model=self.model_name, prompt_tokens=len(plan.ids) if plan is not None else 0,
                               prompt_token_ids=list(plan.ids) if plan is not None else None)
            if plan is not None:
                commit_outputs(self.prompter, [request], [plan], [out])
            outputs[k] = out
            digests[id(request)] = (request, digest)
            self.served += 1
        if live_at:
            live_outputs = list(self.live([requests[k] for k in live_at], request_config))
            for k, out in zip(live_at, live_outputs):
                outputs[k] = out
            self.live_calls += len(live_at)
        self._record([o for o in outputs if o is not None], time.perf_counter() - t0)
        return outputs

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self.live is not None and callable(getattr(self.live, 'close', None)):
            self.live.close()

    def describe(self) -> str:
        live = f', live: {self.live.describe()}' if self.live is not None and hasattr(self.live, 'describe') else ''
        return f'replay of {self.path}{live}'


#: backends that generate from exact token prompts and keep each request's token record
TOKEN_BACKENDS = ('hf', 'vllm')


def run_prompter(backend: str, model: Optional[str], options: Dict[str, Any]) -> Optional[TokenPrompter]:
    """The prompter the run's backend used (its tokenizer, chat template and prefix policy), so that
    the replay rebuilds the same exact-id token record (``rollout_infos.token_record``); ``None``
    for a backend that keeps none (scripted without ``tokenizer``, an OpenAI server without one)."""
    if backend in TOKEN_BACKENDS:
        tokenizer = load_tokenizer(model or 'embedded')
    elif backend == 'openai' and isinstance(options.get('tokenizer'), str) and options.get('prompt_mode') != 'chat':
        tokenizer = load_tokenizer(options['tokenizer'])
    elif backend == 'scripted' and isinstance(options.get('tokenizer'), str):  # a script with exact ids
        tokenizer = load_tokenizer(options['tokenizer'])
    else:
        return None
    return TokenPrompter(tokenizer, options.get('chat_template'), policy=options.get('prefix_policy', 'exact'),
                         exact=options.get('exact_ids', True))


def _diverged_output(model: str) -> Any:
    """An empty output whose finish reason is ``replay_diverged`` (set after validation: the
    protocol's choice admits only ms-swift's ``stop``/``length``; the executor reads it as it is)."""
    out = build_output('', [], 'stop', model=model)
    out.response.choices[0].finish_reason = REPLAY_DIVERGED
    return out
