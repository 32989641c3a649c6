"""ms-swift 4.6's GRPO trainer on an mtflow stream (``mtflow.train.swift_grpo``), end to end on CPU.

``swift rlhf --rlhf_type grpo`` with ``tests/swift/stream_plugin.py`` (``use_stream_trainer``)
trains the tiny random Qwen2 on multi-turn tool-use rollouts from ``Executor.stream``; the
plugin's trainer hooks ``_compute_loss`` and writes, per row, what the loss received (its ids,
its mask, its advantage, the rollout logprobs ms-swift placed on its trained tokens) beside the
token record of every request it took. A subprocess per run: ms-swift's import changes
transformers' callbacks for the whole process (the TRL run of the parity test runs here, with
transformers' own).

* the colocated run: rollouts from the weights being trained, the stream bounded to 1 version
  of staleness, ``StalePolicy(max_staleness=0)`` withholding the tokens of older groups: the loss
  saw exactly the records' ids and masks (withheld ones zeroed, exactly those the stamps say are
  stale), their logprobs, and ``mtflow.train.grpo``'s advantages over the same groups;
* the parity test: the same task through TRL's ``rollout_func`` and through ms-swift's stream,
  both from a frozen copy of the initial weights that answers each request as a function of the
  request alone: the two losses saw the same ids, masks, logprobs and advantages, group by group.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from mtflow import Executor, RequestConfig
from mtflow.train import grpo
from mtflow.train.trl_rollout import TRLRollout, mtflow_reward

from tests.swift.tiny_grpo import tiny_setup
from tests.train.helpers import PerRequestSeeds, ToolEveryTurn, transformers_own_callbacks

ROOT = Path(__file__).resolve().parents[2]
SWIFT = str(Path(sys.executable).with_name('swift'))
SYSTEM = 'You count.'


def stream_run(tmp: Path, mode: str, data: Path, steps: int) -> Dict[str, Any]:
    """One ``swift rlhf`` run of the stream trainer; the plugin's report."""
    model = tmp / 'grpo' / 'model'
    if not model.exists():
        tiny_setup(tmp / 'grpo')
    out = tmp / mode
    out.mkdir()
    env = {**os.environ, 'CUDA_VISIBLE_DEVICES': '', 'HF_HUB_OFFLINE': '1', 'TRANSFORMERS_OFFLINE': '1',
           'PYTHONPATH': str(ROOT), 'MTFLOW_STREAM_MODE': mode, 'MTFLOW_STREAM_OUT': str(out / 'report.json')}
    cmd = [SWIFT, 'rlhf', '--rlhf_type', 'grpo', '--model', str(model), '--model_type', 'qwen2',
           '--template', 'qwen2_5', '--dataset', str(data), '--external_plugins', 'tests/swift/stream_plugin.py',
           '--reward_funcs', 'mtflow_reward', '--use_vllm', 'false', '--tuner_type', 'full',
           '--torch_dtype', 'float32', '--num_generations', '4', '--per_device_train_batch_size', '8',
           '--gradient_accumulation_steps', '1', '--max_length', '512', '--max_steps', str(steps),
           '--learning_rate', '1e-2', '--warmup_ratio', '0', '--check_model', 'false', '--save_strategy', 'no',
           '--logging_steps', '1', '--report_to', 'none', '--dataloader_num_workers', '0', '--seed', '7',
           '--output_dir', str(out / 'run')]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / 'report.json').read_text())
    report['logs'] = [json.loads(line) for p in (out / 'run').glob('v*/logging.jsonl') for line in p.open()]
    return report


def prompts_file(path: Path, n: int) -> Path:
    path.write_text(''.join(json.dumps({'messages': [{'role': 'system', 'content': SYSTEM},
                                                     {'role': 'user', 'content': f'count to {i}'}]}) + '\n'
                            for i in range(n)))
    return path


@pytest.mark.slow
def test_stream_trainer_loss_sees_the_records_exact_ids_masks_logprobs_and_mtflows_advantages(tmp_path):
    report = stream_run(tmp_path, 'colocated', prompts_file(tmp_path / 'data.jsonl', 8), steps=3)
    assert report['steps'] == 3 and len(report['batches']) == 3 and report['weights_changed']
    seen: Dict[int, List[Dict[str, Any]]] = {}
    for row in report['seen']:
        seen.setdefault(row['step'], []).append(row)
    withheld = 0
    for batch in report['batches']:
        version, groups = batch['version'], batch['groups']
        members = [m for g in groups for m in g['members']]
        assert len(groups) == 2 and all(len(g['members']) == 4 for g in groups)
        advantages = grpo([m['reward'] for m in members], [g for g, group in enumerate(groups) for _ in group['members']])
        by_sequence = {tuple(m['sequence']): (m, a) for m, a in zip(members, advantages)}
        assert len(by_sequence) == 8 and len(seen[version]) == 8
        for row in seen[version]:
            member, advantage = by_sequence.pop(tuple(row['ids']))  # exactly one record's sequence
            versions = member['versions']
            assert len(versions) == 3 and max(versions) <= version  # three turns, none from the future
            stale = min(versions) < version  # StalePolicy(max_staleness=0)
            trained = sum(member['record_mask'])
            assert member['withheld'] == (trained if stale else 0)
            expected = [0] * len(member['record_mask']) if stale else member['record_mask']
            assert row['mask'] == expected  # tool messages and glue 0; a stale member's tokens withheld
            assert row['rollout_logps'] == pytest.approx([] if stale else member['logprobs'], abs=1e-6)
            assert row['advantage'] == pytest.approx(advantage, abs=1e-5)  # its reward stays in the baseline
            withheld += member['withheld']
        assert not by_sequence  # every rollout taken reached the loss once
        for group in groups:
            oldest = min(v for m in group['members'] for v in m['versions'])
            assert group['age'] == version - oldest <= 1  # the stream's max_staleness=1
    assert report['counts']['withheld_tokens'] == withheld
    assert report['stats']['delivered_groups'] >= 6
    logged = [entry for entry in report['logs'] if 'mtflow/age' in entry]  # the stream's figures, per step
    assert len(logged) == 3 and sum(float(e['mtflow/withheld_tokens']) for e in logged) == withheld
    assert [float(e['mtflow/age']) for e in logged] == [sum(g['age'] for g in b['groups']) / 2
                                                         for b in report['batches']]


