"""Rootless sandboxes on host uids of their own: a block of this user's subordinate uids.

Without root, bwrap's user namespace maps the program's ``nobody`` to this user, so every call
shares this user's per-user kernel counters with the driver and with every other call (issue 52):
pipe buffer pages (past ``fs.pipe-user-pages-soft`` every new pipe of the user gets 2 pages: one
call read another's 1 bits from the size of a fresh pipe, and the driver's own pipes shrank), and
file descriptors in flight over unix sockets (``SCM_RIGHTS``, counted per user against the
sender's ``RLIMIT_NOFILE``: one call's held descriptors made another call's ``multiprocessing``
forkserver fail with ``ETOOMANYREFS``). The kernel keeps those per host uid (``struct
user_struct``), so a call that runs as a host uid of its own has its own.

A normal user may own a range of subordinate uids and gids (``/etc/subuid``, ``/etc/subgid``:
``useradd`` gives every new user 65536 of each), which the setuid helpers ``newuidmap`` and
``newgidmap`` (Debian's ``uidmap``, what rootless podman uses) map into a user namespace that user
made. Once per process, :func:`helper` makes such a namespace, owned by this user and mapping a
block of them one to one (uid N inside is host uid N), and keeps it alive with a process that
waits in it (it ends when the driver does: its stdin is a pipe from the driver). Each call then
enters that namespace as a uid of the block leased for it (``nsenter --user --setuid --setgid``:
no capability is left once it runs as that uid) and runs bwrap there as before, which makes the
call's own user namespace (``nobody`` inside, that uid outside).

What it does not separate: the kernel counts a task of a user namespace for the namespace's
creator too, up to the first namespace (``RLIMIT_NPROC``'s count since Linux 5.14, and pending
signals), and the creator here is this user: see :mod:`mtflow.tools.sandbox.budget`.
"""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import threading
from dataclasses import dataclass
from typing import List, Optional, Tuple

__all__ = ['SubuidUnavailable', 'SubordinateIds', 'helper', 'ranges', 'own_range', 'block_of', 'SUBUID', 'SUBGID',
           'BLOCK']

SUBUID, SUBGID = '/etc/subuid', '/etc/subgid'

#: how many subordinate uids the sandboxes use at most (concurrent calls of this user on this host)
BLOCK = 4096

#: the fewest a range must give (a block is at most half a range)
MIN_BLOCK = 16


class SubuidUnavailable(RuntimeError):
    """This user cannot have subordinate uids here (the message says why)."""


def ranges(path: str, name: str, uid: int) -> List[Tuple[int, int]]:
    """Every ``(first, count)`` range ``path`` (``/etc/subuid`` or ``/etc/subgid``) gives the user
    ``name`` (lines ``name:first:count`` or ``uid:first:count``; others are skipped)."""
    found = []
    try:
        with open(path, encoding='utf-8') as f:
            for line in f:
                parts = line.strip().split(':')
                if len(parts) != 3 or parts[0] not in (name, str(uid)):
                    continue
                try:
                    found.append((int(parts[1]), int(parts[2])))
                except ValueError:
                    continue
    except OSError as exc:
        raise SubuidUnavailable(f'cannot read {path}: {exc.strerror}') from None
    return found


def own_range(path: str, name: str, uid: int) -> Tuple[int, int]:
    """``(first, count)`` of the largest range ``path`` gives the user ``name`` (:func:`ranges`)."""
    found = ranges(path, name, uid)
    if not found:
        raise SubuidUnavailable(f'{path} gives {name} (uid {uid}) no range (useradd gives one to every new user; '
                                f'as root: usermod --add-subuids FIRST-LAST --add-subgids FIRST-LAST {name})')
    return max(found, key=lambda r: r[1])


