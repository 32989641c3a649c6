"""``mtflow check-tokens`` covers training segments: a compacted conversation through a real
tiny model passes the segment check, and a segment whose ids are not what was sampled fails it."""
from __future__ import annotations

import copy
import json

import pytest

pytest.importorskip('transformers')

from mtflow import ContextBudget  # noqa: E402
from mtflow.backends.conformance import _check_segments, check_tokens  # noqa: E402
from mtflow.backends.hf import HFBackend  # noqa: E402
from mtflow.cli import main  # noqa: E402

from tests.context.helpers import GrowingNoLengthStop, requests  # noqa: E402
from tests.tiny_model import make_model, make_tokenizer  # noqa: E402


@pytest.fixture(scope='module')
def backend():
    tok = make_tokenizer()
    return HFBackend(make_model(tok, max_position_embeddings=4096), tok)


def test_compacted_segments_pass_the_check(backend):
    budget = ContextBudget(context_length=300, policy='drop_observations', keep_last_turns=1, max_tokens=8)
    report = check_tokens(backend, scheduler=GrowingNoLengthStop(max_turns=6, words=30), requests=requests(2),
                          max_turns=6, context=budget, temperature=0)
    assert report.ok, report.problems
    assert report.passed['segments'] >= 4  # two requests, at least two segments each
    assert report.passed['prefix'] >= 2


def test_a_wrong_segment_fails_the_check(backend):
    from mtflow.backends.conformance import TemplateReport, _Probe
    from mtflow import Executor, RequestConfig
    from mtflow.accounting.token_record import RecordAccounting

    probe = _Probe(backend)
    budget = ContextBudget(context_length=300, policy='drop_observations', keep_last_turns=1, max_tokens=8,
                           count_tokens=backend.count_prompt_tokens)
    result = Executor(GrowingNoLengthStop(max_turns=6, words=30), probe, RequestConfig(max_tokens=8, temperature=0),
                      accounting=RecordAccounting(), context=budget).run(requests(1))
    out = result.outputs[0]
    good = TemplateReport('t', 'exact')
    _check_segments(good, 'r0', probe.turns['r0'], out)
    assert good.passed['segments'] >= 2 and not good.failed['segments']
    bad_out = copy.deepcopy(out)
    bad_out.rollout_infos['context_segments'][0]['response_token_ids'][0][0] += 1
    bad = TemplateReport('t', 'exact')
    _check_segments(bad, 'r0', probe.turns['r0'], bad_out)
    assert bad.failed['segments'] == 1 and 'segment 0' in bad.problems[0]


def test_the_command_checks_segments(tmp_path, monkeypatch, capsys):
    tok = make_tokenizer()
    make_model(tok, max_position_embeddings=4096).save_pretrained(tmp_path / 'tiny')
    tok.save_pretrained(tmp_path / 'tiny')
    (tmp_path / 'p.jsonl').write_text(json.dumps({'uuid': 'p0', 'prompt': 'Task: explore the logs.'}) + '\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv('MTFLOW_CACHE', str(tmp_path / 'cache'))
    argv = ['check-tokens', '--model', str(tmp_path / 'tiny'), '--scheduler', 'tests.context.helpers:GrowingNoLengthStop',
            '--dataset', 'p.jsonl', '--limit', '1', '--max-turns', '6', '--temperature', '0',
            '--context', 'context_length=1000', '--context', 'max_tokens=8', '--context', 'policy=drop_observations',
            '--context', 'keep_last_turns=1']
    assert main(argv) == 0
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if 'segments' in line][0]
    assert 'ok' in row and ' 0 ' in row
    assert main(argv[:5] + ['--context', 'policy=shrink']) == 2
