"""What ``summary.json`` holds and the table ``mtflow run`` prints at its end: the requests on
disk (every attempt, from the run store's tally: finish reasons, turns, tool calls and errors,
rewards and the per-group reward spread, generated tokens) and this attempt's timings. The same
for a local run and a Ray fan-out (whose backend is a stand-in that reports the actors' figures).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple


from mtflow.backends.base import reports_of
from mtflow.run.config import RunConfig
from mtflow.run.engine_figures import engine_rows, engine_settings, prefix_cache_figures
from mtflow.run.reward_spread import spread_rows
from mtflow.run.serving import admission_figures, admission_rows, serving_figures, serving_rows
from mtflow.run.store import RunStore
from mtflow.run.trees import prompts_of, short_trees

__all__ = ['summarize', 'print_summary', 'FAILED_REASONS', 'too_many_failed', 'failed_unwritten']

#: the finish reasons of a request that failed (a step or hook raised, a deadline passed)
FAILED_REASONS = ('error', 'timeout')


def _what_rolls_out(cfg: Any) -> Optional[str]:
    """The scheduler, or an ``agent:`` run's command (``None`` for a gateway's own sessions)."""
    if cfg is None:
        return None
    agent = getattr(cfg, 'agent', None)
    if cfg.scheduler is None and agent is not None:
        command = agent.command if isinstance(agent.command, str) else ' '.join(agent.command)
        return f'agent: {command}'
    return cfg.scheduler


def summarize(cfg: Optional[RunConfig], backend: Any, store: RunStore, total: int, figures: Dict[str, Any],
              load_s: float) -> Dict[str, Any]:
    """The figures of ``summary.json``: the requests on disk (every attempt, from the store's
    tally) and this attempt's timings."""
    tally = store.tally
    reports = reports_of(backend)
    stats = reports.stats
    gen_s = stats.generate_s if stats is not None else None
    attempt_tokens = stats.completion_tokens if stats is not None else None
    wall_s = figures.get('wall_s') or 0.0
    tool_calls, tool_errors = tally.tool_calls()
    load_info = reports.load_info or {}
    done = len(store.done)
    trees = _trees(store)
    return {
        'config': cfg.source if cfg is not None else None,
        'backend': reports.describe() or getattr(cfg, 'backend', None),
        'scheduler': _what_rolls_out(cfg),
        'requests': total,
        'written': done,
        'interrupted': store.interrupted,
        'remaining': max(total - trees.get('prompts_written', done), 0),
        **trees,
        'finish_reasons': dict(tally.reasons.most_common()),
        'errors': tally.errors,
        'turns': tally.turns_summary(),
        'rollout_fn_calls': figures.get('rollout_fn_calls', 0),
        'tool_calls': tool_calls,
        'tool_errors': tool_errors,
        'tool_error_kinds': tally.tool_error_kinds(),
        'tool_outputs_cut': tally.outputs_cut,
        'tool_calls_printed': tally.calls_printed,
        'reward_mean': tally.reward_mean(),
        'reward_failed_left_out': tally.reward_failed,
        'reward_groups': tally.reward_groups(),
        'generated_tokens': tally.trace_tokens,
        'generate_s': round(gen_s, 3) if gen_s is not None else None,
        'wall_s': round(wall_s, 3),
        'tokens_per_s': round((attempt_tokens if attempt_tokens is not None else tally.trace_tokens) / wall_s, 1)
        if wall_s > 0 else None,
        'model_load_s': round(load_s, 3),
        'model_cached': load_info.get('cached'),
        'attempts': len(store.info.get('attempts') or []),
        'resumed_from': store.info['attempts'][-1].get('done_at_start', 0) if store.resumed else None,
        'write_s': figures.get('write_s'),
        'failures': tally.failures,
        'finish_policy': tally.policy.summary(),
        'serving': serving_figures(backend),
        **({'engine': engine_settings(backend)} if engine_settings(backend) else {}),
        **({'prefix_cache': prefix_cache_figures(backend)} if prefix_cache_figures(backend) else {}),
        **({'admission': admission_figures(figures['admission'], serving_figures(backend))}
           if figures.get('admission') is not None else {}),
        **({'context': tally.context_summary()} if tally.context_summary() else {}),
    }


