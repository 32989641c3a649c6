"""Token conformance: run multi-turn conversations through a backend and check that every turn
was generated from the exact ids of the turns before it.

``mtflow check-tokens`` and the pytest plugin's ``mtflow_check_tokens`` fixture run
:func:`check_tokens`. Each scenario (:data:`SCENARIOS`: tool calls, thinking blocks, unicode,
whitespace edges, truncated replies, continuation turns) is one request driven by the executor
through the backend; every turn's prompt, sampled ids, logprobs and record entry are captured and
checked:

=================  ===============================================================================
check              holds when
=================  ===============================================================================
template           the template renders every part of a tool-use conversation and opens the
                   model's turn (:func:`mtflow.backends.chat_templates.template_problems`, what
                   ``mtflow run`` and ``mtflow validate`` check)
prefix             the next prompt is the previous prompt + the sampled ids + the recorded delta
                   (or, for a turn the policy rendered from text, that text's ids, recorded so)
lengths            per turn, as many logprobs as sampled ids; in the output, ids and mask segments
                   of equal lengths, logprobs covering exactly the mask's 1s, and turn-1 prompt +
                   the segments and the glue between them equal to the last prompt + the last
                   sampled ids
special tokens     outside the sampled ids, the prompt has the special tokens the template puts
                   there, in the same order (the model's own EOS standing for the template's)
think policy       turns the template renders differently from what the model saw (it strips
                   ``<think>``) are detected, and handled as the policy says: ``exact`` keeps the
                   ids, ``rerender`` renders the text and records that the prompt does not extend
=================  ===============================================================================

A check with nothing to check for a template is ``n/a``; a run that fails to produce any turn
transition fails (the check fails closed). Templates may be bundled ones (:data:`BUNDLED`, in
``mtflow/data/templates``), a path to a Jinja file, or ``None`` (the tokenizer's own).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from mtflow.accounting.segments_split import SEGMENTS_KEY, segments_of
from mtflow.accounting.token_record import RecordAccounting, record_accounting, record_of
from mtflow.backends.base import prepare_chat
from mtflow.backends.chat_templates import (BUNDLED, TemplateSource, bundled_template, resolve_chat_template,
                                           template_problems)
from mtflow.backends.tokens import render_text
from mtflow.core.images import ImageError, to_image_url
from mtflow.core.protocol import RequestConfig, RolloutInferRequest, extract_logprobs
from mtflow.core.scheduler import Scheduler
from mtflow.engine.executor import Executor

__all__ = ['BUNDLED', 'SCENARIOS', 'CHECKS', 'Scenario', 'TemplateReport', 'bundled_template', 'check_tokens',
           'format_report', 'resolve_template']

CHECKS = ('template', 'prefix', 'lengths', 'special tokens', 'think policy', 'segments', 'images')
TOOLS = [{'type': 'function', 'function': {'name': 'calculator', 'description': 'evaluate an expression',
                                           'parameters': {'type': 'object', 'properties': {
                                               'expression': {'type': 'string'}}}}}]


def resolve_template(spec: Optional[str]) -> tuple:
    """``(name, template text or None)`` for a bundled name, a Jinja file, or ``None``/``'model'``
    (:func:`~mtflow.backends.chat_templates.resolve_chat_template`, as a backend's option)."""
    source = resolve_chat_template(spec, where='--template')
    return ('model' if source.text is None else Path(source.name).name if source.origin == 'a template file'
            else source.name), source.text


@dataclass
class Scenario:
    """One conversation: the turn-1 messages, then what follows each model turn: a list of
    messages to append, or ``{'continue': text}`` (the model continues its message, after
    ``text`` is appended to it)."""
    name: str
    messages: List[Dict[str, Any]]
    follow: List[Any]
    max_tokens: int = 10
    tools: Optional[List[Dict[str, Any]]] = None
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)


