"""A known run for the viewer tests: four requests through a real :class:`mtflow.Executor`, a small
Python scheduler and scripted model outputs, tokenized with a real (word-level) tokenizer.

=====  =========================================================  ===============================
uuid   model says, turn by turn                                   what happens
=====  =========================================================  ===============================
r0     ``call search`` / ``ANSWER 42``                            tool step, then the stop rule
r1     ``call bad`` / ``think more`` / ``so``                     tool error, a continuation, max_turns
r2     ``BOOM``                                                   the step raises: error
r3     ``ANSWER 7``                                               stop rule in the first turn
=====  =========================================================  ===============================
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import mtflow
from mtflow.core.protocol import RolloutInferRequest, RolloutOutput, make_choice, make_response

REPO = Path(__file__).resolve().parents[2]
SCRIPT: Dict[str, List[str]] = {
    'r0': ['call search', 'ANSWER 42'],
    'r1': ['call bad', 'think more', 'so'],
    'r2': ['BOOM'],
    'r3': ['ANSWER 7'],
}
WORDS = ['[UNK]', 'call', 'search', 'ANSWER', '42', 'bad', 'think', 'more', 'so', 'BOOM', '7', 'observation', 'ok',
         'no', 'results', 'question']
EXPECTED_PATHS = {
    'r0': 'pending -> generating -> tool_step -> generating -> finished(stop_rule:final_answer)',
    'r1': 'pending -> generating -> tool_step -> generating -> tool_step -> continuing -> finished(max_turns)',
    'r2': 'pending -> generating -> tool_step -> finished(error)',
    'r3': 'pending -> generating -> finished(stop_rule:final_answer)',
}


def make_tokenizer() -> Any:
    """A real ``tokenizers`` word-level tokenizer (decodes each id to its word)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token='[UNK]'))
    tok.pre_tokenizer = Whitespace()
    return tok


class ToolScheduler(mtflow.Scheduler):
    """Calls a pretend tool on ``call X``; ``ANSWER`` stops; ``BOOM`` makes the step raise;
    ``think`` asks the model to continue its own message."""
    finish_reasons = ('stop_rule:final_answer', )

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(max_turns=None)
        self.tok = tokenizer

    async def on_turn_end(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        if 'ANSWER' in response_choice.message.content:
            return {'done': True, 'finish_reason': 'stop_rule:final_answer'}
        return {}

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        content = response_choice.message.content
        if 'BOOM' in content:
            raise RuntimeError('the tool exploded')
        ids = list(response_choice.token_ids)
        if 'think' in content:  # continue the assistant message: nothing added, nothing masked
            return {'infer_request': infer_request, 'response_token_ids': ids, 'response_loss_mask': [1] * len(ids),
                    'trace_info': {'tool_calls': []}}
        bad = 'bad' in content
        observation = 'no results' if bad else 'observation ok'
        infer_request.messages.append({'role': 'tool', 'content': observation})
        obs_ids = self.tok.encode(observation).ids
        info: Dict[str, Any] = {'tool_calls': [{'name': 'search'}]}
        if bad:
            info['tool_errors'] = ['search: no results']
        return {'infer_request': infer_request, 'response_token_ids': ids + obs_ids,
                'response_loss_mask': [1] * len(ids) + [0] * len(obs_ids), 'trace_info': info}


def scripted_rollout(tokenizer: Any):
    """``rollout_fn``: the next scripted completion of each request, with real token ids."""
    calls: Dict[str, int] = {}

    def rollout_fn(requests: List[Any], request_config: Any) -> List[RolloutOutput]:
        outs = []
        for req in requests:
            k = calls.get(req.uuid, 0)
            calls[req.uuid] = k + 1
            text = SCRIPT[req.uuid][k]
            ids = tokenizer.encode(text).ids
            choice = make_choice(text, token_ids=ids, logprobs=[-0.5] * len(ids))
            outs.append(RolloutOutput(response=make_response(choice)))
        return outs

    return rollout_fn


def make_requests() -> List[RolloutInferRequest]:
    return [RolloutInferRequest(uuid=u, messages=[{'role': 'user', 'content': 'question'}]) for u in SCRIPT]


def run_scenario(max_turns: int = 3, on_error: str = 'return') -> Any:
    """Run the scenario; return ``(result, requests, tokenizer)``."""
    tok = make_tokenizer()
    requests = make_requests()
    ex = mtflow.Executor(ToolScheduler(tok), scripted_rollout(tok), max_turns=max_turns, on_error=on_error)
    return ex.run(requests), requests, tok


def write_scenario(directory: Path) -> Dict[str, Path]:
    """Run the scenario and write its trace, trajectories and tokenizer files into ``directory``."""
    from mtflow.run.trajectories import trajectories_from_result, write_trajectories

    result, requests, tok = run_scenario()
    paths = {'trace': directory / 'trace.jsonl', 'trajectories': directory / 'trajectories.jsonl',
             'tokenizer': directory / 'tokenizer.json'}
    result.trace.write_jsonl(paths['trace'])
    write_trajectories(paths['trajectories'], trajectories_from_result(result, requests))
    tok.save(str(paths['tokenizer']))
    return paths
