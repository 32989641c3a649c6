"""Scripted backend: replays fixed outputs from a JSONL file, for tests and demos.

Each line of the file is one output::

    {"content": "I guess 50", "token_ids": [40, 7], "logprobs": [-0.1, -0.5], "finish_reason": "stop"}

Only ``content`` is required; ``token_ids``, ``logprobs`` (a list of floats), ``tokens`` (their
strings) and ``finish_reason`` (default ``'stop'``) are optional. A plain JSON string is a line
with only ``content``. A line may also say which request and turn it answers::

    {"uuid": "r1", "turn": 2, "content": "..."}

Outputs are served in this order: a line keyed by the request's uuid and its turn (the request's
own count of ``rollout_fn`` calls, from 1), else a line keyed by the uuid alone (those replay in
file order per request), else the next unkeyed line (in file order, cycling when
``cycle=True``); or, with ``respond=``, each output is ``respond(request)`` (a text or a line),
computed from the request. A copy of a prompt made by ``num_generations`` (uuid ``<uuid>#<k>``) is also
served the lines keyed by the prompt's uuid (``<uuid>``): each copy replays them from the first,
so a script written for the dataset works with any ``num_generations``. Running out is a clear
error naming the request.

``sample=True`` makes the unkeyed lines a stand-in for a sampling model: each unkeyed output is
drawn from them with the request's sampling seed (the request config's ``seed``, else the
backend's ``seed``, with the request: :func:`mtflow.core.seeds.sampling_seed`), so a request
gets the same lines whatever batch, concurrency or mode it runs in, and another seed gives other
lines; without a seed the draw follows Python's global ``random`` (``mtflow run`` seeds it).

``honor_max_tokens=True`` cuts a line whose ``token_ids`` are longer than the call's
``max_tokens`` to that many ids (and logprobs, token strings), with ``finish_reason='length'``,
as a real engine would; the text is cut with them (to the token strings when the line has them,
else word by word when it has one word per id; otherwise the line cannot be cut: an error).
Context-budget tests use it (``docs/context.md``).

A request forked into children (``docs/branching.md``, :meth:`ScriptedBackend.fork`) hands them
its turn count, so a line keyed ``{"uuid": "<child>", "turn": t}`` answers the child's turn ``t``;
a child without lines of its own goes on with its parent's lines from where the parent is (the
lines keyed by the parent's uuid and turn, else the prompt's in order), else the unkeyed lines.

**Exact ids** (``tokenizer=``: a tokenizer object, or a model name :func:`mtflow.backends.models.load_tokenizer`
takes, such as ``'embedded'``): the scripted backend then builds every prompt from exact token
ids with that tokenizer's chat template and keeps each request's token record
(:mod:`mtflow.backends.tokens`), as the HF backend does; a line's sampled ids are its
``token_ids``, else its ``content`` tokenized plus the tokenizer's EOS (a stop; logprobs only
when the line has them). So a scripted
"model" that calls tools produces trajectories whose segments pass ``mtflow check-tokens``
(the gateway's tests, ``docs/gateway.md``).

Memory: the per-request state (the call count that numbers its turns, a copy's place in its
prompt's lines) is dropped by :meth:`ScriptedBackend.forget` once the request is final, which a
stream (``Executor.stream``) and ``mtflow run`` call for every delivered request; so a stream of
any length holds only the requests in flight (``benchmarks/streaming.py --model scripted``).
"""
from __future__ import annotations

import json
import random
import re
import threading
from collections import defaultdict, deque
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple, Union

from mtflow.core.registry import resolve_reference
from mtflow.data.sources import group_of
from mtflow.backends.base import Backend, BackendError, PreflightProblem, SamplingOptions, build_output, sampling_seeds
from mtflow.backends.chat_templates import resolve_chat_template
from mtflow.backends.models import load_tokenizer
from mtflow.backends.tokens import TokenPrompter, commit_outputs

__all__ = ['ScriptedBackend', 'read_script']

Line = Dict[str, Any]