def block_of(first: int, count: int) -> Tuple[int, int]:
    """``(base, size)`` of the block used out of a range: at most :data:`BLOCK`, at most half the
    range, at its top but for the last two (rootless podman maps a container's low uids, its
    root and system users, to the bottom of the range, and its ``nobody`` to the very top)."""
    size = min(BLOCK, count // 2)
    if size < MIN_BLOCK:
        raise SubuidUnavailable(f'a range of {count} subordinate ids is too small (at least {2 * MIN_BLOCK})')
    return first + count - size - 2, size


@dataclass
class SubordinateIds:
    """The helper namespace: ``uid_base``..``uid_base + size - 1`` (and the same number of gids
    from ``gid_base``) mapped one to one, held by the process ``holder``."""
    uid_base: int
    gid_base: int
    size: int
    holder: 'subprocess.Popen[bytes]'
    nsenter: str

    def alive(self) -> bool:
        return self.holder.poll() is None

    def enter_argv(self, uid: int) -> List[str]:
        """The command prefix that runs the rest in the helper namespace as host ``uid`` (one of
        the block) and its gid, with no capability and no supplementary group."""
        gid = self.gid_base + uid - self.uid_base
        return [self.nsenter, f'--user=/proc/{self.holder.pid}/ns/user', f'--setuid={uid}', f'--setgid={gid}', '--']

    def describe(self) -> str:
        return (f'a subordinate uid of its own per call (host uids {self.uid_base}-{self.uid_base + self.size - 1}, '
                f'{SUBUID})')


def _tools() -> Tuple[str, str, str, str]:
    found = {name: shutil.which(name, path='/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin')
             for name in ('unshare', 'nsenter', 'newuidmap', 'newgidmap')}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        hint = ' (Debian: apt-get install uidmap)' if {'newuidmap', 'newgidmap'} & set(missing) else ''
        raise SubuidUnavailable(f'{", ".join(missing)} not found{hint}')
    return found['unshare'], found['nsenter'], found['newuidmap'], found['newgidmap']  # type: ignore[return-value]


def _make() -> SubordinateIds:
    unshare, nsenter, newuidmap, newgidmap = _tools()
    uid = os.getuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        raise SubuidUnavailable(f'uid {uid} has no user name (newuidmap looks its ranges up by name)') from None
    uid_base, size = block_of(*own_range(SUBUID, name, uid))
    gid_base, gid_size = block_of(*own_range(SUBGID, name, uid))
    size = min(size, gid_size)
    # it waits in its new namespace (cat, on a pipe from this process) until this process ends
    holder = subprocess.Popen([unshare, '--user', '--', '/bin/sh', '-c', 'echo ready && exec cat'],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True, env={'PATH': '/usr/bin:/bin'})
    try:
        if holder.stdout.readline() != b'ready\n':  # type: ignore[union-attr]
            holder.wait(5)
            err = holder.stderr.read().decode('utf-8', 'replace').strip()  # type: ignore[union-attr]
            raise SubuidUnavailable(f'unshare --user failed: {err[-200:] or "no output"}')
        for tool, base in ((newuidmap, uid_base), (newgidmap, gid_base)):
            done = subprocess.run([tool, str(holder.pid), str(base), str(base), str(size)], capture_output=True,
                                  timeout=30, env={'PATH': '/usr/bin:/bin'})
            if done.returncode != 0:
                err = (done.stderr or done.stdout).decode('utf-8', 'replace').strip()
                raise SubuidUnavailable(f'{os.path.basename(tool)} failed: {err[-200:] or f"status {done.returncode}"}')
        with open(f'/proc/{holder.pid}/uid_map', encoding='ascii') as f:
            mapped = f.read().split()
        if mapped != [str(uid_base), str(uid_base), str(size)]:
            raise SubuidUnavailable(f'the helper namespace maps {" ".join(mapped) or "nothing"}, not {uid_base}+{size}')
    except BaseException:
        _end(holder)
        raise
    holder.stdout.close()  # type: ignore[union-attr]
    holder.stderr.close()  # type: ignore[union-attr]
    return SubordinateIds(uid_base, gid_base, size, holder, nsenter)


def _end(holder: 'subprocess.Popen[bytes]') -> None:
    for stream in (holder.stdin, holder.stdout, holder.stderr):
        if stream is not None:
            stream.close()
    try:
        holder.wait(5)
    except subprocess.TimeoutExpired:
        holder.kill()
        holder.wait()


_lock = threading.Lock()
_current: Optional[SubordinateIds] = None
_refused: Optional[str] = None


def helper() -> SubordinateIds:
    """This process's helper namespace, made on first use (and again should its holder have
    died); :class:`SubuidUnavailable` says why there is none (the answer is kept: no subordinate
    ids now, none later in this process), or why :func:`refuse` turned it down."""
    global _current, _refused
    with _lock:
        if _refused is not None:
            raise SubuidUnavailable(_refused)
        if _current is not None and _current.alive():
            return _current
        try:
            _current = _make()
        except SubuidUnavailable as exc:
            _refused = str(exc)
            raise
        except (OSError, subprocess.SubprocessError) as exc:
            _refused = f'the helper namespace could not be made: {exc}'
            raise SubuidUnavailable(_refused) from None
        return _current


def refuse(why: str) -> None:
    """Use no subordinate uids in this process from now on (a probe through them failed: ``why``)."""
    global _current, _refused
    with _lock:
        _refused = why
        if _current is not None:
            _end(_current.holder)
            _current = None


def forget() -> None:
    """End the helper and forget every answer (tests; the probe is cached separately)."""
    global _current, _refused
    with _lock:
        if _current is not None:
            _end(_current.holder)
        _current, _refused = None, None
