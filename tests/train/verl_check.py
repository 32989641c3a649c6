"""Run by ``tests/train/test_verl.py`` in verl's own venv (``.extras/verl-venv``, scripts/test.sh):
verl 0.9.1's ``AgentLoopWorker`` (its config composed from verl's own ``ppo_trainer.yaml``)
generates a batch with ``MtflowAgentLoop`` (registered through ``agent_loop_config_path``, as a
user registers it) over a fake server manager that serves the tiny random Qwen2 model
(``generate(request_id, prompt_ids=..., sampling_params=...)``, sampling with the model's
logprobs), then verl's GRPO advantage and the optimizer step of verl's training worker
(``TrainingWorker``: its FSDP engine on CPU, one process, gloo) with verl's ``ppo_loss``, hooked to
check what it received. Prints one JSON line; asserts exit non-zero."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from tests.tiny_model import make_model, make_tokenizer  # noqa: E402

GROUPS, SIZE, TURNS = 2, 2, 3
PROMPT_LEN, RESPONSE_LEN, MAX_TOKENS = 64, 160, 6
BATCH = GROUPS * SIZE + 2


class TinyServer:
    """verl's server manager, serving the tiny model: samples ``max_tokens`` at the request's
    temperature, seeded from the prompt ids, and returns each sampled token's logprob."""

    def __init__(self, model, eos_id):
        self.model, self.eos_id, self.calls = model, eos_id, []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        temperature = float(sampling_params.get('temperature', 1.0)) or 1.0
        gen = torch.Generator().manual_seed(zlib.crc32(f'{request_id}{list(prompt_ids)}'.encode()))
        ids, out, logprobs = list(prompt_ids), [], []
        with torch.no_grad():
            for _ in range(int(sampling_params['max_tokens'])):
                logits = self.model(torch.tensor([ids])).logits[0, -1].float()
                logp = torch.log_softmax(logits / temperature, -1)
                token = int(torch.multinomial(logp.exp(), 1, generator=gen))
                out.append(token)
                logprobs.append(float(logp[token]))
                ids.append(token)
                if token == self.eos_id:
                    break
        self.calls.append({'request_id': request_id, 'prompt_ids': list(prompt_ids), 'sampled': out,
                           'logprobs': logprobs})
        return TokenOutput(token_ids=out, log_probs=logprobs if sampling_params.get('logprobs') else None)


def compose_config(model_dir: str, loops: str):
    from hydra import compose, initialize_config_dir
    import verl

    overrides = [f'actor_rollout_ref.model.path={model_dir}', 'actor_rollout_ref.rollout.name=vllm',
                 f'actor_rollout_ref.rollout.prompt_length={PROMPT_LEN}',
                 f'actor_rollout_ref.rollout.response_length={RESPONSE_LEN}',
                 'actor_rollout_ref.rollout.calculate_log_probs=true', 'actor_rollout_ref.rollout.temperature=1.0',
                 f'actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}', 'trainer.device=cpu',
                 f'actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}',
                 f'actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={BATCH}',
                 f'actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={BATCH}',
                 'actor_rollout_ref.actor.optim.lr=0.01', 'actor_rollout_ref.actor.use_kl_loss=false',
                 'actor_rollout_ref.model.use_remove_padding=false',
                 '+actor_rollout_ref.model.override_config.attn_implementation=eager',
                 'actor_rollout_ref.actor.strategy=fsdp2', 'actor_rollout_ref.actor.fsdp_config.dtype=float32',
                 'actor_rollout_ref.actor.fsdp_config.use_torch_compile=false',
                 '+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype: fp32, reduce_dtype: fp32, buffer_dtype: fp32}']
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / 'trainer' / 'config'), version_base=None):
        return compose(config_name='ppo_trainer', overrides=overrides)


