"""The same seed gives the same trajectories for any ``batch_size``, ``max_concurrency`` and mode
(issue 40: ``--batch-size 4`` instead of 16 gave ``identical 0, different 8`` at the same seed).

A request's samples depend on the run's seed and the request (``mtflow.core.seeds``), not on
the batch it shared: checked through ``mtflow run`` over the scripted backend drawing its lines
by seed (``sample: true``; hypothesis over batch sizes, concurrency, mode and copies per prompt)
and over the HF backend with a tiny random model (sampled tokens and their logprobs)."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any, Dict, List

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtflow.cli import main
from mtflow.run.trajectories import read_trajectories

ROOT = Path(__file__).resolve().parents[1]
#: what makes two trajectories the same
SAME = ('messages', 'response_token_ids', 'rollout_logprobs', 'finish_reason', 'num_turns', 'reward')


def _run(cfg: Path, out: Path, *flags: str) -> Dict[str, Dict[str, Any]]:
    assert main(['run', str(cfg), '--out', str(out), '-q', *flags]) == 0
    return {uuid: {k: getattr(t, k) for k in SAME} for uuid, t in read_trajectories(out / 'trajectories.jsonl').items()}


def _flags(batch_size: int, mode: str, max_concurrency: int, copies: int) -> List[str]:
    flags = ['--batch-size', str(batch_size), '-n', str(copies), '--mode', mode]
    return flags + (['--max-concurrency', str(max_concurrency)] if mode == 'async' else [])


@pytest.fixture(scope='module')
def scripted_run(tmp_path_factory):
    """The guess-the-number game (its episodes seeded per request) played by scripted guesses
    drawn by seed: a stand-in for a sampling model that is fast enough for many runs."""
    d = tmp_path_factory.mktemp('seeds')
    guesses = [{'content': f'My guess is {g}.', 'token_ids': [900 + k, g], 'logprobs': [-0.5, -0.25 * k]}
               for k, g in enumerate((50, 25, 75, 12, 88, 37, 62, 6, 94, 43, 81, 19))]
    (d / 'guesses.jsonl').write_text(''.join(json.dumps(g) + '\n' for g in guesses))
    (d / 'run.yaml').write_text(textwrap.dedent(f'''\
        scheduler: {ROOT / 'schedulers' / 'guess_number.yaml'}
        backend: scripted
        model: guesses.jsonl
        backend_options: {{sample: true}}
        limit: 6
        max_turns: 6
        seed: 0
        request_config: {{logprobs: true, temperature: 1.0}}
        '''))
    counter = iter(range(10 ** 6))
    return lambda *flags: _run(d / 'run.yaml', d / f'out{next(counter)}', *flags)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch_size=st.integers(1, 13), mode=st.sampled_from(['lockstep', 'async']), max_concurrency=st.integers(1, 8),
       copies=st.sampled_from([1, 2, 3]))
def test_the_scripted_samples_of_a_request_follow_the_seed_not_the_batch(scripted_run, batch_size, mode,
                                                                          max_concurrency, copies):
    reference = scripted_run(*_flags(1, 'lockstep', 1, copies))
    assert scripted_run(*_flags(batch_size, mode, max_concurrency, copies)) == reference


def test_another_seed_samples_other_lines_and_copies_of_a_prompt_differ(scripted_run):
    seed0, seed1 = scripted_run('-n', '2'), scripted_run('-n', '2', '--seed', '1')
    assert seed0.keys() == seed1.keys() and len(seed0) == 12
    assert sum(seed0[u]['messages'] != seed1[u]['messages'] for u in seed0) >= 10, 'the seed chooses the samples'
    copies = [(seed0[f'guess-0{i}#0']['messages'], seed0[f'guess-0{i}#1']['messages']) for i in range(6)]
    assert sum(a != b for a, b in copies) >= 5, "a GRPO group's copies sample independently"


@pytest.fixture(scope='module')
def hf_run(tmp_path_factory):
    """A tiny random Qwen2 sampling at temperature 1 (top_p 0.9): every token is a draw."""
    pytest.importorskip('transformers')
    from tests.tiny_model import make_model, make_tokenizer

    d = tmp_path_factory.mktemp('seeds-hf')
    tok = make_tokenizer()
    make_model(tok, seed=3).save_pretrained(d / 'model')
    tok.save_pretrained(d / 'model')
    (d / 'sched.py').write_text(textwrap.dedent('''\
        import mtflow


        class Again(mtflow.Scheduler):
            def step(self, infer_request, response_choice, current_turn):
                infer_request.messages.append({'role': 'user', 'content': f'again {current_turn}'})
                return {'infer_request': infer_request}
        '''))
    (d / 'prompts.jsonl').write_text(''.join(json.dumps({'uuid': f'p{i}', 'prompt': f'count to {i}' + ' and on' * i})
                                             + '\n' for i in range(5)))
    (d / 'run.yaml').write_text(textwrap.dedent(f'''\
        scheduler: sched.py:Again
        backend: hf
        model: {d / 'model'}
        dataset: prompts.jsonl
        max_turns: 3
        seed: 0
        request_config: {{max_tokens: 5, temperature: 1.0, top_p: 0.9, logprobs: true}}
        '''))
    counter = iter(range(10 ** 6))
    return lambda *flags: _run(d / 'run.yaml', d / f'out{next(counter)}', *flags)


@pytest.mark.parametrize('batch_size, mode, max_concurrency, copies', [
    (4, 'lockstep', 1, 2), (10, 'lockstep', 1, 2), (3, 'async', 2, 2), (10, 'async', 10, 2)])
def test_the_hf_samples_of_a_request_follow_the_seed_not_the_batch(hf_run, batch_size, mode, max_concurrency, copies):
    """Batch 1, lockstep, is the reference: in a batch the rows are padded and share ``generate``
    calls with others, and in async mode the dynamic batcher makes batches by timing."""
    reference = hf_run(*_flags(1, 'lockstep', 1, copies))
    got = hf_run(*_flags(batch_size, mode, max_concurrency, copies))
    assert got.keys() == reference.keys()
    for uuid in reference:
        assert got[uuid]['response_token_ids'] == reference[uuid]['response_token_ids'], uuid
        assert got[uuid]['messages'] == reference[uuid]['messages'], uuid
        for a, b in zip(sum(got[uuid]['rollout_logprobs'], []), sum(reference[uuid]['rollout_logprobs'], [])):
            assert a == pytest.approx(b, abs=1e-4), uuid
    assert hf_run(*_flags(1, 'lockstep', 1, copies), '--seed', '1') != reference, 'the seed chooses the samples'