SCENARIOS: List[Scenario] = [
    Scenario('tool call', [{'role': 'system', 'content': 'You can call tools.'},
                           {'role': 'user', 'content': 'What is 2 + 3 * 4? Use the calculator.'}],
             [[{'role': 'tool', 'content': '{"result": 14}'}], [{'role': 'user', 'content': 'And times 2?'}]],
             tools=TOOLS),
    Scenario('thinking', [{'role': 'user', 'content': 'Is 91 prime? Think first.'},
                          {'role': 'assistant', 'content': '<think>\n91 = 7 * 13.\n</think>\n'}],
             [[{'role': 'user', 'content': 'Are you sure?'}], [{'role': 'user', 'content': 'Why?'}]]),
    Scenario('unicode', [{'role': 'user', 'content': 'Écris « ça » en 日本語 🙂, s’il te plaît.'}],
             [[{'role': 'user', 'content': 'Ünïcödé again: ñ, ß, 東京, 🚀.'}], [{'role': 'user', 'content': '€?'}]]),
    Scenario('whitespace', [{'role': 'user', 'content': '  leading and trailing  \n\n'}],
             [[{'role': 'user', 'content': '\ttabs\t\n'}], [{'role': 'user', 'content': ' '}]]),
    Scenario('truncated', [{'role': 'user', 'content': 'Write a long story about a fox.'}],
             [[{'role': 'user', 'content': 'Go on.'}], [{'role': 'user', 'content': 'More.'}]], max_tokens=3),
    Scenario('continuation', [{'role': 'user', 'content': 'Count to ten.'}],
             [{'continue': ''}, {'continue': ' and then'}, [{'role': 'user', 'content': 'Thanks!'}]], max_tokens=4),
]


class _ScenarioScheduler(Scheduler):
    """Follows each request's scenario; stops after its last follow-up has been answered."""

    def __init__(self, scenarios: Dict[str, Scenario]) -> None:
        super().__init__()
        self.scenarios = scenarios

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        return current_turn > len(self.scenarios[infer_request.uuid].follow)

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        follow = self.scenarios[infer_request.uuid].follow[current_turn - 1]
        if isinstance(follow, dict):
            infer_request.messages[-1]['content'] += follow['continue']
        else:
            infer_request.messages.extend(copy.deepcopy(follow))
        return {'infer_request': infer_request}


@dataclass
class _Turn:
    chat: Any  # the request as the backend saw it (mtflow.backends.base.Chat)
    prompt: List[int]
    sampled: List[int]
    logprobs: List[float]
    finish_reason: Optional[str]
    entry: Any  # the record's TokenTurn
    images: List[str] = field(default_factory=list)  # the sha256 of each image the turn showed, in order


class _Probe:
    """Wraps the backend: captures what each turn was given and produced."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.turns: Dict[str, List[_Turn]] = {}

    def __call__(self, requests: List[Any], request_config: Any = None) -> List[Any]:
        snapshots = [copy.deepcopy(prepare_chat(r)) for r in requests]
        shown = [[_sha256(im) for im in getattr(r, 'images', None) or ()] for r in requests]
        outputs = self.backend(requests, request_config)
        for request, chat, out, images in zip(requests, snapshots, outputs, shown):
            choice = out.response.choices[0]
            rec = record_of(request)
            turns = self.turns.setdefault(request.uuid, [])
            turns.append(
                _Turn(chat, list(out.response.prompt_token_ids or []), list(choice.token_ids or []),
                      extract_logprobs(choice), choice.finish_reason, rec.turns[-1] if rec else None, images))
            if rec is not None and len(turns) > 1 and len(rec.turns) > 1 and rec.turns[-1].extends:
                turns[-2].entry = rec.turns[-2]  # the new record holds the previous turn's appended ids
        return outputs

    def fork(self, parent: str, children: List[str]) -> None:
        """``parent`` was forked (``docs/branching.md``): each child's turns start with copies of
        the parent's, so every leaf is checked from its first turn."""
        for child in children:
            self.turns[child] = [dataclasses.replace(t) for t in self.turns.get(parent, [])]


@dataclass
class TemplateReport:
    """The result of the checks for one template: per check, passes, failures and what failed."""
    template: str
    policy: str
    passed: Dict[str, int] = field(default_factory=lambda: {c: 0 for c in CHECKS})
    failed: Dict[str, int] = field(default_factory=lambda: {c: 0 for c in CHECKS})
    problems: List[str] = field(default_factory=list)
    transitions: int = 0
    unstable_turns: int = 0
    rerender_drift: int = 0

    def add(self, check: str, ok: bool, problem: str = '') -> None:
        if ok:
            self.passed[check] += 1
        else:
            self.failed[check] += 1
            self.problems.append(f'{check}: {problem}')

    @property
    def ok(self) -> bool:
        return self.transitions > 0 and not any(self.failed.values())