@pytest.mark.slow
def test_trl_and_the_swift_stream_trainer_reach_the_loss_with_the_same_data(tmp_path, monkeypatch):
    data = prompts_file(tmp_path / 'data.jsonl', 4)
    by_swift = swift_view(stream_run(tmp_path, 'frozen', data, steps=2))
    by_trl = trl_view(tmp_path, monkeypatch, [json.loads(line)['messages'] for line in data.read_text().splitlines()])
    assert len(by_trl) == len(by_swift) == 16  # four prompts, four copies each, two steps of two groups
    assert set(by_trl) == set(by_swift)
    for sequence, (mask, advantage, logps, group) in by_trl.items():
        other = by_swift[sequence]
        assert mask == other[0] and group == other[3]  # the same loss mask, in the same group
        assert advantage == pytest.approx(other[1], abs=1e-5)
        assert logps == pytest.approx(other[2], abs=1e-5)
    advantages = [a for _, a, _, _ in by_trl.values()]
    assert max(advantages) - min(advantages) > 0.5  # rewards vary within groups: the advantages say something


View = Dict[Tuple[int, ...], Tuple[List[int], float, List[float], frozenset]]


def swift_view(report: Dict[str, Any]) -> View:
    """Per sequence the loss saw: its mask, advantage, rollout logprobs and its group's sequences."""
    group_of = {}
    for batch in report['batches']:
        for g in batch['groups']:
            members = frozenset(tuple(m['sequence']) for m in g['members'])
            group_of.update({s: members for s in members})
    return {tuple(r['ids']): (r['mask'], r['advantage'], r['rollout_logps'], group_of[tuple(r['ids'])])
            for r in report['seen']}


def trl_view(tmp_path: Path, monkeypatch: Any, prompts: List[Any]) -> View:
    """The same task through TRL's ``GRPOTrainer(rollout_func=TRLRollout(...))``, its
    ``_compute_loss`` hooked: what it saw, as :func:`swift_view` gives ms-swift's."""
    trl = pytest.importorskip('trl')
    datasets = pytest.importorskip('datasets')
    from mtflow.backends.hf import HFBackend
    from tests.tiny_model import make_model, make_tokenizer

    transformers_own_callbacks(monkeypatch)
    monkeypatch.setenv('TRL_EXPERIMENTAL_SILENCE', '1')
    tok = make_tokenizer()
    frozen = PerRequestSeeds(HFBackend(make_model(tok, seed=0), tok))  # the plugin's 'frozen' rollouts
    rollout = TRLRollout(Executor(ToolEveryTurn(max_turns=3), frozen,
                                  RequestConfig(max_tokens=6, temperature=1.0, logprobs=True)), keep=True)
    seen = []

    class Hooked(trl.GRPOTrainer):
        def _compute_loss(self, model, inputs):
            seen.append({k: v.detach().clone() if hasattr(v, 'detach') else v for k, v in inputs.items()})
            return super()._compute_loss(model, inputs)

    args = trl.GRPOConfig(output_dir=str(tmp_path / 'trl'), use_cpu=True, per_device_train_batch_size=8,
                          num_generations=4, max_steps=2, learning_rate=1e-2, report_to='none', save_strategy='no',
                          bf16=False, beta=0.0, seed=0, logging_steps=1, disable_tqdm=True)
    trainer = Hooked(model=make_model(tok, seed=0), processing_class=tok, reward_funcs=mtflow_reward, args=args,
                     train_dataset=datasets.Dataset.from_list([{'prompt': p} for p in prompts]), rollout_func=rollout)
    trainer.train()
    group_of = {}
    for requests in rollout.requests:
        for start in range(0, len(requests), 4):
            members = frozenset(tuple(r.token_record.sequence()) for r in requests[start:start + 4])
            group_of.update({s: members for s in members})
    view: View = {}
    for inputs in seen:
        for r in range(inputs['prompt_ids'].shape[0]):
            prompt = inputs['prompt_ids'][r][inputs['prompt_mask'][r].bool()].tolist()
            keep = inputs['completion_mask'][r].bool()
            tool_mask = inputs['tool_mask'][r][keep]
            sequence = tuple(prompt + inputs['completion_ids'][r][keep].tolist())
            logps = inputs['sampling_per_token_logps'][r][keep][tool_mask.bool()].tolist()
            view[sequence] = ([0] * len(prompt) + tool_mask.tolist(), inputs['advantages'][r].item(), logps,
                              group_of[sequence])
    return view
