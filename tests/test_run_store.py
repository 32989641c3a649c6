"""The crash-safe run directory (``mtflow/run/store.py``) on its own: new / resume / overwrite,
whole lines, torn-line repair, the fingerprint check, the directory lock."""
import json
import os

import pytest

from mtflow.run.store import (INTERRUPTED_FILE, RUN_INFO, SUMMARY, TRACE, TRAJECTORIES, FingerprintMismatch,
                              RunDirError, RunStore, finished_to_record, fingerprint_changes)

FP = {'config': {'seed': 0, 'request_config': {'temperature': 0.7}}, 'files': {'dataset': 'sha256:aa'}}


def _record(uuid, reason='stop', turns=2, **infos):
    return {'uuid': uuid, 'index': int(uuid[1:]), 'finish_reason': reason, 'num_turns': turns, 'messages': [],
            'rollout_infos': {'num_turns': turns, **infos}}


def _events(uuid, n=2, tokens=3):
    return [{'uuid': uuid, 'index': 0, 'turn': k + 1, 'from': 'generating', 'to': 'tool_step', 'trigger': 'run_step',
             'tokens': tokens, 'extra': {'tool_calls': 1}} for k in range(n)]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_new_store_writes_whole_groups_trace_first(tmp_path):
    out = tmp_path / 'run'
    store = RunStore.open(out, 'new', FP, flush_every=2, flush_interval_s=3600)
    store.write(_record('r0'), _events('r0'))
    assert (out / TRAJECTORIES).read_text() == '' and (out / TRACE).read_text() == '', 'held until the group is full'
    store.write(_record('r1', reason='max_turns', turns=3), _events('r1', 3))
    assert [t['uuid'] for t in _lines(out / TRAJECTORIES)] == ['r0', 'r1']
    assert [e['uuid'] for e in _lines(out / TRACE)] == ['r0', 'r0', 'r1', 'r1', 'r1']
    store.write(_record('r2'), _events('r2'))
    with pytest.raises(RunDirError, match='request r2 is already written'):
        store.write(_record('r2'))
    store.close(summary={'requests': 3})
    assert len(_lines(out / TRAJECTORIES)) == 3, 'close flushes the last group'
    summary = json.loads((out / SUMMARY).read_text())
    assert summary == {'status': 'complete', 'requests': 3}
    info = json.loads((out / RUN_INFO).read_text())
    assert info['fingerprint'] == FP and info['attempts'][0]['status'] == 'complete'
    assert info['attempts'][0]['written'] == 3
    assert not (out / 'run.lock').exists()
    assert store.tally.requests == 3 and store.tally.reasons == {'stop': 2, 'max_turns': 1}
    assert store.tally.trace_tokens == 7 * 3 and store.tally.tool_calls() == (7, 0)


def test_time_based_flush(tmp_path):
    store = RunStore.open(tmp_path / 'run', 'new', FP, flush_every=1000, flush_interval_s=0.0)
    store.write(_record('r0'), _events('r0'))
    assert len(_lines(tmp_path / 'run' / TRAJECTORIES)) == 1
    store.close()


def test_a_non_empty_directory_is_refused_and_untouched(tmp_path):
    out = tmp_path / 'run'
    with RunStore.open(out, 'new', FP) as store:
        store.write(_record('r0'), _events('r0'))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(RunDirError, match=r'already holds a run \(1 trajectories\): pass --resume .* --overwrite'):
        RunStore.open(out, 'new', FP)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    other = tmp_path / 'other'
    other.mkdir()
    (other / 'notes.txt').write_text('mine')
    with pytest.raises(RunDirError, match=r'not empty \(notes.txt\)'):
        RunStore.open(other, 'new', FP)
    with pytest.raises(RunDirError, match='holds no mtflow run'):
        RunStore.open(other, 'resume', FP)
    assert sorted(p.name for p in other.iterdir()) == ['notes.txt']


