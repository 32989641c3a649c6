"""Shared pieces of the training tests: multi-turn tool-use rollouts of the tiny random Qwen2
model (``tests/tiny_model.py``) through the HF backend, so every sample comes from a real token
record.

The tiny model never writes a parseable tool call, so the scheduler calls the tool itself every
turn: the calculator scores the reply (the share of its sampled ids that are even) and the result
goes back as a ``tool`` message, exactly the glue a tool call leaves between two assistant
messages (mask 0)."""
from __future__ import annotations

import json
import os
import subprocess
import zlib
from pathlib import Path
from typing import Any, List, Tuple

from mtflow import Executor, RequestConfig, RolloutInferRequest, Scheduler
from mtflow.tools.calculator import calculator


#: ChatML that renders tool calls and tool messages, as TRL's environment_factory requires of a template
TOOL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>{{ call['function']['name'] }} "
    "{{ call['function']['arguments'] | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def even_share(ids: List[int]) -> float:
    return sum(1 for t in ids if t % 2 == 0) / max(1, len(ids))


class ToolEveryTurn(Scheduler):
    """``max_turns`` turns (a reply cut at ``max_tokens`` goes on); each step calls the calculator
    on the reply's ids and appends its answer as a tool message; the reward is the share of even
    ids over all sampled turns, and each turn's own share is its per-turn reward."""

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        return current_turn >= self.max_turns

    async def on_turn_end(self, infer_request: Any, response_choice: Any, current_turn: int) -> dict:
        record = getattr(infer_request, 'token_record', None)  # the exact ids of every turn so far
        if record is None:  # a backend without one (the scripted backend): no reward
            return {}
        sampled = [t for turn in record.turns for t in turn.sampled]
        return {'rollout_infos': {'reward': even_share(sampled)}}

    def turn_reward(self, infer_request: Any, response_choice: Any, current_turn: int) -> float:
        """Each turn's own even share (``rollout_infos['turn_rewards']``, for per-turn advantages)."""
        return even_share(list(response_choice.token_ids or []))

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> dict:
        ids = list(response_choice.token_ids or [])
        evens = sum(1 for t in ids if t % 2 == 0)
        infer_request.messages.append({'role': 'tool', 'name': 'calculator',
                                       'content': calculator(f'{evens} / {max(1, len(ids))}')})
        return {'infer_request': infer_request}


def record_mask(record: Any) -> List[int]:
    """The loss mask a token record implies over its whole sequence: prompt 0, sampled 1, the ids
    appended after a turn (tool messages, template glue) 0."""
    mask = [0] * len(record.prompt_ids)
    for turn in record.turns:
        mask += [1] * len(turn.sampled) + [0] * len(turn.appended)
    return mask


def tiny_backend(seed: int = 0, max_tokens: int = 6, **config: Any) -> Any:
    from mtflow.backends.hf import HFBackend
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    return HFBackend(make_model(tok, seed=seed, **config), tok, default_max_tokens=max_tokens, seed=seed)


def prompts(groups: int, size: int, start: int = 0) -> List[RolloutInferRequest]:
    return [RolloutInferRequest(messages=[{'role': 'user', 'content': f'count to {g}'}], uuid=f'p{g}#{k}')
            for g in range(start, start + groups) for k in range(size)]


def tool_run(backend: Any, groups: int = 2, size: int = 3, max_turns: int = 3,
             max_tokens: int = 6) -> Tuple[Any, List[RolloutInferRequest]]:
    """One ``Executor.run`` of ``groups`` x ``size`` requests, logprobs on, version 0 stamped."""
    requests = prompts(groups, size)
    ex = Executor(ToolEveryTurn(max_turns=max_turns), backend,
                  RequestConfig(max_tokens=max_tokens, temperature=1.0, logprobs=True))
    ex.set_policy_version(0)
    result = ex.run(requests)
    assert result.ok, result.failures
    return result, requests


class PerRequestSeeds:
    """A ``rollout_fn`` whose every reply depends on its request alone: each request is generated
    by itself, torch seeded from its conversation so far (roles and contents) and its copy index
    (the uuid's ``#k``). Two trainers that batch, order and time their rollouts differently (TRL's
    ``rollout_func``, ms-swift's stream) then get the same trajectories from the same weights."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.__wrapped__ = backend

    def __call__(self, requests: List[Any], request_config: Any = None) -> List[Any]:
        import torch

        outputs = []
        for request in requests:
            copy = str(request.uuid).rpartition('#')[2]
            history = json.dumps([[m.get('role'), m.get('content')] for m in request.messages])
            torch.manual_seed(zlib.crc32(f'{history}#{copy}'.encode()))
            outputs += self.backend([request], request_config)
        return outputs


def transformers_own_callbacks(monkeypatch: Any) -> None:
    """transformers' default callbacks, as in a process that never imported ms-swift: ms-swift's
    import (``swift/trainers/patcher.py``) replaces them for the whole process, and its flow
    callback reads ``args.max_epochs``, which TRL's ``GRPOConfig`` does not have."""
    from transformers import trainer, trainer_callback
    monkeypatch.setattr(trainer, 'DEFAULT_CALLBACKS', [trainer_callback.DefaultFlowCallback])
    monkeypatch.setattr(trainer, 'PrinterCallback', trainer_callback.PrinterCallback)


def run_check(venv: str, script: str, timeout: float = 600, **env: str) -> Any:
    """Run ``tests/train/<script>`` with the python of ``.extras/<venv>`` (a trainer whose pins need a
    venv of its own) and return the JSON report its last line prints; a failure shows its stderr."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([str(root / '.extras' / venv / 'bin' / 'python'), str(root / 'tests' / 'train' / script)],
                          capture_output=True, text=True, timeout=timeout, cwd=root,
                          env=dict(os.environ, PYTHONPATH=str(root), **env))
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
