"""Training samples come straight from the accounting: for multi-turn tool-use rollouts of a real
(tiny) model, ``prompt_ids + completion_ids`` is the token record's sequence, the mask-1 ids are
exactly the sampled ids with their logprobs and versions; compacted trajectories give one sample
per segment; what cannot be exact is refused naming the request and the turn."""
from __future__ import annotations

import json
import os

import pytest

from mtflow import ContextBudget, Executor, RequestConfig
from mtflow.backends.scripted import ScriptedBackend
from mtflow.run.trajectories import trajectories_from_result, write_trajectories
from mtflow.train import SampleError, read_samples, samples_from_output, samples_from_result

from tests.train.helpers import ToolEveryTurn, even_share, prompts, tiny_backend, tool_run

pytest.importorskip('torch')


def _sampled(record):
    return [t for turn in record.turns for t in turn.sampled]


def test_samples_of_a_tool_run_are_the_token_records_ids_masks_and_logprobs():
    result, requests = tool_run(tiny_backend(), groups=2, size=3, max_turns=3)
    samples = samples_from_result(result, requests)
    assert [s.uuid for s in samples] == [r.uuid for r in requests]
    assert [s.group for s in samples] == ['p0'] * 3 + ['p1'] * 3
    for sample, request in zip(samples, requests):
        record = request.token_record
        assert sample.input_ids == record.sequence()  # the whole sequence the model saw, glue included
        trained = [t for t, m in zip(sample.completion_ids, sample.loss_mask) if m]
        assert trained == _sampled(record)
        assert [lp for lp, m in zip(sample.logprobs, sample.loss_mask) if m] == \
            [v for turn in record.turns for v in turn.logprobs]
        assert [v for v, m in zip(sample.versions, sample.loss_mask) if m] == [0] * len(trained)
        assert all(v is None for v, m in zip(sample.versions, sample.loss_mask) if not m)
        assert sample.turns == (1, 3) and sample.segment == 0 and sample.segments == 1
        assert [t for t, m in zip(sample.token_turns, sample.loss_mask) if m] == [1] * 6 + [2] * 6 + [3] * 6
        assert sample.turn_rewards == {t + 1: even_share(turn.sampled) for t, turn in enumerate(record.turns)}
        assert sample.reward == even_share(trained)
        # the tool messages are glue: present in the ids, never trained
        glue = record.summary()['glue_ids']
        assert len(glue) == 2 and sum(sample.loss_mask) == len(sample.completion_ids) - sum(map(len, glue))


def test_samples_read_back_from_trajectories_jsonl_are_the_same(tmp_path):
    result, requests = tool_run(tiny_backend(seed=1), groups=1, size=2, max_turns=2)
    path = tmp_path / 'trajectories.jsonl'
    write_trajectories(path, trajectories_from_result(result, requests))
    assert list(read_samples(path)) == samples_from_result(result, requests)


def test_a_compacted_trajectory_is_one_sample_per_segment_sharing_its_reward():
    from tests.context.helpers import GrowingNoLengthStop, requests as long_requests

    backend = tiny_backend(max_position_embeddings=4096)
    budget = ContextBudget(context_length=900, policy='drop_observations', keep_last_turns=1)
    ex = Executor(GrowingNoLengthStop(max_turns=6, words=60), backend,
                  RequestConfig(max_tokens=8, temperature=1.0, logprobs=True), context=budget)
    ex.set_policy_version(3)
    reqs = long_requests(1)
    out = ex.run(reqs).outputs[0]
    assert out.rollout_infos['compactions'] >= 1
    samples = samples_from_output(out, 'r0', reward=0.5)
    assert len(samples) == out.rollout_infos['compactions'] + 1
    assert [s.segment for s in samples] == list(range(len(samples)))
    assert all(s.reward == 0.5 and s.group == 'r0' and s.segments == len(samples) for s in samples)
    assert samples[0].turns[0] == 1 and samples[-1].turns[1] == 6
    assert all(a.turns[1] + 1 == b.turns[0] for a, b in zip(samples, samples[1:]))
    # the last segment is the token record's own sequence; every segment trains 8 ids per turn
    assert samples[-1].input_ids == reqs[0].token_record.sequence()
    for s in samples:
        assert s.trained_tokens == 8 * (s.turns[1] - s.turns[0] + 1)
        assert {v for v in s.versions if v is not None} == {3}


