"""The HF backend's torch threads on CPU (issue 47, item 14): each generate uses the cores no other
process is running on (at least one), so a loaded machine costs the backend its share of the cores
instead of spinning OpenMP workers; a fixed count and the user's ``OMP_NUM_THREADS`` are kept. The
load is faked at its source (``/proc/stat``'s ``procs_running``), so nothing here times anything."""

import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('transformers')

from mtflow import RequestConfig, RolloutInferRequest  # noqa: E402
from mtflow.backends import cpu_threads  # noqa: E402
from mtflow.backends.hf import HFBackend  # noqa: E402
from mtflow.cli import main  # noqa: E402
from tests.tiny_model import make_model, make_tokenizer  # noqa: E402

pytestmark = pytest.mark.hf


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
    before = torch.get_num_threads()
    tok = make_tokenizer()
    yield lambda **options: HFBackend(make_model(tok, seed=1), tok, default_max_tokens=3, **options)
    torch.set_num_threads(before)


def _busy(monkeypatch, others):
    """``others`` runnable threads of other processes (the asking thread comes on top)."""
    monkeypatch.setattr(cpu_threads, '_procs_running', lambda: others + 1)


def _generate(b):
    b([RolloutInferRequest(messages=[{'role': 'user', 'content': 'hi'}], uuid='a')], RequestConfig(temperature=0))


def test_each_call_uses_the_cores_no_other_process_runs_on(backend, monkeypatch):
    cores = cpu_threads.usable_cores()
    b = backend()
    _busy(monkeypatch, 0)
    _generate(b)
    assert b.cpu_threads.last == torch.get_num_threads() == cores  # an idle machine: every core, as before
    _busy(monkeypatch, cores + 3)
    _generate(b)
    assert b.cpu_threads.last == torch.get_num_threads() == 1  # a loaded one: one thread, no team to spin
    if cores > 2:
        _busy(monkeypatch, 1)
        _generate(b)
        assert torch.get_num_threads() == cores - 1


def test_a_fixed_count_and_the_users_omp_num_threads_are_kept(backend, monkeypatch):
    _busy(monkeypatch, 50)
    b = backend(threads=2)
    _generate(b)
    assert b.cpu_threads.last == torch.get_num_threads() == 2
    torch.set_num_threads(2)
    monkeypatch.setenv('OMP_NUM_THREADS', '2')
    b = backend()
    _generate(b)
    assert b.cpu_threads.last is None and torch.get_num_threads() == 2
    b = backend(threads=None)
    _generate(b)
    assert b.cpu_threads.last is None


def test_a_wrong_threads_option_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'sched.yaml').write_text('name: s\nmax_turns: 1\n')
    (tmp_path / 'run.yaml').write_text('scheduler: sched.yaml\nbackend: hf\nmodel: embedded\nlimit: 1\nout: out\n')
    assert main(['run', 'run.yaml', '-o', 'threads=lots', '--no-progress']) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("mtflow: command line: -o threads=lots: backend_options.threads: hf backend: threads must be "
                   "'auto', a positive int or null, not 'lots'")  # the flag named (issue 47's option checks)
