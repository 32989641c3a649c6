"""Replay of an ``hf`` run (a tiny random Qwen2 model, and the embedded SmolLM2 in a slow test):
the replay backend rebuilds the exact-id token record with the run's tokenizer, so a replay
against the unchanged config is identical, ids included."""
import json
from pathlib import Path

import pytest

pytest.importorskip('transformers')

from mtflow.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope='module')
def tiny_dir(tmp_path_factory):
    from tests.tiny_model import make_model, make_tokenizer

    d = tmp_path_factory.mktemp('tiny-qwen2')
    tok = make_tokenizer()
    make_model(tok, seed=2).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _config(tmp: Path, model: str, n: int, max_tokens: int) -> Path:
    data = [json.loads(l) for l in (ROOT / 'mtflow' / 'data' / 'prompts.jsonl').read_text().splitlines()][:n]
    (tmp / 'data.jsonl').write_text(''.join(json.dumps(d) + '\n' for d in data))
    cfg = tmp / 'cfg.yaml'
    cfg.write_text(f'scheduler: {ROOT / "schedulers" / "guess_number.yaml"}\nbackend: hf\nmodel: {model}\n'
                   f'dataset: {tmp / "data.jsonl"}\nmax_turns: 3\nbatch_size: 4\nseed: 0\n'
                   f'request_config: {{max_tokens: {max_tokens}, temperature: 0, logprobs: true}}\n')
    return cfg


def _replay_is_identical(tmp: Path, cfg: Path, capsys) -> dict:
    assert main(['run', str(cfg), '-q', '--out', str(tmp / 'orig')]) == 0
    assert main(['replay', str(tmp / 'orig'), '--out', str(tmp / 'same'), '-q']) == 0
    capsys.readouterr()
    code = main(['diff', str(tmp / 'orig'), str(tmp / 'same')])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = [json.loads(l) for l in (tmp / 'same' / 'trajectories.jsonl').read_text().splitlines()]
    assert all(l['response_token_ids'] and l['num_turns'] >= 2 for l in lines)
    return json.loads((tmp / 'same' / 'run.json').read_text())['attempts'][-1]


def test_replay_of_an_hf_run_is_identical_ids_included(tiny_dir, tmp_path, capsys):
    attempt = _replay_is_identical(tmp_path, _config(tmp_path, str(tiny_dir), 6, 6), capsys)
    assert attempt['diverged'] == 0 and attempt['replayed_outputs'] > 6


@pytest.mark.slow
def test_replay_of_the_embedded_model_is_identical(tmp_path, capsys):
    attempt = _replay_is_identical(tmp_path, _config(tmp_path, 'embedded', 4, 12), capsys)
    assert attempt['diverged'] == 0