def test_a_backend_without_a_token_record_is_refused_naming_the_request_and_turn():
    model = ScriptedBackend(outputs=[{'content': 'hello there', 'token_ids': [5, 6]}], cycle=True)
    reqs = prompts(1, 1)
    out = Executor(ToolEveryTurn(max_turns=2), model, RequestConfig(max_tokens=4)).run(reqs).outputs[0]
    out.rollout_infos['reward'] = 1.0
    with pytest.raises(SampleError) as err:
        samples_from_output(out, reqs[0].uuid)
    assert err.value.uuid == 'p0#0' and err.value.turn == 1 and err.value.field == 'prompt_ids'
    assert str(err.value).startswith("request p0#0, turn 1, field 'prompt_ids': no prompt ids")


def _line(**changes):
    line = {'uuid': 'q#0', 'reward': 1.0, 'response_token_ids': [[7, 8], [9]], 'response_loss_mask': [[1, 1], [1]],
            'rollout_logprobs': [[-0.5, -0.25], [-1.0]],
            'rollout_infos': {'num_turns': 2, 'policy_versions': [4, 5],
                              'token_record': {'prompt_ids': [1, 2], 'glue_ids': [[3]], 'exact': True,
                                               'rendered_turns': [], 'template_unstable_turns': []}}}
    for key, value in changes.items():
        if key in line['rollout_infos']['token_record']:
            line['rollout_infos']['token_record'][key] = value
        else:
            line[key] = value
    return json.loads(json.dumps(line))


def test_a_line_gives_ids_glue_mask_logprobs_and_versions_in_place():
    (s, ) = samples_from_output(_line())
    assert (s.prompt_ids, s.completion_ids, s.loss_mask) == ([1, 2], [7, 8, 3, 9], [1, 1, 0, 1])
    assert s.logprobs == [-0.5, -0.25, 0.0, -1.0]
    assert s.versions == [4, 4, None, 5] and s.group == 'q' and s.turns == (1, 2)


def test_a_turn_rendered_from_text_is_refused_at_that_turn():
    with pytest.raises(SampleError, match=r'request q#0, turn 2, field .token_record.: the prompt of this turn'):
        samples_from_output(_line(exact=False, rendered_turns=[2]))


def test_logprobs_that_do_not_cover_the_trained_tokens_are_refused():
    with pytest.raises(SampleError, match='2 rollout logprobs for 3 trained tokens'):
        samples_from_output(_line(rollout_logprobs=[[-0.5, -0.25]]))


def test_a_trajectory_without_a_reward_is_refused():
    with pytest.raises(SampleError, match=r"request q#0, field 'reward'"):
        samples_from_output(_line(reward=None))


def test_versions_of_continued_turns_are_placed_per_run_of_trained_tokens():
    # turn 2 continued turn 1's message after an inline observation (mask 0), then turn 3 in a new message
    line = _line(response_token_ids=[[7, 8, 50, 51, 9], [10]], response_loss_mask=[[1, 1, 0, 0, 1], [1]],
                 rollout_logprobs=[[-1.0, -1.0, -1.0], [-1.0]], glue_ids=[[3]])
    line['rollout_infos'].update(num_turns=3, policy_versions=[1, 2, 2])
    (s, ) = samples_from_output(line)
    assert s.versions == [1, 1, None, None, 2, None, 2]
    assert s.token_turns == [1, 1, None, None, 2, None, 3]
    line['rollout_infos']['policy_versions'] = [1, 2, 3]
    line['response_loss_mask'] = [[1, 1, 1, 1, 1], [1]]  # the scheduler trained the observation: no runs left
    line['rollout_logprobs'] = [[-1.0] * 5, [-1.0]]
    with pytest.raises(SampleError, match='turn 1, field .policy_versions.: turns 1-3 were sampled by versions'):
        samples_from_output(line)