def _specials_outside(prompt: List[int], sampled_spans: List[tuple], special: frozenset,
                      keep: frozenset) -> List[int]:
    inside = set()
    for start, end, last_keep in sampled_spans:
        inside.update(range(start, end - 1 if last_keep else end))
    return [t for i, t in enumerate(prompt) if t in special and (i not in inside or t in keep)]


def check_tokens(backend: Any, *, template: Optional[str] = None, template_name: Optional[str] = None,
                 scenarios: Sequence[Scenario] = SCENARIOS, temperature: float = 1.0, seed: int = 0,
                 scheduler: Any = None, requests: Optional[List[Any]] = None, max_turns: int = 4,
                 context: Any = None) -> TemplateReport:
    """Run ``scenarios`` (or ``requests`` under ``scheduler``) through ``backend`` with chat
    template ``template`` (``None``: the backend's) and check every turn transition; ``context``
    (a :class:`mtflow.ContextBudget`, with ``scheduler``) compacts the conversations, and every
    training segment is checked too (``docs/context.md``)."""
    prompter = getattr(backend, 'prompter', None)
    if prompter is None:
        raise TypeError(f'{type(backend).__name__} keeps no token record (no prompter); '
                        'check-tokens needs the hf or vllm backend, or the openai backend in token mode')
    old_template = prompter.chat_template
    if template is not None:
        prompter.chat_template = template
    report = TemplateReport(template_name or ('model' if template is None else 'custom'), prompter.policy)
    tok = prompter.tokenizer
    _probe_template(report, prompter, template, scheduler)
    special = frozenset(int(i) for i in getattr(tok, 'all_special_ids', ()) or ())
    if context is not None and context.count_tokens is None:  # the probe hides the backend's own counter
        context = dataclasses.replace(context, count_tokens=backend.count_prompt_tokens,
                                      context_length=context.context_length or backend.context_length)
    try:
        probe = _Probe(backend)
        if scheduler is None:
            by_uuid = {f'{s.name}#{k}': s for k, s in enumerate(scenarios)}
            requests = [
                RolloutInferRequest(messages=copy.deepcopy(s.messages), uuid=u, tools=s.tools,
                                    chat_template_kwargs=dict(s.chat_template_kwargs)) for u, s in by_uuid.items()
            ]
            groups = {}
            for req in requests:  # one run per max_tokens (the request config is per call)
                groups.setdefault(by_uuid[req.uuid].max_tokens, []).append(req)
            outputs = {}
            for max_tokens, group in groups.items():
                result = Executor(_ScenarioScheduler(by_uuid), probe,
                                  RequestConfig(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                                logprobs=True), accounting=RecordAccounting(),
                                  max_turns=1 + max(len(by_uuid[r.uuid].follow) for r in group),  # each ends itself
                                  on_error='return').run(group)
                _collect_failures(report, result)
                outputs.update({r.uuid: o for r, o in zip(group, result.outputs)})
        else:
            run = list(requests or [])  # a branched scheduler's children are appended to it
            result = Executor(scheduler, probe, RequestConfig(max_tokens=16, temperature=temperature, seed=seed,
                                                              logprobs=True),
                              accounting=record_accounting(scheduler), max_turns=max_turns,
                              on_error='return', context=context).run(run)
            _collect_failures(report, result)
            outputs = {r.uuid: o for r, o in zip(run, result.outputs)}
        strips = _template_strips_think(tok, prompter.chat_template)
        for uuid, turns in probe.turns.items():
            _check_request(report, prompter, tok, special, uuid, turns, outputs.get(uuid),
                           expect_unstable=strips and uuid.startswith('thinking'))
    finally:
        prompter.chat_template = old_template
    if report.transitions == 0:
        report.problems.append('no turn transition was produced: nothing was checked')
    return report


def _probe_template(report: TemplateReport, prompter: Any, template: Optional[str], scheduler: Any) -> None:
    """The ``template`` check: the template shows the model every part of a tool-use conversation
    (what ``mtflow run`` and ``mtflow validate`` check; a YAML scheduler's text-parsed calls too)."""
    source = TemplateSource(template, report.template, 'check-tokens --template') if template is not None \
        else prompter.template_source
    refused = template_problems(prompter.tokenizer, source,
                                text_calls=bool(getattr(scheduler, 'writes_tool_messages', False)))
    for problem in refused:
        report.add('template', False, problem)
    if not refused:
        report.add('template', True)


