"""``mtflow run``: ``--backend`` keeps the config's ``backend_options`` the new backend takes
(and names the ones it drops), and the run config's ``seed`` reaches every backend that can be
seeded."""
import argparse

import pytest

from mtflow.commands import run as run_cmd


def _args(config, **kw):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    run_cmd.add_parser(sub)
    argv = ['run', str(config)]
    for k, v in kw.items():
        argv += [f'--{k.replace("_", "-")}', str(v)]
    return parser.parse_args(argv)


def _config(tmp_path, text):
    path = tmp_path / 'run.yaml'
    path.write_text(text)
    return path


def test_backend_override_keeps_the_options_the_new_backend_takes(tmp_path, capsys):
    config = _config(tmp_path, 'scheduler: x.yaml\nbackend: hf\nbackend_options:\n'
                     '  max_batch_size: 4\n  engine_kwargs: {kv_cache_memory_bytes: 268435456}\n'
                     '  chat_template: "{{ messages }}"\n')
    cfg = run_cmd.load_config(_args(config, backend='vllm'))
    assert cfg.backend == 'vllm'
    assert cfg.backend_options == {'engine_kwargs': {'kv_cache_memory_bytes': 268435456},
                                   'chat_template': '{{ messages }}'}
    assert 'ignoring backend_options max_batch_size (not options of vllm)' in capsys.readouterr().err
    same = run_cmd.load_config(_args(config))
    assert same.backend_options['max_batch_size'] == 4


@pytest.mark.parametrize('backend, seeded', [('hf', True), ('vllm', True), ('openai', True), ('swift', True),
                                             ('scripted', True)])
def test_the_run_seed_reaches_every_seedable_backend(tmp_path, monkeypatch, backend, seeded):
    got = {}

    def fake_make_backend(name, model=None, **options):
        got.update(options)
        return object()

    monkeypatch.setattr('mtflow.backends.make_backend', fake_make_backend)
    config = _config(tmp_path, f'scheduler: x.yaml\nbackend: {backend}\nseed: 7\n')
    run_cmd.build_backend(run_cmd.load_config(_args(config)))
    assert got.get('seed') == (7 if seeded else None)


def test_vllm_backend_seeds_requests_without_a_seed():
    pytest.importorskip('transformers')
    from mtflow import RequestConfig, RolloutInferRequest
    from mtflow.backends.vllm_engine import VLLMBackend
    from tests.backends.fake_vllm import FakeLLM, SamplingParams
    from mtflow.core.seeds import sampling_seed
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    llm = FakeLLM(make_model(tok, seed=1), tok)
    backend = VLLMBackend(llm, sampling_params_cls=SamplingParams, seed=5)
    reqs = [RolloutInferRequest(messages=[{'role': 'user', 'content': f'q{i}'}], uuid=f'q{i}') for i in range(2)]
    backend(reqs, RequestConfig(max_tokens=1))
    backend(reqs[:1], RequestConfig(max_tokens=1))
    backend(reqs[:1], RequestConfig(max_tokens=1, seed=40))
    want = [sampling_seed(5, reqs[0]), sampling_seed(5, reqs[1]), sampling_seed(5, reqs[0]), sampling_seed(40, reqs[0])]
    assert [sp.seed for call in llm.calls for sp in call['params']] == want
    assert want[0] != want[1], 'each request its own seed; the same request the same seed, alone or in a batch'