def test_a_real_mtflow_run_directory_gives_exact_samples_and_failed_requests_are_named(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from mtflow.run.trajectories import read_trajectories
    from tests.swift.tiny_grpo import tiny_setup

    root = Path(__file__).resolve().parents[2]
    model, _ = tiny_setup(tmp_path / 'tiny')
    out = tmp_path / 'run'
    cmd = [sys.executable, '-m', 'mtflow', 'run', str(root / 'configs/scripted_tools.yaml'), '--backend', 'hf',
           '--model', str(model), '--set', 'scheduler=tests.train.helpers:ToolEveryTurn', '--set',
           'scheduler_args.max_turns=2', '--set', 'request_config.max_tokens=5', '--set', 'request_config.logprobs=true',
           '-n', '2', '--out', str(out)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, 'PYTHONPATH': str(root)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = read_trajectories(out / 'trajectories.jsonl')
    samples = list(read_samples(out / 'trajectories.jsonl'))
    assert len(samples) == len(lines) == 8 and {s.group for s in samples} == {'mul', 'sum', 'div', 'bad'}
    for s in samples:
        line = lines[s.uuid]
        assert s.prompt_ids == line.rollout_infos['token_record']['prompt_ids']
        assert s.turns == (1, 2) and s.trained_tokens == 2 * 5 and s.reward == line.reward
        assert [t for t, m in zip(s.completion_ids, s.loss_mask) if m] == sum(line.response_token_ids, [])
    # a failed request is named, or left out on request
    path = tmp_path / 'failed.jsonl'
    first = lines[samples[0].uuid].to_dict()
    path.write_text(json.dumps({**first, 'finish_reason': 'error'}) + '\n')
    with pytest.raises(SampleError, match=rf"request {samples[0].uuid}, field 'finish_reason': the request failed"):
        list(read_samples(path))
    assert list(read_samples(path, failed='skip')) == []


class EditsTheFirstReply(ToolEveryTurn):
    """Rewrites the first tool message at the step of turn 2: the prompt of turn 3 no longer extends
    the ids turns 1 and 2 were generated from."""

    def step(self, infer_request, response_choice, current_turn):
        out = super().step(infer_request, response_choice, current_turn)
        if current_turn == 2:
            infer_request.messages[2]['content'] = 'forty-two'
        return out


def test_an_edited_history_is_refused_at_the_first_turn_it_reached_naming_what_changed():
    requests = prompts(1, 1)
    ex = Executor(EditsTheFirstReply(max_turns=4), tiny_backend(),
                  RequestConfig(max_tokens=6, temperature=1.0, logprobs=True))
    result = ex.run(requests)
    assert result.ok, result.failures
    restart = result.outputs[0].rollout_infos['token_record_restart']
    assert restart['turn'] == 3 and restart['why'] == 'history_changed'
    with pytest.raises(SampleError) as err:
        samples_from_result(result, requests)
    assert err.value.uuid == 'p0#0' and err.value.turn == 3 and err.value.field == 'messages'
    assert "message 3 (tool): field 'content' changed from " in str(err.value)
    assert "to 'forty-two'" in str(err.value)
    # the same from the run's trajectory line (what read_samples sees)
    (line, ) = [t.to_dict() for t in trajectories_from_result(result, requests)]
    with pytest.raises(SampleError, match=r"request p0#0, turn 3, field 'messages': this turn's prompt was rendered"):
        samples_from_output(line)


def test_what_changed_names_an_edited_reply_by_its_turn_and_removed_messages():
    from mtflow.backends.tokens import what_changed

    seen = [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'a'}, {'role': 'user', 'content': 'go'},
            {'role': 'assistant', 'content': 'b'}]
    assert what_changed(seen, seen[:2] + [seen[2], {'role': 'assistant', 'content': 'B'}], first_turn=1) == \
        "message 4 (assistant, the reply of turn 2): field 'content' changed from 'b' to 'B'"
    assert what_changed(seen, seen[:1]) == 'message 2 (assistant, the reply of turn 1) and the 2 after it were removed'
    assert what_changed(seen, seen[:3] + [{'role': 'assistant', 'content': 'b!'}]) == \
        "message 4 (assistant, the reply of turn 2): text was appended to its content after the model saw it: '!'"
