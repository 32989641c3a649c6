"""Shared pieces of the context-budget tests: a scheduler whose observations grow the prompt by
hundreds of tokens a turn, a word counter (the scripted backend's tokens are words), and a
``rollout_fn`` wrapper that records every prompt it was sent and the ``max_tokens`` it was given."""
from __future__ import annotations

from typing import Any, List

from mtflow import RolloutInferRequest, Scheduler

OBS_WORDS = 200


def count_words(request: Any) -> int:
    """The prompt's tokens when a token is a word (the scripted backend's outputs are)."""
    return sum(len(str(m.get('content') or '').split()) for m in request.messages)


class GrowingObservations(Scheduler):
    """Every step answers with a tool message of ``OBS_WORDS`` words (turn-numbered)."""

    def __init__(self, max_turns: int = 8, words: int = OBS_WORDS) -> None:
        super().__init__(max_turns=max_turns)
        self.words = words

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> dict:
        obs = ' '.join(f'o{current_turn}' for _ in range(self.words))
        infer_request.messages.append({'role': 'tool', 'content': obs})
        return {'infer_request': infer_request}


class Recording:
    """Wraps a ``rollout_fn``: every request's prompt size and each call's ``max_tokens``."""

    def __init__(self, inner: Any, counter: Any = count_words) -> None:
        self.inner = inner
        self.counter = counter
        self.prompts: List[tuple] = []  # (uuid, prompt tokens, max_tokens)
        self.outputs: List[tuple] = []  # (uuid, sampled ids)

    def __call__(self, requests: List[Any], request_config: Any) -> List[Any]:
        max_tokens = request_config.get('max_tokens') if isinstance(request_config, dict) else \
            getattr(request_config, 'max_tokens', None)
        for r in requests:
            self.prompts.append((r.uuid, self.counter(r), max_tokens))
        outs = self.inner(requests, request_config)
        for r, o in zip(requests, outs):
            self.outputs.append((r.uuid, list(o.response.choices[0].token_ids or [])))
        return outs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def requests(n: int = 2) -> List[RolloutInferRequest]:
    return [RolloutInferRequest(messages=[{'role': 'system', 'content': 'You are a careful agent.'},
                                          {'role': 'user', 'content': f'Task {k}: explore the logs.'}],
                                uuid=f'r{k}') for k in range(n)]