def _trees(store: RunStore) -> Dict[str, Any]:
    """A branched run's counts (``docs/branching.md``): the prompts whose trees are on disk (its
    ``written`` counts leaves) and the trees short of their leaves (``mtflow/run/trees.py``)."""
    if not store.branched:
        return {}
    return {'prompts_written': len(prompts_of(store.done)),
            'trees_short': [tree.to_dict() for tree in short_trees(store.out_dir, store.done)]}


def _request_rows(summary: Dict[str, Any]) -> List[Tuple[str, str]]:
    """The ``requests`` row (a branched run's lines are leaves, its requests prompts) and, for a
    branched run, its trees short of their leaves."""
    requests = str(summary['requests'])
    branched = 'prompts_written' in summary
    if summary['written'] != summary['requests'] or summary['resumed_from']:
        requests += (f" prompts ({summary['prompts_written']} written, {summary['written']} leaves" if branched
                     else f" ({summary['written']} written")
        requests += f", {summary['resumed_from']} by earlier attempts" if summary['resumed_from'] else ''
        requests += f", {summary['interrupted']} interrupted" if summary['interrupted'] else ''
        requests += ')'
    rows = [('requests', requests)]
    short = summary.get('trees_short') or []
    if short:
        rows.append(('trees short', f'[red]{len(short)}[/red]: ' + ', '.join(t['root'] for t in short[:5])
                     + (' ...' if len(short) > 5 else '') + ' (trees_short in summary.json)'))
    return rows


def _tool_rows(summary: Dict[str, Any]) -> List[Tuple[str, str]]:
    """Tool calls and errors, the errors by kind, the observations cut and the calls that printed."""
    rows = [('tool calls / errors', f"{summary['tool_calls']} / {summary['tool_errors']}")]
    if summary.get('tool_error_kinds'):
        rows.append(('tool error kinds', ', '.join(f'{k} {v}' for k, v in summary['tool_error_kinds'].items())))
    if summary.get('tool_outputs_cut') or summary.get('tool_calls_printed'):
        rows.append(('tool outputs', f"{summary.get('tool_outputs_cut', 0)} cut to max_observation, "
                     f"{summary.get('tool_calls_printed', 0)} calls printed (kept in trace.jsonl)"))
    return rows


