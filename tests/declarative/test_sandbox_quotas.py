"""Issue 52: what a call can hold or signal outside its bounds through kernel state counted per
user or not counted at all, checked on the host while the calls run, as root and as a normal user
(``useradd -m``, with its subordinate uids): page-cache folios pinned in pipes (MemFree and the
pages the host could not evict), the per-user pipe quota and descriptors in flight as channels
between two concurrent calls, the driver's own process limit, the host's uevents."""
from __future__ import annotations

import json

import pytest

from . import quota_scenarios as q
from .sandbox_util import KINDS, normal_user, require, run_as

kinds = pytest.mark.parametrize('kind', KINDS)

PIN_DENIED = f'splice {q.EPERM} sendfile_pipe {q.EPERM} sendfile_socket {q.EPERM} tee {q.EPERM}'


def _as_normal_user(scenario: str, *args: str) -> dict:
    with normal_user() as (uid, exe, env):
        return json.loads(run_as(uid, exe, env, q.SCRIPT, scenario, 'bwrap', *args).splitlines()[-1])


def _check_pinning(result: dict, host: q.PinnedPages) -> None:
    assert result['error_kind'] == '' and result['output'].split() == PIN_DENIED.split(), result
    # the file's 32 huge pages, evicted every 50 ms while the call ran: none stayed for a second
    # (spliced, each pipe slot held a 2 MB folio: 16384 pages, 64 MB, held to the call's end)
    assert len(host.samples) >= 20 and host.held_pages() == 0, (host.held_pages(), host.samples[-5:])
    # its pipes (the program's 3, the output pipe, PID 1's) hold only their own pages: 16 each
    assert host.pipe_pages(result['pid_namespace']) <= 128, host.samples[-1]


@kinds
def test_page_cache_folios_cannot_be_pinned_into_pipes(kind):
    require(kind)
    with q.evicted_file() as (d, path), q.PinnedPages(path) as host:
        result = q.pin_call(kind, d, path)
    _check_pinning(result, host)


def test_rootless_page_cache_folios_cannot_be_pinned_into_pipes():
    with q.evicted_file() as (d, path), q.PinnedPages(path) as host:
        result = _as_normal_user('pin_call', d, path)
    _check_pinning(result, host)


def _shared_quotas(result: dict) -> None:
    """As a normal user without subordinate uids the calls share the user's counts: the residual
    docs/sandbox.md measures (the load-time report says so); nothing to check here then."""
    if 'no subordinate uids' in result['report']:
        pytest.skip(f'no subordinate uids here, so this user\'s kernel counts are shared by design: {result["report"]}')


def _check_pipe_channel(result: dict, calls: q.CallPipes) -> None:
    _shared_quotas(result)
    sent, got = result['sender'].split(), result['receiver'].split()
    # the sender held pipes of 1 MB in each of its 4 processes (past the user's 64 MB, had it one user)
    assert sent[0] == 'sent' and int(sent[1]) >= 8, result
    # what the receiver and the driver saw: full-size fresh pipes all along, whatever the sender did
    # (one user for both: 8 kB pipes while the sender held, 31 of 32 bits read in the issue)
    assert got[:4] == ['sizes', '65536', 'small', '0'], result
    assert result['driver_samples'] >= 50 and result['driver_small'] == 0, result
    # the sender's own pipe pages, seen on the host (where this process may read its /proc/<pid>/fd)
    assert calls.most.get(result['sender_ns'], 0) >= 2048 or not calls.most, calls.most


def test_the_pipe_quota_passes_no_bits_between_calls():
    require('bwrap')
    with q.CallPipes() as calls:
        result = q.pipe_channel_scenario('bwrap')
    _check_pipe_channel(result, calls)


def test_rootless_the_pipe_quota_passes_no_bits_between_calls():
    with q.CallPipes() as calls:
        result = _as_normal_user('pipe_channel_scenario')
    _check_pipe_channel(result, calls)


