"""``mtflow check-tokens RUN_DIR``: every training segment of a run directory, checked offline.

A run whose backend kept exact token records (HF, vLLM, OpenAI in token mode, scripted with a
tokenizer; ``mtflow gateway`` and ``mtflow run``) writes, per trajectory line, each segment's
``prompt_ids``, its ids, mask and logprobs, the glue between its assistant messages, and in
``turns`` each model call's sampled ids with the length and digest of the prompt it was generated
from. For every segment of every line (``mtflow.accounting.segments_split.segments_of``) this
checks, with no model:

=========  ======================================================================================
check      holds when
=========  ======================================================================================
exact      the segment was kept from the token record (``exact``, with its ``prompt_ids``)
lengths    ids and mask segments have equal lengths; the logprobs cover exactly the mask's 1s
sampled    the mask-1 ids are exactly the ids the model sampled in the segment's turns, in order
prompts    every turn's prompt is the segment's sequence up to that turn (same length and ids
           digest) and its sampled ids follow it there: each turn saw exactly the ids before it
=========  ======================================================================================

Lines of failed requests (reason ``error``, ``timeout``) are skipped (a failure keeps what it
had, not a finished record), and so are the roles of multi-agent episodes that are not trained
(``rollout_infos.episode.train`` false: a judge, a user simulator; ``docs/multi-agent.md``),
counted apart; a line without ``turns`` fails ``sampled``.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from mtflow.accounting.segments_split import flat_sample, segments_of
from mtflow.core.machine import reason_kind
from mtflow.run.trajectories import iter_trajectories
from mtflow.run.turn_log import expand_turns, ids_digest

__all__ = ['RunTokenReport', 'check_run_tokens', 'RUN_CHECKS']

RUN_CHECKS = ('exact', 'lengths', 'sampled', 'prompts')


@dataclass
class RunTokenReport:
    passed: Counter = field(default_factory=Counter)
    failed: Counter = field(default_factory=Counter)
    problems: List[str] = field(default_factory=list)
    lines: int = 0
    segments: int = 0
    skipped: int = 0
    #: lines of episode roles that are not trained (not checked)
    untrained: int = 0

    def add(self, check: str, ok: bool, problem: str) -> None:
        if ok:
            self.passed[check] += 1
        else:
            self.failed[check] += 1
            self.problems.append(problem)

    @property
    def ok(self) -> bool:
        return not self.failed and self.segments > 0


def check_run_tokens(trajectories: Path) -> RunTokenReport:
    """Check every segment of every line of a ``trajectories.jsonl`` (see the module docstring)."""
    report = RunTokenReport()
    for traj in iter_trajectories(trajectories):
        line = traj.to_dict()
        if reason_kind(line.get('finish_reason')) == 'error':
            report.skipped += 1
            continue
        episode = (line.get('rollout_infos') or {}).get('episode')
        if isinstance(episode, dict) and episode.get('train') is False:
            report.untrained += 1
            continue
        report.lines += 1
        turns = expand_turns(line)
        for seg in segments_of(line):
            report.segments += 1
            _check_segment(report, str(line['uuid']), seg, turns)
    if report.lines and not report.segments:
        report.problems.append('no segment was found: nothing was checked')
    return report


def _check_segment(report: RunTokenReport, uuid: str, seg: Dict[str, Any], turns: List[Dict[str, Any]]) -> None:
    first, last = seg['turns']
    where = f'{uuid} segment {seg["segment"]} (turns {first}-{last})'
    ids, mask = seg['response_token_ids'], seg['response_loss_mask']
    lps = seg.get('rollout_logprobs') or []
    lengths = len(ids) == len(mask) and all(len(a) == len(b) for a, b in zip(ids, mask))
    lengths = lengths and (not lps or sum(map(len, lps)) == sum(map(sum, mask)))
    report.add('lengths', lengths, f'{where}: ids, mask and logprobs do not line up')
    exact = bool(seg.get('exact')) and seg.get('prompt_ids') is not None
    report.add('exact', exact, f'{where}: not kept from the token record (exact: {seg.get("exact")})')
    if not exact or not lengths:
        return
    sample = flat_sample(seg)  # the sequence training builds: prompt, then replies with the glue between
    flat: List[int] = list(seg['prompt_ids']) + sample['response_ids']
    mine = [t for t in turns if first <= t['turn'] <= (last if last is not None else t['turn'])]
    sampled = [i for t in mine for i in (t.get('token_ids') or [])]
    trained = [i for i, b in zip(sample['response_ids'], sample['loss_mask']) if b]
    report.add('sampled', bool(mine) and trained == sampled,
               f'{where}: the trained ids are not the ids sampled in its turns' if mine else
               f'{where}: the line records no model call for these turns ("turns")')
    with_prompts = [t for t in mine if 'prompt_len' in t]
    if not with_prompts:
        return
    bad = _prompt_problem(flat, with_prompts)
    report.add('prompts', bad is None, f'{where}: {bad}')


def _prompt_problem(flat: List[int], turns: List[Dict[str, Any]]) -> Optional[str]:
    for t in turns:
        n, ids = t['prompt_len'], t.get('token_ids') or []
        if n > len(flat) or ids_digest(flat[:n]) != t['prompt_ids']:
            return f'turn {t["turn"]} was generated from a prompt that is not the segment up to it'
        if flat[n:n + len(ids)] != ids:
            return f'turn {t["turn"]}: its sampled ids do not follow its prompt in the segment'
    return None