def print_summary(summary: Dict[str, Any], out_dir: Path) -> None:
    """The table ``mtflow run`` prints at the end, from the figures of :func:`summarize`."""
    from rich.console import Console  # rich only where a table is printed (``-q`` prints none)
    from rich.table import Table

    table = Table(title='mtflow run', show_header=False, title_justify='left')
    table.add_column('', style='bold')
    table.add_column('')
    reasons = ', '.join(f'{k} {v}' for k, v in summary['finish_reasons'].items())
    t = summary['turns']
    hist = '  '.join(f'{k}:{v}' for k, v in t['histogram'].items())
    status = summary.get('status', 'complete')
    table.add_row('backend', summary['backend'])
    table.add_row('scheduler', str(summary['scheduler']))
    table.add_row('status', status if status == 'complete' else f'[yellow]{status}[/yellow]')
    for label, text in _request_rows(summary):
        table.add_row(label, text)
    table.add_row('finish reasons', reasons)
    table.add_row('turns per request', f"min {t['min']}  mean {t['mean']}  max {t['max']}")
    table.add_row('turns histogram', f'(turns:requests) {hist}')
    table.add_row('multi-turn requests', f"{t['multi_turn_requests']} of {summary['written']} went past turn 1")
    table.add_row('rollout_fn calls', str(summary['rollout_fn_calls']))
    for label, text in _tool_rows(summary):
        table.add_row(label, text)
    left_out = summary.get('reward_failed_left_out') or 0
    if summary['reward_mean'] is not None or left_out:
        table.add_row('mean reward', f"{summary['reward_mean']}" + (
            f' ({left_out} failed left out)' if left_out else ''))
    ctx = summary.get('context')
    if ctx:
        table.add_row('context', f"{ctx['compactions']} compactions in {ctx['compacted_requests']} requests "
                      f"(at most {ctx['max_per_request']}), context_full {ctx['context_full']}, "
                      f"length_total {ctx['length_total']}")
    if summary.get('finish_policy'):
        table.add_row('finish policy', ', '.join(f'{k} {v}' for k, v in summary['finish_policy'].items()))
    if summary.get('reward_groups'):
        for label, text in spread_rows(summary['reward_groups']):
            table.add_row(label, text)
    errors = summary['errors']
    table.add_row('request errors', f'[red]{errors}[/red]' if errors else '0')
    if failed_unwritten(summary):  # an agent: run's episodes that made no model call
        table.add_row('failed, nothing written', f'[red]{failed_unwritten(summary)}[/red] (failed_unwritten in '
                      'summary.json)')
    table.add_row('generated tokens', str(summary['generated_tokens']))
    tps = summary['tokens_per_s']
    table.add_row('tokens/s', f"{tps} (wall {summary['wall_s']} s"
                  + (f", generating {summary['generate_s']} s)" if summary['generate_s'] is not None else ')'))
    for label, text in serving_rows(summary.get('serving')):
        table.add_row(label, text)
    for label, text in engine_rows(summary.get('engine'), summary.get('prefix_cache')):
        table.add_row(label, text)
    for label, text in admission_rows(summary.get('admission')):
        table.add_row(label, text)
    cached = summary['model_cached']
    table.add_row('model load', f"{summary['model_load_s']} s" +
                  ('' if cached is None else ' (cached copy)' if cached else ' (converted, now cached)'))
    table.add_row('output', f'{out_dir}/trajectories.jsonl, trace.jsonl, summary.json')
    console = Console()
    console.print(table)
    for failure in summary['failures'][:3]:
        console.print(f"[red]error[/red] request {failure.get('uuid')} turn {failure.get('turn')} "
                      f"({failure.get('phase')}): {failure.get('type')}: {failure.get('message')}")


def failed_unwritten(summary: Dict[str, Any]) -> int:
    """Requests that failed with nothing to write (an ``agent:`` run's episodes whose agent made no
    model call: ``failed_unwritten`` in the summary)."""
    block = summary.get('failed_unwritten')
    return int(block.get('count') or 0) if isinstance(block, dict) else 0


def too_many_failed(summary: Dict[str, Any], max_failed_share: float) -> Optional[str]:
    """Why the run must exit non-zero, or ``None``: more of the requests failed than
    ``max_failed_share`` of them, or every one did. Failed: a written request whose finish reason
    is one of :data:`FAILED_REASONS`, and a request that produced nothing to write
    (:func:`failed_unwritten`), which counts among the requests too. A run whose reward function
    raises on every request, or whose agent never starts, is no training data."""
    written = summary.get('written') or 0
    reasons = summary.get('finish_reasons') or {}
    unwritten = failed_unwritten(summary)
    failed = sum(int(reasons.get(r, 0)) for r in FAILED_REASONS) + unwritten
    counted = written + unwritten
    if not counted or not failed or (failed <= max_failed_share * counted and failed < counted):
        return None
    kinds = ', '.join([f'{r} {reasons[r]}' for r in FAILED_REASONS if reasons.get(r)]
                      + ([f'{unwritten} produced nothing'] if unwritten else []))
    return (f'{failed} of {counted} requests failed ({kinds}), more than max_failed_share {max_failed_share:g}'
            if failed < counted or max_failed_share < 1 else f'all {counted} requests failed ({kinds})')