def _collect_failures(report: TemplateReport, result: Any) -> None:
    for failure in result.failures:
        report.add('prefix', False, f'request {failure.uuid} failed at turn {failure.turn} ({failure.phase}): '
                                    f'{type(failure.error).__name__}: {failure.error}')


def _template_strips_think(tok: Any, template: Optional[str]) -> bool:
    messages = [{'role': 'user', 'content': 'q'}, {'role': 'assistant', 'content': '<think>\nhidden\n</think>\nshown'},
                {'role': 'user', 'content': 'q2'}]
    kwargs = {'chat_template': template} if template is not None else {}
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception:
        return False
    return 'hidden' not in text


def _check_request(report: TemplateReport, prompter: Any, tok: Any, special: frozenset, uuid: str,
                   turns: List[_Turn], output: Any, expect_unstable: bool) -> None:
    spans: List[tuple] = []
    eos = frozenset(i for i in (tok.eos_token_id, ) if i is not None)
    saw_unstable = False
    starts = _segment_starts(output)
    for t, turn in enumerate(turns):
        where = f'{uuid} turn {t + 1}'
        if t > 0 and t + 1 in starts:  # a compaction rewrote the messages: a new segment starts here
            spans = [(len(turn.prompt), len(turn.prompt) + len(turn.sampled), turn.finish_reason == 'stop')]
            continue
        report.add('lengths', len(turn.logprobs) == len(turn.sampled),
                   f'{where}: {len(turn.logprobs)} logprobs for {len(turn.sampled)} sampled ids')
        entry = turn.entry
        if t == 0:
            spans = [(len(turn.prompt), len(turn.prompt) + len(turn.sampled), turn.finish_reason == 'stop')]
            continue
        report.transitions += 1
        prev = turns[t - 1]
        if prev.images or turn.images:  # the ids keep the earlier images' pads: the pixels must be the same too
            report.add('images', turn.images[:len(prev.images)] == prev.images,
                       f'{where}: the images of turn {t} changed (turn {t} showed {_short(prev.images)}; turn '
                       f'{t + 1} shows {_short(turn.images[:len(prev.images)])} in their place): an earlier image '
                       'must stay as the model saw it')
        rendered = prompter.encode(render_text(tok, turn.chat, None, prompter.chat_template))
        if rendered[:len(prev.prompt) + len(prev.sampled)] != prev.prompt + prev.sampled:
            report.rerender_drift += 1
        stable = entry is None or entry.template_stable
        if not stable:
            saw_unstable = True
            report.unstable_turns += 1
        if entry is not None and not entry.extends:
            by_policy = entry.rendered == 'template_rewrites_history'
            report.add('prefix', by_policy and turn.prompt == rendered,
                       f'{where}: the prompt does not extend the previous prompt + sampled ids '
                       f'(rendered from text: {entry.rendered})')
            if by_policy:
                report.add('think policy', prompter.policy == 'rerender',
                           f'{where}: re-rendered under policy {prompter.policy!r}')
            spans = [(len(turn.prompt), len(turn.prompt) + len(turn.sampled), turn.finish_reason == 'stop')]
            continue
        appended = prev.entry.appended if prev.entry is not None else []
        want = prev.prompt + prev.sampled + appended
        report.add('prefix', turn.prompt == want,
                   f'{where}: the prompt is not the previous prompt + sampled ids + delta '
                   f'(first difference at {_first_diff(turn.prompt, want)})')
        if not stable:
            report.add('think policy', prompter.policy == 'exact',
                       f'{where}: the template rewrote the history and the ids were kept under {prompter.policy!r}')
        if stable:
            got = _specials_outside(turn.prompt, spans, special, eos)
            exp = [i for i in rendered if i in special]
            report.add('special tokens', got == exp,
                       f'{where}: special tokens {tok.convert_ids_to_tokens(got)} where the template has '
                       f'{tok.convert_ids_to_tokens(exp)}')
        spans.append((len(turn.prompt), len(turn.prompt) + len(turn.sampled), turn.finish_reason == 'stop'))
    if expect_unstable:
        report.add('think policy', saw_unstable, f'{uuid}: the template strips <think> but no turn was detected')
    if output is not None and turns:
        _check_output(report, uuid, turns[-1], output)
        if starts:
            _check_segments(report, uuid, turns, output)