def _check_inflight(result: dict) -> None:
    _shared_quotas(result)
    sent, got = result['sender'].split(), result['receiver'].split()
    assert sent[0] == 'sent' and int(sent[1]) >= 120, result  # past its RLIMIT_NOFILE (64): refused beyond
    # one user for both, the receiver's own descriptor was refused (ETOOMANYREFS) whenever the
    # sender held (32 of 32 bits in the issue), and its forkserver could not start a process
    assert got[:4] == ['passed', got[1], 'failed', '0'] and int(got[1]) >= 50, result
    assert got[4:] == ['forkserver', '285'], result


def test_descriptors_in_flight_pass_no_bits_between_calls():
    require('bwrap')
    _check_inflight(q.inflight_scenario('bwrap'))


def test_rootless_descriptors_in_flight_pass_no_bits_between_calls():
    _check_inflight(_as_normal_user('inflight_scenario'))


def _check_driver_starts(result: dict) -> None:
    # every call forked all its max_processes allowed (64: itself and 63 children)...
    assert result['calls'] == ['forked 63'] * 3, result
    # ...and the driver could start a thread and a subprocess all along
    assert result['tries'] >= 10 and result['thread_failed'] == result['process_failed'] == 0, result


def test_calls_holding_their_processes_leave_the_driver_room():
    require('bwrap')
    _check_driver_starts(q.nproc_scenario('bwrap'))


def test_rootless_calls_holding_their_processes_leave_the_driver_room():
    """The issue's driver: ulimit -u 121 (more where this user runs more already: one call must
    fit), three calls of the default max_processes (64) at once.
    Each task of a call counts against the driver's user too (the user namespaces are its own),
    so a call starts only when its tasks fit beside the driver's and a reserve: they take turns."""
    _check_driver_starts(_as_normal_user('nproc_scenario', '121'))


@pytest.mark.parametrize('kind', KINDS)
def test_calls_receive_no_uevents_of_the_host(kind):
    """As root, a call's network namespace is owned by the first user namespace, which the kernel
    sends every uevent to: the host's device events, and a synthetic one the host (or anything
    that can write /sys) sends. The socket is refused."""
    require(kind)
    result = q.uevent_scenario(kind)
    assert (result['error_kind'], result['output'].split()) == ('', ['socket', q.EPERM]), result


def test_rootless_calls_receive_no_uevents():
    result = _as_normal_user('uevent_scenario')
    assert (result['error_kind'], result['output'].split()) == ('', ['socket', q.EPERM]), result


def test_rootless_calls_run_on_subordinate_uids_of_their_own():
    """What closes the per-user channels: as a normal user with subordinate uids, each call runs
    on a host uid of its own from them (nobody inside), never as the driver's user; the load-time
    report says so."""
    from mtflow.tools import isolation
    with UidsSeen() as seen:
        result = _as_normal_user('identity_scenario')
    first, count = result['range']
    if not count:
        pytest.skip(f'uid {result["uid"]} has no subordinate uids here')
    assert result['inside'] == [str(isolation.ROOTLESS_UID)] * 2, result
    uids = result['host_uids']
    assert len(set(uids)) == 2 and all(first <= u < first + count for u in uids), result
    assert 'on a subordinate uid of its own per call' in result['report'], result['report']
    assert set(uids) <= seen.uids, (uids, seen.uids)  # the calls' processes ran as them, seen on the host


class UidsSeen(q.HostSampler):
    """The uids the calls' processes run as, seen on the host."""

    every_s = 0.1

    def __init__(self) -> None:
        self.uids: set = set()

    def sample(self) -> None:
        for pids in q.call_processes().values():
            for pid in pids:
                try:
                    with open(f'/proc/{pid}/status', encoding='ascii') as f:
                        self.uids |= {int(line.split()[1]) for line in f if line.startswith('Uid:')}
                except OSError:
                    pass
