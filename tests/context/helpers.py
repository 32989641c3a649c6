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

    def __init__(self, max_turns: int = 8, words: int = OBS_WORDS, **kw: Any) -> None:
        super().__init__(max_turns=max_turns, **kw)
        self.words = words

    def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> dict:
        obs = ' '.join(f'o{current_turn}' for _ in range(self.words))
        infer_request.messages.append({'role': 'tool', 'content': obs})
        return {'infer_request': infer_request}


class GrowingNoLengthStop(GrowingObservations):
    """:class:`GrowingObservations` that goes on after a reply cut at ``max_tokens`` (a tiny random
    model rarely stops by itself); it stops at ``max_turns`` only (reason ``check_finished``)."""

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        return current_turn >= self.max_turns


class Recording:
    """Wraps a ``rollout_fn``: every request's prompt size and each call's ``max_tokens``."""

    def __init__(self, inner: Any, counter: Any = count_words) -> None:
        self.inner = inner
        self.counter = counter
        self.prompts: List[tuple] = []  # (uuid, prompt tokens, max_tokens)
        self.outputs: List[tuple] = []  # (uuid, sampled ids)
        self.prompt_ids: List[tuple] = []  # (uuid, prompt ids), backends with a token prompter

    def __call__(self, requests: List[Any], request_config: Any) -> List[Any]:
        max_tokens = request_config.get('max_tokens') if isinstance(request_config, dict) else \
            getattr(request_config, 'max_tokens', None)
        prompter = getattr(self.inner, 'prompter', None)
        for r in requests:
            self.prompts.append((r.uuid, self.counter(r), max_tokens))
            if prompter is not None:  # the exact ids this turn is generated from
                self.prompt_ids.append((r.uuid, list(prompter.plan(r).ids)))
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


def check_segments_exact(output: Any, uuid: str, backend: Recording) -> List[dict]:
    """Every training segment of ``output`` is exactly what the model saw and sampled: each
    turn's prompt ids are a prefix of the segment's ``prompt_ids + response_ids``, the ids sampled
    at that turn follow it there, with loss mask 1, and the segment's mask-1 ids are exactly the
    ids sampled in its turns. Returns the flat samples."""
    from mtflow.accounting.segments_split import training_samples

    samples = training_samples(output, uuid=uuid)
    prompts = [ids for u, ids in backend.prompt_ids if u == uuid]
    sampled = [ids for u, ids in backend.outputs if u == uuid]
    assert len(prompts) == len(sampled) == output.rollout_infos['num_turns']
    for sample in samples:
        first, last = sample['turns']
        full = sample['prompt_ids'] + sample['response_ids']
        mask = [0] * len(sample['prompt_ids']) + sample['loss_mask']
        assert sample['exact'] is True
        trained = []
        for t in range(first, last + 1):
            prompt, ids = prompts[t - 1], sampled[t - 1]
            assert full[:len(prompt)] == prompt, (uuid, sample['segment'], t)
            assert full[len(prompt):len(prompt) + len(ids)] == ids, (uuid, sample['segment'], t)
            assert set(mask[len(prompt):len(prompt) + len(ids)]) <= {1}
            trained += ids
        assert [i for i, m in zip(sample['response_ids'], sample['loss_mask']) if m] == trained
        assert len(sample['logprobs']) in (0, len(trained))
    return samples


def scripted_backend() -> Any:
    """The scripted model of these tests (for Ray actors, which build their own)."""
    from mtflow.backends.scripted import ScriptedBackend

    return ScriptedBackend(outputs=[{'content': 'I will look further', 'token_ids': [1, 2, 3, 4]}], cycle=True)


def growing_scheduler(tokenizer: Any = None) -> GrowingObservations:
    return GrowingObservations(max_turns=8)