def _sha256(image: Any) -> str:
    """The content hash of an image a turn showed (``'?'`` when it cannot be read: the backend says why)."""
    try:
        return to_image_url(image).sha256
    except ImageError:
        return '?'


def _short(hashes: List[str]) -> str:
    return ', '.join(f'sha256 {h[:12]}' for h in hashes) or 'none'


def _segment_starts(output: Any) -> frozenset:
    """The first turn of every training segment after the first (none when nothing compacted)."""
    infos = getattr(output, 'rollout_infos', None) or {}
    if not infos.get(SEGMENTS_KEY):
        return frozenset()
    return frozenset(s['turns'][0] for s in segments_of(output)[1:])


def _check_segments(report: TemplateReport, uuid: str, turns: List[_Turn], output: Any) -> None:
    """Each training segment of a compacted trajectory is exact: ``prompt_ids`` + its ids and
    glue are the prompt of its last turn + that turn's sampled ids, every turn's prompt is a
    prefix of it, and its mask-1 ids are exactly the ids sampled in its turns."""
    for seg in segments_of(output):
        first, last = seg['turns']
        where = f'{uuid} segment {seg["segment"]} (turns {first}-{last})'
        if not seg.get('exact') or seg.get('prompt_ids') is None:
            report.add('segments', False, f'{where}: not kept from the token record')
            continue
        flat, mask = list(seg['prompt_ids']), [0] * len(seg['prompt_ids'])
        glue = seg.get('glue_ids') or []
        for k, (ids, m) in enumerate(zip(seg['response_token_ids'], seg['response_loss_mask'])):
            flat += ids
            mask += m
            if k < len(glue):
                flat += glue[k]
                mask += [0] * len(glue[k])
        mine = turns[first - 1:last]
        ok = bool(mine) and flat == mine[-1].prompt + mine[-1].sampled
        ok = ok and all(flat[:len(t.prompt)] == t.prompt for t in mine)
        ok = ok and [i for i, b in zip(flat, mask) if b] == [i for t in mine for i in t.sampled]
        report.add('segments', ok, f'{where}: its ids are not the prompt + the ids sampled in its turns')


def _check_output(report: TemplateReport, uuid: str, last: _Turn, output: Any) -> None:
    """The request's output: ids and mask segments of equal lengths, logprobs covering the mask's
    1s, and (for an exact record) turn-1 prompt + segments + glue equal to the last prompt + the
    last sampled ids."""
    ids, mask, lps = output.response_token_ids, output.response_loss_mask, output.rollout_logprobs
    ok = len(ids) == len(mask) and all(len(a) == len(b) for a, b in zip(ids, mask))
    ok = ok and (not lps or sum(map(len, lps)) == sum(map(sum, mask)))
    rec_info = (output.rollout_infos or {}).get('token_record')
    if rec_info is not None and rec_info.get('exact'):
        flat = list(rec_info['prompt_ids'])
        for k, seg in enumerate(ids):
            flat += seg + (rec_info['glue_ids'][k] if k < len(rec_info['glue_ids']) else [])
        ok = ok and flat == last.prompt + last.sampled
    report.add('lengths', ok, f'{uuid}: the output ids/mask/logprobs do not line up with the record')


def _first_diff(a: List[int], b: List[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f'position {i}: {x} != {y}'
    return f'lengths {len(a)} != {len(b)}'


def format_report(report: TemplateReport) -> Any:
    """A rich table of the checks for one template."""
    from rich.table import Table

    table = Table(title=f'template {report.template} (policy {report.policy})',
                  caption=f'{report.transitions} transitions; {report.unstable_turns} template-unstable; '
                  f're-rendering would drift at {report.rerender_drift}')
    table.add_column('check')
    table.add_column('passed', justify='right')
    table.add_column('failed', justify='right')
    table.add_column('result')
    for check in CHECKS:
        p, f = report.passed[check], report.failed[check]
        result = 'FAIL' if f else ('n/a' if not p else 'ok')
        table.add_row(check, str(p), str(f), result)
    return table