def read_script(path: Union[str, Path]) -> List[Line]:
    """Parse a script file; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise BackendError(f'scripted backend: file not found: {path}')
    lines: List[Line] = []
    for no, raw in enumerate(path.read_text(encoding='utf-8').splitlines(), 1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise BackendError(f'{path}:{no}: not valid JSON: {exc.msg}') from exc
        if isinstance(item, str):
            item = {'content': item}
        if not isinstance(item, dict) or not isinstance(item.get('content'), str):
            raise BackendError(f'{path}:{no}: each line needs a string "content"')
        reason = item.get('finish_reason', 'stop')
        if reason not in ('stop', 'length', None):
            raise BackendError(f'{path}:{no}: finish_reason must be "stop", "length" or null, not {reason!r}')
        ids, lps = item.get('token_ids'), item.get('logprobs')
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) for i in ids)):
            raise BackendError(f'{path}:{no}: token_ids must be a list of ints')
        if lps is not None and not (isinstance(lps, list) and all(isinstance(v, (int, float)) for v in lps)):
            raise BackendError(f'{path}:{no}: logprobs must be a list of numbers')
        item['_where'] = f'{path}:{no}'
        lines.append(item)
    return lines


class ScriptedBackend(Backend):
    """``rollout_fn`` that replays outputs from a file (``path``) or a list of dicts (``outputs``);
    ``sample=True``: unkeyed outputs drawn by each request's seed (the module docstring);
    ``prefix_policy``: with a ``tokenizer``, as the HF backend's (``docs/backends.md``)."""
    name = 'scripted'
    streams_text = True

    @classmethod
    def preflight(cls, model: Optional[str], options: Dict[str, Any]) -> List[PreflightProblem]:
        """What building it would refuse, found before the run (``mtflow validate`` said OK to a
        ``respond`` that does not resolve, and to a script file that is not there)."""
        respond = options.get('respond')
        if isinstance(respond, str):
            try:
                resolve_reference(respond)
            except (ImportError, AttributeError, ValueError) as exc:
                return [PreflightProblem(f'respond: {exc}', key='backend_options.respond')]
        elif respond is None and options.get('outputs') is None and isinstance(model, str) and model and \
                not Path(model).is_file() and Path(model).suffix in ('.jsonl', '.json'):
            return [PreflightProblem(f'file not found: {model}', key='model')]
        return []

    def __init__(self, path: Optional[Union[str, Path]] = None, *, outputs: Optional[List[Any]] = None,
                 respond: Union[str, Callable[[Any], Any], None] = None, cycle: bool = False, honor_max_tokens: bool = False,
                 tokenizer: Any = None, chat_template: Optional[str] = None, sample: bool = False,
                 seed: Optional[int] = None, prefix_policy: str = 'exact') -> None:
        super().__init__()
        self.honor_max_tokens = honor_max_tokens
        self.sample, self.seed = bool(sample), seed
        if isinstance(respond, str):  # a run config's 'module:function' (found in the current directory too)
            try:
                respond = resolve_reference(respond)
            except (ImportError, AttributeError) as exc:
                raise BackendError(f'scripted backend: respond: {exc}') from None
        if respond is not None and not callable(respond):
            raise BackendError(f'scripted backend: respond must be a function of the request (or a '
                               f"'module:function' reference), got {type(respond).__name__}")
        #: ``respond(request) -> text or line``: each output computed from its request instead of read
        self.respond = respond
        if respond is not None:
            if path is not None or outputs is not None:
                raise BackendError('scripted backend: give one of path=, outputs= or respond=')
            outputs = ['']  # never served: respond answers
        template = resolve_chat_template(chat_template, where='scripted backend: chat_template')
        if template.text is not None and tokenizer is None:
            raise BackendError(f'scripted backend: chat_template ({template.describe()}) renders exact-id prompts '
                               'with a tokenizer: give tokenizer= too, or it would be ignored')
        if isinstance(tokenizer, str):
            tokenizer = load_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        #: exact-id prompts and token records (``None``: no tokenizer given, outputs only)
        self.prompter = TokenPrompter(tokenizer, template, policy=prefix_policy) if tokenizer is not None else None
        if self.prompter is not None:  # context budgets count exactly (without a tokenizer: count_tokens: words)
            self.count_prompt_tokens = self._count_prompt_tokens
        if (path is None) == (outputs is None):
            raise BackendError('scripted backend: give exactly one of path= (a JSONL file) or outputs=')
        if path is not None:
            lines = read_script(path)
            self.model_name = f'scripted:{Path(path).name}'
        else:
            lines = [{'content': o} if isinstance(o, str) else dict(o) for o in outputs or []]
            self.model_name = 'scripted'
        if not lines:
            raise BackendError(f'scripted backend: no outputs in {path or "outputs"}')
        self.cycle = cycle
        self._keyed: Dict[Tuple[str, int], Line] = {}
        self._by_uuid: Dict[str, Deque[Line]] = defaultdict(deque)
        #: the uuid-keyed lines as written, for the copies of a prompt (served by position)
        self._by_prompt: Dict[str, List[Line]] = defaultdict(list)
        self._copy_pos: Dict[str, int] = defaultdict(int)
        self._free: List[Line] = []
        for line in lines:
            uuid, turn = line.get('uuid'), line.get('turn')
            if uuid is not None and turn is not None:
                self._keyed[(str(uuid), int(turn))] = line
            elif uuid is not None:
                self._by_uuid[str(uuid)].append(line)
                self._by_prompt[str(uuid)].append(line)
            else:
                self._free.append(line)
        self._next = 0
        self._calls: Dict[str, int] = defaultdict(int)
        self._parent: Dict[str, str] = {}  # a fork's child -> its parent (fork)
        #: an async run calls a sync backend from several threads: the counters move together
        self._lock = threading.Lock()

    def fork(self, parent: str, children: List[str]) -> None:
        """Request ``parent`` was forked: each child starts with its turn count and place."""
        with self._lock:
            for child in children:
                self._calls[str(child)] = self._calls[str(parent)]
                self._copy_pos[str(child)] = self._calls[str(parent)]
                self._parent[str(child)] = str(parent)

    def forget(self, uuid: str) -> None:
        """Request ``uuid`` is final (delivered, written): drop its call count and copy position,
        so that memory does not grow with the number of requests served. Its uuid-keyed lines
        already served stay served (they are the script's, not per-request state)."""
        with self._lock:
            self._calls.pop(str(uuid), None)
            self._copy_pos.pop(str(uuid), None)
            self._parent.pop(str(uuid), None)
        if self.prompter is not None:
            self.prompter.forget(uuid)

    def _line_for(self, request: Any, seed: Optional[int] = None) -> Line:
        if self.respond is not None:
            line = self.respond(request)
            line = {'content': line} if isinstance(line, str) else dict(line)
            if not isinstance(line.get('content'), str):
                raise BackendError(f'scripted backend: respond() gave no "content" text for request '
                                   f'{getattr(request, "uuid", None)!r}')
            return line
        uuid = str(getattr(request, 'uuid', None))
        self._calls[uuid] += 1
        turn = self._calls[uuid]
        line = self._keyed.get((uuid, turn))
        if line is not None:
            return line
        queue = self._by_uuid.get(uuid)
        if queue:
            return queue.popleft()
        ancestor = self._parent.get(uuid)
        while ancestor is not None:  # a fork's child: its ancestors' lines for this turn
            line = self._keyed.get((ancestor, turn))
            if line is not None:
                return line
            ancestor = self._parent.get(ancestor)
        prompt = group_of(uuid, getattr(request, 'data_dict', None))
        if prompt != uuid:  # a copy made by num_generations: the prompt's own lines
            line = self._keyed.get((prompt, turn))
            if line is not None:
                return line
            lines = self._by_prompt.get(prompt)
            if lines and self._copy_pos[uuid] < len(lines):
                self._copy_pos[uuid] += 1
                return lines[self._copy_pos[uuid] - 1]
        if self.sample and self._free:
            draw = random.Random(seed).randrange if seed is not None else random.randrange
            return self._free[draw(len(self._free))]
        if self._next >= len(self._free):
            if not self.cycle or not self._free:
                raise BackendError(f'scripted backend ran out of outputs at request {uuid!r}, turn {turn} '
                                   f'({len(self._free)} unkeyed line(s) used; set cycle: true to repeat them)')
            self._next = 0
        line = self._free[self._next]
        self._next += 1
        return line

    def generate(self, requests: List[Any], options: SamplingOptions) -> List[Any]:
        outputs = []
        prompter = self.prompter
        plans = [prompter.plan(r) for r in requests] if prompter is not None else None
        seeds = sampling_seeds(requests, options, self.seed) if self.sample else [None] * len(requests)
        for k, (request, seed) in enumerate(zip(requests, seeds)):
            with self._lock:
                line = self._line_for(request, seed)
            if prompter is not None and line.get('token_ids') is None:
                line = self._tokenized(line)
            if self.honor_max_tokens:
                line = _cut(line, options.max_tokens, request)
            sink = self.text_sinks.get(request)
            if sink is not None:
                self.stream_text(request, line['content'], line.get('tokens'), sink)
            lps = line.get('logprobs') if options.logprobs else None
            prompt = plans[k].ids if plans is not None else None
            outputs.append(
                build_output(
                    line['content'],
                    line.get('token_ids'),
                    line.get('finish_reason', 'stop'),
                    logprobs=lps,
                    tokens=line.get('tokens') if lps is not None else None,
                    model=self.model_name,
                    prompt_tokens=len(prompt) if prompt is not None else 0,
                    prompt_token_ids=list(prompt) if prompt is not None else None))
        if plans is not None:
            commit_outputs(prompter, requests, plans, outputs)
        return outputs

    def stream_text(self, request: Any, text: str, tokens: Optional[List[str]], sink: Any) -> None:
        """Give ``sink`` the text as a model streams it, growing a token at a time (the line's
        token strings where they spell the text, else word by word); a test overrides it to
        generate slowly."""
        if tokens and ''.join(tokens).startswith(text):
            cuts, at = [], 0
            for token in tokens:
                at = min(len(text), at + len(token))
                cuts.append(at)
        else:
            cuts = [m.end() for m in re.finditer(r'\S+\s*', text)] or [len(text)]
        for cut in dict.fromkeys(cuts):
            sink(text[:cut])

    def _tokenized(self, line: Line) -> Line:
        """A line without ``token_ids`` under a tokenizer: its text's ids and the EOS, as a model
        that wrote it and stopped would have sampled (a logprob of 0 each unless it has its own)."""
        tok = self.tokenizer
        ids = self.prompter.encode(line['content'])
        if line.get('finish_reason', 'stop') == 'stop' and tok.eos_token_id is not None:
            ids.append(int(tok.eos_token_id))
        tokens = tok.batch_decode([[i] for i in ids])
        return dict(line, token_ids=ids, tokens=tokens)

    def keep_special_tokens(self) -> Optional[str]:
        """Nothing to do: a line's text is served as written, special tokens and all."""
        return None

    def _count_prompt_tokens(self, request: Any) -> int:
        """The exact length of the prompt ``request``'s next turn would send (context budgets)."""
        return len(self.prompter.plan(request).ids)


def _cut(line: Line, max_tokens: int, request: Any) -> Line:
    """``line`` cut to ``max_tokens`` ids (see the module docstring); unchanged when it fits."""
    ids = line.get('token_ids')
    if ids is None or len(ids) <= max_tokens:
        return line
    cut = dict(line, token_ids=ids[:max_tokens], finish_reason='length')
    if line.get('logprobs') is not None:
        cut['logprobs'] = line['logprobs'][:max_tokens]
    tokens, words = line.get('tokens'), line['content'].split(' ')
    if tokens is not None:
        cut['tokens'] = tokens[:max_tokens]
        cut['content'] = ''.join(tokens[:max_tokens])
    elif len(words) == len(ids):
        cut['content'] = ' '.join(words[:max_tokens])
    else:
        raise BackendError(f'scripted backend: {line.get("_where", "a line")} for request '
                           f'{getattr(request, "uuid", None)!r} has {len(ids)} ids over max_tokens={max_tokens} '
                           f'and neither token strings nor one word per id, so its text cannot be cut')
    return cut
