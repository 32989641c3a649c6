"""``--external_plugins`` file of ``tests/swift/test_stream_grpo.py``: ``swift rlhf --rlhf_type grpo``
builds :class:`StreamTrainer`, ms-swift's GRPO trainer on an mtflow stream of multi-turn tool-use
rollouts (``tests.train.helpers.ToolEveryTurn``: three turns, a calculator's answer as a ``tool``
message between them, the reward the share of even ids), and writes what its loss received to
``$MTFLOW_STREAM_OUT`` (JSON) when training ends.

``$MTFLOW_STREAM_MODE``:

* ``colocated``: an HF backend over the model being trained (its rollouts take the trainer's lock),
  the dataset streamed epoch after epoch, at most 1 version of staleness in the stream and
  ``StalePolicy(max_staleness=0)`` withholding the tokens of anything older than the step;
* ``frozen``: a frozen copy of the initial weights, each reply a function of its request alone
  (``PerRequestSeeds``), one pass over the dataset: what a TRL run of the same task gets too.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List

import torch

from mtflow import Executor, RequestConfig
from mtflow.backends.hf import HFBackend
from mtflow.train import StalePolicy
from mtflow.train.swift_grpo import StreamGRPOTrainer, use_stream_trainer

from tests.tiny_model import make_model, make_tokenizer
from tests.train.helpers import PerRequestSeeds, ToolEveryTurn, record_mask

MODE = os.environ.get('MTFLOW_STREAM_MODE', 'colocated')


def _row(inputs: Dict[str, Any], grpo_batch: Any, r: int, step: int) -> Dict[str, Any]:
    """Row ``r`` of a loss call, unpadded: its ids, its loss mask over them, its advantage and
    the rollout logprobs on its trained tokens."""
    keep = inputs['attention_mask'][r].bool()
    completion = grpo_batch.completion_mask[r].bool()
    mask = torch.zeros_like(inputs['input_ids'][r])
    mask[-grpo_batch.logits_to_keep:] = completion.long()
    rollout = grpo_batch.rollout_per_token_logps
    return {'step': step, 'ids': inputs['input_ids'][r][keep].tolist(), 'mask': mask[keep].tolist(),
            'advantage': float(grpo_batch.advantages[r, 0]),
            'rollout_logps': None if rollout is None else rollout[r][completion].tolist()}


class StreamTrainer(StreamGRPOTrainer):
    keep = True
    stream_options = {'max_concurrency': 16, 'buffer': 4, 'max_staleness': 1} if MODE == 'colocated' else {}
    stale_policy = StalePolicy(max_staleness=0) if MODE == 'colocated' else None

    def make_executor(self) -> Executor:
        tokenizer = make_tokenizer()  # the backend's own object, apart from the template's (same ids)
        if MODE == 'colocated':
            rollout = self.locked(HFBackend(self.model, tokenizer, default_max_tokens=6, seed=0))
        else:
            rollout = self.locked(PerRequestSeeds(HFBackend(make_model(tokenizer, seed=0), tokenizer)))
        self.initial = [p.detach().clone() for p in self.model.parameters()]
        self.seen: List[Dict[str, Any]] = []
        return Executor(ToolEveryTurn(max_turns=3), rollout, RequestConfig(max_tokens=6, temperature=1.0,
                                                                             logprobs=True))

    def rows(self) -> Any:
        return super().rows() if MODE == 'colocated' else list(self.train_dataset)

    def _compute_loss(self, model: Any, model_inputs: Any, grpo_batch: Any, origin_data: Any = None) -> Any:
        step = int(self.state.global_step)
        self.seen += [_row(model_inputs, grpo_batch, r, step) for r in range(model_inputs['input_ids'].shape[0])]
        return super()._compute_loss(model, model_inputs, grpo_batch, origin_data)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        result = super().train(*args, **kwargs)
        with open(os.environ['MTFLOW_STREAM_OUT'], 'w') as f:
            json.dump(self.report(), f)
        return result

    def report(self) -> Dict[str, Any]:
        batches = []
        for batch in self.taken:
            by_uuid = {s.uuid: s for s in batch['samples']}
            groups = []
            for g in batch['groups']:
                members = []
                for uuid, request in zip(g.uuids, g.requests):
                    record, sample = request.token_record, by_uuid[uuid]
                    members.append({'uuid': uuid, 'sequence': record.sequence(), 'record_mask': record_mask(record),
                                    'logprobs': [v for turn in record.turns for v in turn.logprobs],
                                    'reward': sample.reward, 'withheld': sample.withheld_tokens,
                                    'versions': [t.version for t in record.turns]})
                groups.append({'age': g.age, 'version_span': g.version_span, 'members': members})
            batches.append({'version': batch['version'], 'groups': groups})
        changed = any(not torch.equal(a, b) for a, b in zip(self.initial, self.model.parameters()))
        return {'mode': MODE, 'seen': self.seen, 'batches': batches, 'stats': self.stream.stats,
                'counts': self.stale_policy.counts.to_dict() if self.stale_policy else None,
                'weights_changed': changed, 'steps': int(self.state.global_step)}


use_stream_trainer(StreamTrainer)
