"""``mtflow rescore RUN_DIR --out NEW_DIR [--reward module:attr | CONFIG]``: new rewards, same episodes.

Recomputes the reward and the finish policy of every stored trajectory (``mtflow/run/rescore.py``)
without any model, tool or environment call, streaming, with a progress bar; the new directory's
``summary.json`` has the reward mean and the GRPO group spread of the new rewards. The reward is
``--reward``'s function, else the YAML scheduler's ``reward`` of CONFIG (default: the run's own
config); the finish policy is CONFIG's; the dataset (for ``data_dict``) is CONFIG's.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from mtflow.core.errors import UserError
from mtflow.core.registry import resolve_reference
from mtflow.core.signatures import call_problem
from mtflow.data.sources import iter_requests
from mtflow.declarative import load_scheduler
from mtflow.declarative.loader import ConfigError
from mtflow.declarative.schema import REWARD_ARGS
from mtflow.run.progress import ProgressBar
from mtflow.run.config import RunConfig, load_run_config
from mtflow.run.diff import trajectories_file
from mtflow.run.files import RUN_INFO, check_out_apart, recorded_config_file
from mtflow.run.rescore import Rescorer, count_lines


#: read the arguments intermixed (``mtflow/cli.py``): CONFIG may come after ``--out`` as the docs write it
INTERMIXED = True


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser('rescore', help='recompute rewards and the finish policy of a run, no model or tool call',
                       description='Recompute the rewards (and the finish policy) of a run directory into a new one.')
    p.add_argument('run_dir', help='the recorded run directory')
    p.add_argument('config', nargs='?', help="a run config whose scheduler's reward and finish_policy to use "
                   "(default: the run's own, from run.json)")
    p.add_argument('--out', required=True, help='the new run directory (missing or empty)')
    p.add_argument('--reward', metavar='MODULE:ATTR', help='the reward function reward(infer_request, infos) -> float '
                   "(default: CONFIG's scheduler's reward)")
    p.add_argument('-q', '--quiet', action='store_true', help='no progress bar and no summary line')
    p.set_defaults(func=main)


def _config(run_dir: Path, config: Optional[str]) -> RunConfig:
    if config is None:
        try:
            config = recorded_config_file(run_dir, json.loads((run_dir / RUN_INFO).read_text(encoding='utf-8')))
        except (OSError, ValueError):
            config = None
        if not config:
            raise UserError(f'{run_dir / RUN_INFO} names no config_file: give the CONFIG to rescore with')
    return load_run_config(config)


def _scoring(cfg: RunConfig, reward_ref: Optional[str]) -> Tuple[Any, Any, Dict[str, Any]]:
    """(reward function, finish policy, what they are) for ``cfg`` and ``--reward``."""
    reward = policy = None
    if cfg.scheduler_is_yaml():
        try:  # its reward's signature is checked as the file is (the schema)
            scheduler = load_scheduler(str(cfg.scheduler_path()))
        except ConfigError as exc:
            raise UserError('; '.join(map(str, exc.problems))) from None
        try:
            reward, policy = scheduler.reward_function, scheduler.finish_policy
        finally:
            scheduler.close()
    elif reward_ref is None:
        raise UserError(f'{cfg.source}: the scheduler {cfg.scheduler} is not YAML: give --reward module:attr')
    if reward_ref is not None:
        try:  # a module, or a file: --reward ../lib/rewards.py:score
            reward = resolve_reference(reward_ref, str(cfg.base_dir) if cfg.base_dir else None)
        except (ImportError, AttributeError) as exc:
            raise UserError(f'--reward {reward_ref}: {exc}') from None
        except Exception as exc:  # the module raised while importing
            raise UserError(f'--reward {reward_ref}: importing it raised {type(exc).__name__}: {exc}') from None
        if not callable(reward):
            raise UserError(f'--reward {reward_ref}: not callable')
        problem = call_problem(reward, REWARD_ARGS, 'reward')
        if problem:
            raise UserError(f'--reward {reward_ref}: {problem}')
    return reward, policy, {'reward': reward_ref or (f'{cfg.scheduler} reward' if reward else None),
                            'config': cfg.source, 'finish_policy': policy is not None}


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    source = trajectories_file(run_dir)
    check_out_apart(args.out, source.parent, 'rescore')
    cfg = _config(run_dir, args.config)
    reward, policy, describe = _scoring(cfg, args.reward)
    requests = iter_requests(cfg.dataset, cfg.dataset_path(), cfg.limit, cfg.num_generations, check_unique=False)
    total = count_lines(source)
    progress = ProgressBar(not args.quiet, total, 'rescoring', label='rescore')
    done = [0]

    def on_line() -> None:
        done[0] += 1
        if done[0] % 256 == 0 or done[0] == total:
            progress.update(done[0], f'{done[0]} lines')

    progress.start()
    try:
        rescorer = Rescorer(source.parent, Path(args.out), iter(requests), reward, policy, describe)
        figures = rescorer.run(on_line if progress.enabled else None)
    finally:
        progress.stop()
    if not args.quiet:
        print(f'rescored {figures["rescored"]} of {figures["lines"]} trajectories ({figures["reward_changed"]} '
              f'rewards changed) into {args.out}; mean reward {rescorer.tally.reward_mean()}')
    return 0
