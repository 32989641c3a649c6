"""The ``context:`` block of a run config, through ``mtflow run``: the budget reaches the
executor (compactions in the trace and in the trajectories, every prompt inside it), and a
context larger than the model's is one line naming the key, before anything is rolled out."""
from __future__ import annotations

import json
import textwrap

import pytest

from mtflow.cli import main
from mtflow.core.trace import Trace
from mtflow.run.trajectories import read_trajectories


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv('MTFLOW_CACHE', str(tmp_path / 'cache'))
    line = {'content': 'I will look further', 'token_ids': [11, 12, 13, 14]}
    (tmp_path / 'script.jsonl').write_text(json.dumps(line) + '\n')
    prompts = [{'uuid': f'p{i}', 'prompt': f'Task {i}: explore the logs.'} for i in range(2)]
    (tmp_path / 'prompts.jsonl').write_text(''.join(json.dumps(p) + '\n' for p in prompts))
    return tmp_path


def _config(tmp_path, context: str, backend: str = 'scripted', model: str = 'script.jsonl', extra: str = ''):
    (tmp_path / 'run.yaml').write_text(textwrap.dedent(f'''\
        scheduler: tests.context.helpers:GrowingObservations
        backend: {backend}
        model: {model}
        backend_options: {{cycle: true}}
        dataset: prompts.jsonl
        out: out
        max_turns: 8
        request_config: {{max_tokens: 50}}
        ''') + extra + context)


@pytest.mark.parametrize('mode', ['lockstep', 'async'])  # async mode streams (mtflow/run/streamed.py)
def test_context_block_compacts_through_mtflow_run(project, capsys, mode):
    _config(project, 'context: {context_length: 1000, policy: drop_observations, keep_last_turns: 1, '
            'count_tokens: words}\n', extra=f'mode: {mode}\n')
    assert main(['run', 'run.yaml', '-q', '--no-progress']) == 0
    trajectories = read_trajectories(project / 'out' / 'trajectories.jsonl')
    assert sorted(t.finish_reason for t in trajectories.values()) == ['max_turns', 'max_turns']
    for traj in trajectories.values():
        infos = traj.rollout_infos
        assert infos['compactions'] == 1 and infos['context_segments'][0]['turns'] == [1, 5]
    events = Trace.read_jsonl(project / 'out' / 'trace.jsonl').events
    assert sum(1 for e in events if e.trigger == 'compact') == 2
    assert all(e.extra['compaction']['prompt_tokens_after'] <= 950 for e in events if e.src == 'compacting')
    summary = json.loads((project / 'out' / 'summary.json').read_text())
    assert summary['context'] == {'compactions': 2, 'compacted_requests': 2, 'max_per_request': 1,
                                  'context_full': 0, 'length_total': 0}


def test_the_html_page_lists_the_compacted_requests(project, capsys):
    _config(project, 'context: {context_length: 1000, policy: drop_observations, keep_last_turns: 1, '
            'count_tokens: words}\n')
    assert main(['run', 'run.yaml', '-q', '--no-progress']) == 0
    assert main(['trace', 'html', 'out/trace.jsonl', '-o', 'page.html']) == 0
    page = (project / 'page.html').read_text()
    assert 'Compacted requests (2)' in page and 'drop_observations' in page
    events = Trace.read_jsonl(project / 'out' / 'trace.jsonl').events
    for e in events:
        if e.src == 'compacting':
            c = e.extra['compaction']
            assert f"{c['prompt_tokens_before']} → {c['prompt_tokens_after']}" in page
    _config(project, 'context: {context_length: 100000, count_tokens: words}\n')  # nothing to compact
    assert main(['run', 'run.yaml', '-q', '--no-progress', '--overwrite']) == 0
    assert main(['trace', 'html', 'out/trace.jsonl', '-o', 'plain.html']) == 0
    assert 'Compacted requests' not in (project / 'plain.html').read_text()


def test_the_summary_counts_context_full(project, capsys):
    _config(project, 'context: {context_length: 1000, count_tokens: words}\n')
    assert main(['run', 'run.yaml', '--no-progress']) == 0
    summary = json.loads((project / 'out' / 'summary.json').read_text())
    assert summary['finish_reasons'] == {'context_full': 2}
    assert summary['context']['context_full'] == 2 and summary['context']['compactions'] == 0
    assert 'context_full 2' in capsys.readouterr().out


def test_a_bad_context_block_is_one_line_naming_the_key(project, capsys):
    _config(project, 'context: {context_lenght: 1000}\n')
    assert main(['run', 'run.yaml', '-q', '--no-progress']) == 2
    err = capsys.readouterr().err
    assert 'context_lenght' in err and 'run.yaml' in err


def test_context_length_over_the_models_is_an_error_at_load_time(project, capsys):
    pytest.importorskip('transformers')
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    make_model(tok).save_pretrained(project / 'tiny')  # max_position_embeddings=512
    tok.save_pretrained(project / 'tiny')
    (project / 'run.yaml').write_text(textwrap.dedent('''\
        scheduler: tests.context.helpers:GrowingObservations
        backend: hf
        model: tiny
        dataset: prompts.jsonl
        out: out
        request_config: {max_tokens: 8}
        context:
          context_length: 4096
        '''))
    assert main(['run', 'run.yaml', '-q', '--no-progress']) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert any('context.context_length: 4096 is larger than the model\'s context (512 tokens' in line for line in err)
    assert any('run.yaml:7' in line for line in err)
    assert not (project / 'out' / 'trajectories.jsonl').exists() or \
        (project / 'out' / 'trajectories.jsonl').read_text() == ''