def test_resume_repairs_torn_lines_and_drops_unfinished_events(tmp_path):
    out = tmp_path / 'run'
    with RunStore.open(out, 'new', FP, flush_every=1) as store:
        for k in range(3):
            store.write(_record(f'r{k}'), _events(f'r{k}'))
    intact = (out / TRAJECTORIES).read_text()
    # a crash: r3's events made it, its trajectory line only half; r4's trace group torn
    with open(out / TRACE, 'a') as f:
        f.write(''.join(json.dumps(e) + '\n' for e in _events('r3')) + '{"uuid": "r4", "tu')
    with open(out / TRAJECTORIES, 'a') as f:
        f.write('{"uuid": "r3", "finish_rea')
    (out / SUMMARY).write_text('{"status": "interrupted"}')
    (out / INTERRUPTED_FILE).write_text(json.dumps(_record('r5', 'interrupted')) + '\n')
    store = RunStore.open(out, 'resume', FP)
    assert store.done == {'r0', 'r1', 'r2'}
    rec = store.recovery
    assert rec.torn_trajectory_line and rec.torn_trace_line and rec.orphan_events == 2 and rec.interrupted == 1
    assert (out / TRAJECTORIES).read_text() == intact
    assert {e['uuid'] for e in _lines(out / TRACE)} == {'r0', 'r1', 'r2'}
    assert not (out / SUMMARY).exists() and not (out / INTERRUPTED_FILE).exists(), 'stale files go'
    assert store.tally.requests == 3 and store.tally.trace_tokens == 18, 'the tally covers the earlier attempt'
    store.write(_record('r3'), _events('r3'))
    with pytest.raises(RunDirError, match='r1 is already written'):
        store.write(_record('r1'))
    store.close(summary={})
    assert [t['uuid'] for t in _lines(out / TRAJECTORIES)] == ['r0', 'r1', 'r2', 'r3']
    info = json.loads((out / RUN_INFO).read_text())
    assert [a['mode'] for a in info['attempts']] == ['new', 'resume']
    assert info['attempts'][1]['done_at_start'] == 3 and info['attempts'][1]['written'] == 1


def test_a_bad_line_in_the_middle_is_damage_not_a_torn_line(tmp_path):
    out = tmp_path / 'run'
    with RunStore.open(out, 'new', FP, flush_every=1) as store:
        store.write(_record('r0'))
    with open(out / TRAJECTORIES, 'a') as f:
        f.write('{"uuid": broken\n' + json.dumps(_record('r1')) + '\n')
    with pytest.raises(RunDirError, match=r'trajectories.jsonl:2: not a JSON object in the middle of the file'):
        RunStore.open(out, 'resume', FP)


def test_resume_with_another_fingerprint_names_the_change(tmp_path):
    out = tmp_path / 'run'
    RunStore.open(out, 'new', FP).close()
    changed = json.loads(json.dumps(FP))
    changed['config']['request_config']['temperature'] = 1.0
    changed['files']['dataset'] = 'sha256:bb'
    with pytest.raises(FingerprintMismatch) as err:
        RunStore.open(out, 'resume', changed)
    assert err.value.changes == ['config.request_config.temperature: 0.7 -> 1.0',
                                 'files.dataset: "sha256:aa" -> "sha256:bb"']
    assert 'resume with the original ones, or pass --overwrite' in str(err.value)


def test_resume_of_a_missing_directory_starts_a_new_run(tmp_path):
    store = RunStore.open(tmp_path / 'fresh', 'resume', FP)
    assert not store.resumed and store.done == set()
    store.close()


def test_overwrite_moves_aside_or_deletes_only_run_files(tmp_path):
    out = tmp_path / 'run'
    with RunStore.open(out, 'new', FP) as store:
        store.write(_record('r0'))
    old = (out / TRAJECTORIES).read_text()
    store = RunStore.open(out, 'overwrite', FP)
    assert store.set_aside is not None and store.set_aside.name.startswith('run.old-')
    assert (store.set_aside / TRAJECTORIES).read_text() == old
    assert (out / TRAJECTORIES).read_text() == ''
    store.write(_record('r1'))
    store.close()
    store = RunStore.open(out, 'overwrite', FP, delete_old=True)
    assert store.set_aside is None and (out / TRAJECTORIES).read_text() == ''
    store.close()
    (out / 'mine.txt').write_text('keep me')
    with pytest.raises(RunDirError, match='--delete-old deletes only the files of an mtflow run.*mine.txt'):
        RunStore.open(out, 'overwrite', FP, delete_old=True)
    assert (out / 'mine.txt').read_text() == 'keep me'


