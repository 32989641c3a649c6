"""End to end on CPU: ``swift rlhf --rlhf_type grpo`` (ms-swift 4.6.0's real trainer, colocate,
``use_vllm false`` so rollouts go through its TransformersEngine) trains one step of a tiny
random Qwen2 with an mtflow scheduler registered through ``schedulers/swift_plugin.py``.

Run twice: with ms-swift's own multi-turn driver calling the adapter's hooks, and with
``MTFLOW_SWIFT_EXECUTOR=1`` (``install()``: the trainer's loop runs on mtflow's executor). Same seed,
same data: the logged step (loss, grad norm, rewards, turns, lengths) must be identical, the
scheduler's ``on_request_finished`` must run once per rollout, and mtflow's run must leave a trace."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest

from tests.swift.tiny_grpo import tiny_setup

ROOT = Path(__file__).resolve().parents[2]
SWIFT = str(Path(sys.executable).with_name('swift'))
KEYS = ('loss', 'grad_norm', 'reward', 'reward_std', 'num_turns', 'completions/mean_length',
        'rewards/DistinctChars/mean')


def grpo_step(tmp: Path, model: Path, data: Path, executor: bool, scheduler: str = 'ThreeTurns',
              nproc: int = 1) -> Dict[str, Any]:
    out = tmp / f"{'mtflow' if executor else 'swift'}-{scheduler}-{nproc}"
    log = out / 'finished.jsonl'
    out.mkdir()
    env = {**os.environ, 'CUDA_VISIBLE_DEVICES': '', 'HF_HUB_OFFLINE': '1', 'TRANSFORMERS_OFFLINE': '1',
           'PYTHONPATH': str(ROOT), 'MTFLOW_SWIFT_EXECUTOR': '1' if executor else '0',
           'MTFLOW_TRACE_DIR': str(out / 'traces'), 'MTFLOW_E2E_LOG': str(log),
           'MTFLOW_SWIFT_SCHEDULERS': f'e2e_three_turns=tests.swift.e2e_scheduler:{scheduler}'}
    if nproc > 1:  # torchrun on CPU (gloo): real ranks, real gather_object
        env.update(NPROC_PER_NODE=str(nproc), MASTER_PORT=str(29500 + os.getpid() % 1000))
    cmd = [SWIFT, 'rlhf', '--rlhf_type', 'grpo', '--model', str(model), '--model_type', 'qwen2',
           '--template', 'qwen2_5', '--dataset', str(data),
           '--external_plugins', 'schedulers/swift_plugin.py', 'tests/swift/e2e_plugin.py',
           '--multi_turn_scheduler', 'e2e_three_turns', '--max_turns', '3',
           '--reward_funcs', 'mtflow_e2e_distinct', '--use_vllm', 'false', '--tuner_type', 'full',
           '--torch_dtype', 'float32', '--num_generations', '2', '--per_device_train_batch_size', '2',
           '--gradient_accumulation_steps', '1', '--max_completion_length', '8', '--max_length', '256',
           '--max_steps', '1', '--learning_rate', '1e-2', '--warmup_ratio', '0', '--check_model', 'false',
           '--save_strategy', 'no',
           '--logging_steps', '1', '--report_to', 'none', '--dataloader_num_workers', '0', '--seed', '7',
           '--output_dir', str(out / 'run')]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = [json.loads(line) for p in (out / 'run').glob('v*/logging.jsonl') for line in p.open()]
    step = next(entry for entry in logs if 'loss' in entry)
    finished = [json.loads(line) for line in log.open()] if log.exists() else []
    traces = sorted((out / 'traces').glob('*.jsonl'))
    return {'step': step, 'finished': finished, 'traces': traces}


@pytest.mark.slow
def test_grpo_step_on_cpu_with_an_mtflow_scheduler(tmp_path: Path) -> None:
    model, data = tiny_setup(tmp_path)
    by_swift = grpo_step(tmp_path, model, data, executor=False)
    by_mtflow = grpo_step(tmp_path, model, data, executor=True)

    step = by_mtflow['step']
    assert step['num_turns'] == 3.0  # the multi-turn path really ran, three turns per rollout
    assert step['grad_norm'] > 0 and step['reward_std'] > 0  # a real update, not a no-op
    assert {k: by_mtflow['step'][k] for k in KEYS} == {k: by_swift['step'][k] for k in KEYS}
    for run in (by_swift, by_mtflow):
        assert [(f['reason'], f['turn']) for f in run['finished']] == [('check_finished', 3)] * 2
    assert not by_swift['traces'] and len(by_mtflow['traces']) == 1
    from mtflow import Trace
    trace = Trace.read_jsonl(by_mtflow['traces'][0])
    assert trace.finish_reasons() == {'check_finished': 2}
    assert {trace.path(u) for u in trace.uuids()} == {trace.path(trace.uuids()[0])}
    assert trace.states(trace.uuids()[0]).count('continuing') == 1  # turn 3 continued turn 2's message


@pytest.mark.slow
def test_grpo_two_cpu_ranks_uneven_turns(tmp_path: Path) -> None:
    """Two real processes (torchrun, gloo): rank 0's rollouts end at turn 1, rank 1's at turn 3,
    so rank 0 must keep joining the collective per-turn calls with nothing to generate. mtflow's
    executor (install()) and ms-swift's driver: same finishes per rank, nobody hangs."""
    model, data = tiny_setup(tmp_path)
    by_swift = grpo_step(tmp_path, model, data, executor=False, scheduler='UnevenTurns', nproc=2)
    by_mtflow = grpo_step(tmp_path, model, data, executor=True, scheduler='UnevenTurns', nproc=2)
    for run in (by_swift, by_mtflow):
        assert sorted(f['turn'] for f in run['finished']) == [1, 1, 3, 3]
    from mtflow import Trace
    traces = {p.name.split('-')[0]: Trace.read_jsonl(p) for p in by_mtflow['traces']}
    assert sorted(traces) == ['rank0', 'rank1']
    assert {e.turn for e in traces['rank0'] if e.dst == 'finished'} == {1}
    assert {e.turn for e in traces['rank1'] if e.dst == 'finished'} == {3}
    assert {k: by_mtflow['step'][k] for k in KEYS} == {k: by_swift['step'][k] for k in KEYS}