def rollout(tmp: Path):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto

    import mtflow.train.verl_agent_loop  # noqa: F401  (the module a user's agent-loop config names)

    tok = make_tokenizer()
    model = make_model(tok, seed=0)
    model.save_pretrained(tmp / 'model')
    tok.save_pretrained(tmp / 'model')
    (tmp / 'game.yaml').write_text(json.dumps({
        'max_turns': 4, 'system_prompt': 'Guess my number between 1 and 100.', 'stop': {'on_length': False},
        'env': {'impl': 'guess_number', 'kwargs': {'low': 1, 'high': 100, 'max_guesses': 6}}}))
    (tmp / 'loops.yaml').write_text(
        '- name: mtflow_tools\n  _target_: mtflow.train.verl_agent_loop.MtflowAgentLoop\n'
        f'  scheduler: tests.train.helpers:ToolEveryTurn\n  scheduler_args: {{max_turns: {TURNS}}}\n'
        f'  request_config: {{max_tokens: {MAX_TOKENS}}}\n'
        '- name: mtflow_game\n  _target_: mtflow.train.verl_agent_loop.MtflowAgentLoop\n'
        f'  scheduler: {tmp / "game.yaml"}\n  request_config: {{max_tokens: {MAX_TOKENS}}}\n')
    config = compose_config(str(tmp / 'model'), str(tmp / 'loops.yaml'))
    server = TinyServer(model, tok.eos_token_id)
    worker = AgentLoopWorker(config, llm_client=server)
    n = GROUPS * SIZE
    names = ['mtflow_tools'] * n + ['mtflow_game'] * 2
    batch = DataProto.from_dict(non_tensors={
        'raw_prompt': np.array([[{'role': 'user', 'content': f'count to {i // SIZE}'}] for i in range(n)] +
                               [[{'role': 'user', 'content': 'your guess?'}]] * 2, dtype=object),
        'agent_name': np.array(names, dtype=object),
        'uid': np.array([f'g{i // SIZE}' for i in range(n)] + ['game', 'game'], dtype=object),
        'index': np.arange(n + 2)})
    out = asyncio.run(worker.generate_sequences(batch))
    return config, tok, model, server, out


def check_rollout(server, out):
    """Every row is exactly one request's last call: its prompt + sampled ids, with the mask 1 on
    exactly the ids the server sampled and their logprobs, and the turns verl counts."""
    calls = {}
    for call in server.calls:
        calls.setdefault(call['request_id'], []).append(call)
    b = out.batch
    rows = []
    for r in range(b['prompts'].shape[0]):
        prompt = b['prompts'][r][b['attention_mask'][r][:PROMPT_LEN].bool()].tolist()
        keep = b['attention_mask'][r][PROMPT_LEN:].bool()
        response = b['responses'][r][keep].tolist()
        mask = b['response_mask'][r][keep].tolist()
        logprobs = b['rollout_log_probs'][r][keep].tolist()
        mine = next(c for c in calls.values() if c[-1]['prompt_ids'] + c[-1]['sampled'] == prompt + response)
        for earlier, later in zip(mine, mine[1:]):  # each turn's prompt extends the last one's ids exactly
            assert later['prompt_ids'][:len(earlier['prompt_ids']) + len(earlier['sampled'])] == \
                earlier['prompt_ids'] + earlier['sampled']
        assert prompt == mine[0]['prompt_ids']
        sampled = [t for c in mine for t in c['sampled']]
        assert [t for t, m in zip(response, mask) if m] == sampled
        want = [v for c in mine for v in c['logprobs']]
        got = [v for v, m in zip(logprobs, mask) if m]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-6 and len(got) == len(want)
        assert all(v == 0.0 for v, m in zip(logprobs, mask) if not m)
        rows.append({'turns': len(mine), 'num_turns': int(out.non_tensor_batch['__num_turns__'][r]),
                     'turn_scores': list(out.non_tensor_batch['turn_scores'][r]), 'sequence': prompt + response,
                     'mask': mask, 'logprobs': want})
    assert sorted(r['turns'] for r in rows[:GROUPS * SIZE]) == [TURNS] * (GROUPS * SIZE)
    assert all(r['num_turns'] == 2 * r['turns'] for r in rows[:GROUPS * SIZE])  # user + (assistant, tool) * turns - tool
    assert all(len(r['turn_scores']) == r['turns'] for r in rows[:GROUPS * SIZE])
    return rows


def advantages(out):
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    adv, _ = compute_grpo_outcome_advantage(out.batch['rm_scores'], out.batch['response_mask'],
                                            out.non_tensor_batch['uid'])
    return adv


def main() -> int:
    tmp = Path(tempfile.mkdtemp())
    config, tok, model, server, out = rollout(tmp)
    rows = check_rollout(server, out)
    adv = advantages(out)
    step = train_step(config, tmp / 'model', out, adv)
    checked = check_loss_inputs(step.pop('seen'), out, rows, adv)
    assert step['losses_seen'] == 1 and step['moved'], step
    print(json.dumps({'rows': len(rows), 'turns': [r['turns'] for r in rows], 'num_turns': [r['num_turns'] for r in rows],
                      'turn_scores': [r['turn_scores'] for r in rows], 'step': step, 'loss_inputs': checked}))
    return 0


