"""Training several policies from one run (docs/multi-agent.md): samples carry their role, policy
id and train flag, a role's advantage group is (prompt, role), and the plain loop steps each policy
on its own samples only."""
from __future__ import annotations

import pytest

torch = pytest.importorskip('torch')

from mtflow import Executor, MultiTurnRolloutError, RequestConfig, RolloutInferRequest  # noqa: E402
from mtflow.roles import EpisodeScheduler, PolicyRouter, Role, episode_requests  # noqa: E402
from mtflow.train import by_policy, samples_from_result  # noqa: E402
from mtflow.train.loop import reference_loop  # noqa: E402
from benchmarks.multi_policy_curve import Relay  # noqa: E402


def setup(train_listener: bool = True):
    from mtflow.backends.hf import HFBackend
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    models = {'a': make_model(tok, seed=0), 'b': make_model(tok, seed=1)}
    backends = {pid: HFBackend(m, tok, default_max_tokens=4, seed=0) for pid, m in models.items()}
    roles = [Role('speaker', policy='a'), Role('listener', policy='b', train=train_listener)]
    parts = []
    executor = Executor(EpisodeScheduler(lambda info: Relay(parts), roles), PolicyRouter(backends, roles),
                        RequestConfig(max_tokens=4, temperature=1.0, logprobs=True), max_turns=4)
    def batch(step: int = 0):
        tasks = [RolloutInferRequest(messages=[{'role': 'user', 'content': f'count to {g}'}], uuid=f's{step}p{g}')
                 for g in range(2)]
        return episode_requests(tasks, roles, copies=3)

    return models, roles, executor, batch


def test_samples_carry_role_and_policy_and_group_per_prompt_and_role():
    _, roles, executor, batch = setup(train_listener=False)
    requests = batch()
    samples = samples_from_result(executor.run(requests), requests)
    assert {(s.role, s.policy, s.train) for s in samples} == {('speaker', 'a', True), ('listener', 'b', False)}
    assert sorted({s.group for s in samples}) == ['s0p0/listener', 's0p0/speaker', 's0p1/listener', 's0p1/speaker']
    assert {pid: len(ss) for pid, ss in by_policy(samples).items()} == {'a': 6}  # the untrained role left out
    again = batch(1)
    assert {s.group for s in samples_from_result(executor.run(again), again, group_by='prompt')} == {'s1p0', 's1p1'}
    with pytest.raises(MultiTurnRolloutError, match='came with messages.*a role request is used once'):
        executor.run(requests)  # the same role requests again


def test_the_loop_steps_each_policy_on_its_own_samples():
    models, _, executor, batch = setup()
    before = {pid: [p.detach().clone() for p in m.parameters()] for pid, m in models.items()}
    seen = []
    history = reference_loop(executor, models, {pid: torch.optim.Adam(m.parameters(), lr=1e-2)
                                                for pid, m in models.items()},
                             [batch(0), batch(1)], row_len=256,
                             on_batch=lambda batch, rows, samples: seen.append({s.policy for s in samples}))
    assert [(h.step, h.policy) for h in history] == [(0, 'a'), (0, 'b'), (1, 'a'), (1, 'b')]
    assert seen == [{'a'}, {'b'}, {'a'}, {'b'}]  # each step's loss saw one policy's samples only
    assert all(h.samples == 6 and h.max_logprob_gap < 1e-4 for h in history)  # exact: the sampled ids, scored
    for pid, model in models.items():
        assert any(not torch.equal(a, b) for a, b in zip(before[pid], model.parameters()))
    with pytest.raises(ValueError, match='optimizer must map the same policy ids'):
        reference_loop(executor, models, {'a': None}, [batch(2)], row_len=256)


def test_a_trained_policy_the_models_do_not_map_is_refused_and_one_model_skips_untrained_roles():
    """A trained role's policy missing from ``model`` was dropped without a word (that policy never
    trained); one model (not a dict) was stepped on the untrained roles' trajectories too."""
    models, _, executor, batch = setup()
    with pytest.raises(ValueError, match=r"trained roles play policies \['b'\], which model does not map"):
        reference_loop(executor, {'a': models['a']}, {'a': torch.optim.Adam(models['a'].parameters(), lr=1e-2)},
                       [batch(0)], row_len=256)
    models, _, executor, batch = setup(train_listener=False)
    seen = []
    reference_loop(executor, models['a'], torch.optim.Adam(models['a'].parameters(), lr=1e-2), [batch(1)],
                   row_len=256, on_batch=lambda batch, rows, samples: seen.append({s.role for s in samples}))
    assert seen == [{'speaker'}]