def test_one_writer_per_directory(tmp_path):
    store = RunStore.open(tmp_path / 'run', 'new', FP)
    with pytest.raises(RunDirError, match=rf'another mtflow run \(pid {os.getpid()}\) is writing'):
        RunStore.open(tmp_path / 'run', 'resume', FP)
    with pytest.raises(RunDirError, match='another mtflow run'):
        RunStore.open(tmp_path / 'run', 'overwrite', FP)
    store.close()


def test_interrupted_requests_are_kept_apart(tmp_path):
    out = tmp_path / 'run'
    store = RunStore.open(out, 'new', FP)
    store.write(_record('r0'), _events('r0'))
    store.write_interrupted(_record('r1', 'interrupted'), _events('r1', 1))
    store.close(status='interrupted', summary={})
    lines = _lines(out / INTERRUPTED_FILE)
    assert [(t['uuid'], t['finish_reason'], len(t['trace'])) for t in lines] == [('r1', 'interrupted', 1)]
    assert [t['uuid'] for t in _lines(out / TRAJECTORIES)] == ['r0']
    assert json.loads((out / SUMMARY).read_text())['status'] == 'interrupted'


def test_a_full_disk_leaves_no_half_group(tmp_path, monkeypatch):
    out = tmp_path / 'run'
    store = RunStore.open(out, 'new', FP, flush_every=1)
    store.write(_record('r0'), _events('r0'))
    sizes = [(out / TRACE).stat().st_size, (out / TRAJECTORIES).stat().st_size]
    real_fsync = os.fsync

    calls = []

    def full(fd):  # the trace group goes out, the trajectory group does not
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(28, 'No space left on device')
        real_fsync(fd)

    monkeypatch.setattr(os, 'fsync', full)
    with pytest.raises(RunDirError, match='No space left on device.*--resume continues'):
        store.write(_record('r1'), _events('r1'))
    monkeypatch.setattr(os, 'fsync', real_fsync)
    assert [(out / TRACE).stat().st_size, (out / TRAJECTORIES).stat().st_size] == sizes, 'both files cut back'
    store.flush()  # the disk has room again: the held group goes out
    assert [t['uuid'] for t in _lines(out / TRAJECTORIES)] == ['r0', 'r1']
    assert [e['uuid'] for e in _lines(out / TRACE)] == ['r0', 'r0', 'r1', 'r1'], 'no event twice'
    store.close()


def test_finished_to_record_renumbers_and_shifts_times():
    from mtflow import RolloutOutput
    from mtflow.core.trace import TraceEvent

    class Finished:
        index, uuid, finish_reason = 2, 'q7', 'max_turns'
        output = RolloutOutput(messages=[{'role': 'user', 'content': 'hi'}], rollout_infos={'num_turns': 1})
        events = [TraceEvent('q7', 2, 0, 1, 'generating', 'finished', 'finish', 'max_turns', 4, None, 0.5)]

    record, events = finished_to_record(Finished(), index=42, t_offset=10.0)
    assert record['uuid'] == 'q7' and record['index'] == 42 and record['finish_reason'] == 'max_turns'
    assert record['num_turns'] == 1 and record['messages'] == [{'role': 'user', 'content': 'hi'}]
    assert events[0]['index'] == 42 and events[0]['t'] == 10.5 and events[0]['from'] == 'generating'


def test_fingerprint_changes_lists_each_leaf():
    assert fingerprint_changes({'a': {'b': 1, 'c': 2}}, {'a': {'b': 1, 'c': 3, 'd': 4}}) == [
        'a.c: 2 -> 3', 'a.d: (absent) -> 4']


def test_a_signal_during_a_group_write_waits_for_the_group(tmp_path):
    """The first SIGINT/SIGTERM is held back while a group is written, then raised."""
    import signal

    from mtflow.run.signals import StopRequested, StopSignals, deferred_interrupts, exit_code_for

    previous = signal.getsignal(signal.SIGTERM)
    with StopSignals(message=None) as signals:
        with pytest.raises(StopRequested) as stop:
            with deferred_interrupts():
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # the handler runs between bytecodes: it must not raise here
                    pass
                reached = True
        assert reached and stop.value.signum == signal.SIGTERM and signals.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is previous, 'the previous handler is back'
    assert exit_code_for(signal.SIGINT) == 130 and exit_code_for(signal.SIGTERM) == 143
    with StopSignals(message=None):
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10 ** 6):
                pass