def train_step(config, model_dir, out, adv):
    """One optimizer step of verl's ``TrainingWorker`` (the actor's, built as verl's
    ``ActorRolloutRefWorker.init_model`` builds it) on the batch, the way verl's trainer feeds it
    (``left_right_2_no_padding``, the mini-batch fields), with the policy loss hooked."""
    import socket
    from functools import partial

    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers import engine_workers
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.utils import losses
    from verl.workers.utils.padding import left_right_2_no_padding

    import verl_cpu_platform

    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    os.environ.update({'RANK': '0', 'LOCAL_RANK': '0', 'WORLD_SIZE': '1', 'MASTER_ADDR': '127.0.0.1',
                       'MASTER_PORT': str(port)})
    # verl builds the backend string 'cpu:gloo,<device>:<backend>', which is 'cpu:gloo,cpu:gloo' on a CPU
    # platform and refused by torch; one process: gloo, initialised here (verl keeps a group it finds)
    torch.distributed.init_process_group('gloo', rank=0, world_size=1)
    verl_cpu_platform.register_cpu_engine()
    seen = []
    real = losses.get_policy_loss_fn

    def hooked(name):
        fn = real(name)

        def check(**kw):
            seen.append({k: v.detach().clone() if hasattr(v, 'detach') else v for k, v in kw.items()
                         if k in ('old_log_prob', 'log_prob', 'advantages', 'response_mask')})
            return fn(**kw)
        return check

    losses.get_policy_loss_fn = hooked
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    actor.model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    worker_config = TrainingWorkerConfig(model_type='language_model', model_config=actor.model_config,
                                         engine_config=actor.engine, optimizer_config=actor.optim,
                                         checkpoint_config=actor.checkpoint)
    worker_config.engine_config.use_dynamic_bsz = False
    worker_config.engine_config.micro_batch_size_per_gpu = out.batch['prompts'].shape[0]
    worker_config.engine_config.infer_micro_batch_size_per_gpu = out.batch['prompts'].shape[0]
    worker = engine_workers.TrainingWorker(config=worker_config)
    worker.reset()
    worker.set_loss_fn(partial(losses.ppo_loss, config=actor))
    before = [p.detach().clone() for p in worker.engine.module.parameters()]
    out.batch['advantages'] = adv
    out.batch['old_log_probs'] = out.batch['rollout_log_probs']  # the rollout's logprobs as the old policy's
    out.meta_info.update({'temperature': 1.0, 'multi_turn': True})
    td = left_right_2_no_padding(out.to_tensordict())
    n = out.batch['prompts'].shape[0]
    tu.assign_non_tensor(td, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=n, mini_batch_size=n, epochs=1, seed=0,
                         dataloader_kwargs={'shuffle': False}, compute_loss=True)
    metrics = tu.get(worker.train_mini_batch(td), 'metrics')
    moved = any(not torch.equal(a, b.detach()) for a, b in zip(before, worker.engine.module.parameters()))
    return {'losses_seen': len(seen), 'moved': moved, 'metrics': sorted(metrics), 'seen': seen}


def check_loss_inputs(seen, out, rows, adv):
    """What verl's policy loss received, row by row: the mask mtflow gave, the rollout logprobs
    as the old policy's on exactly the trained tokens, the trainer's own logprobs of the ids within
    1e-4 of them (the ids it scored are exactly the sampled ones, at their places), and
    ``mtflow.train.grpo``'s advantage of the row's group (verl's epsilon)."""
    from mtflow.train import grpo

    (inputs, ) = seen
    uids = list(out.non_tensor_batch['uid'])
    rewards = out.batch['rm_scores'].sum(-1).tolist()
    expected = grpo(rewards, uids, eps=1e-6)
    gaps = []
    for r, row in enumerate(rows):
        n = len(row['mask'])
        mask = inputs['response_mask'][r][:n].long().tolist()
        assert mask == row['mask'] and not inputs['response_mask'][r][n:].any()
        trained = inputs['response_mask'][r][:n].bool()
        old = inputs['old_log_prob'][r][:n][trained].tolist()
        assert max(abs(a - b) for a, b in zip(old, row['logprobs'])) < 1e-6 and len(old) == len(row['logprobs'])
        gaps.append(float((inputs['log_prob'][r][:n][trained] - inputs['old_log_prob'][r][:n][trained]).abs().max()))
        got = inputs['advantages'][r][:n][trained]
        assert float((got - expected[r]).abs().max()) < 1e-4, (r, got, expected[r])
    assert max(gaps) < 1e-4, gaps
    return {'max_logprob_gap': max(gaps), 'advantages': [round(a, 4) for a in expected]}


if __name__ == '__main__':
    os.environ.setdefault('VERL_PLATFORM', 'cpu')
    import verl_cpu_platform  # noqa: F401  (verl's platform registry: a CPU platform, see the module)
    os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
    sys.exit(main())
