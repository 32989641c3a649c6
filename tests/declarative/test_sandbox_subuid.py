"""The pieces of issue 52's rootless design on their own: this user's subordinate uid ranges
(``/etc/subuid``), the block a driver uses, and the process budget that keeps the driver room
under its user's ``RLIMIT_NPROC`` (which counts every task of its calls)."""
from __future__ import annotations

import asyncio

import pytest

from mtflow.tools import subuid
from mtflow.tools.sandbox import budget, make_python_tool
from mtflow.tools.runner import ToolError


def test_the_largest_range_of_the_user_by_name_or_uid(tmp_path):
    f = tmp_path / 'subuid'
    f.write_text('other:100000:65536\nalice:200000:1000\nnot a line\nalice:x:5\n1001:300000:65536\n'
                 'alice:400000:70000\n')
    assert subuid.own_range(str(f), 'alice', 1001) == (400000, 70000)
    assert subuid.own_range(str(f), 'bob', 1001) == (300000, 65536)  # by uid


def test_a_user_without_a_range_is_told_how_to_get_one(tmp_path):
    f = tmp_path / 'subuid'
    f.write_text('other:100000:65536\n')
    with pytest.raises(subuid.SubuidUnavailable, match=r'gives bob \(uid 1002\) no range .*usermod --add-subuids'):
        subuid.own_range(str(f), 'bob', 1002)
    with pytest.raises(subuid.SubuidUnavailable, match='cannot read'):
        subuid.own_range(str(tmp_path / 'missing'), 'bob', 1002)


def test_the_block_is_the_top_of_the_range_but_two():
    assert subuid.block_of(100000, 65536) == (100000 + 65536 - 4096 - 2, 4096)
    assert subuid.block_of(100000, 40) == (100000 + 40 - 20 - 2, 20)  # half a small range
    with pytest.raises(subuid.SubuidUnavailable, match='too small'):
        subuid.block_of(100000, 20)


class _Budget(budget.ProcessBudget):
    """A budget under a limit of its own and a given count of the user's other tasks."""

    def __init__(self, limit, others):
        super().__init__()
        self._limit, self.others = limit, others

    def limit(self):
        return self._limit

    def _count(self, fresh):
        self._others = self.others
        return self.others


def test_sandboxes_take_turns_under_a_small_limit():
    b = _Budget(121, 10)  # the ulimit -u 121; 32 kept for the driver
    first = b.take(budget.call_tasks(64))
    assert first is not None and b.take(budget.call_tasks(64)) is None  # 10 + 66 + 66 + 32 > 121
    small = b.take(budget.call_tasks(8))
    assert small is not None and (b.held, b.sandboxes) == (76, 2)
    first.release()
    first.release()  # once only
    assert b.take(budget.call_tasks(64)) is not None and b.held == 76


def test_a_call_that_can_never_fit_is_refused_at_once_saying_why():
    b = _Budget(90, 0)
    with pytest.raises(budget.NoProcessRoom, match=r'ulimit -u 90\) has no room for a call of 66 tasks '
                                                   r'\(max_processes \+ 2\) beside the 32 kept for the driver'):
        b.take(budget.call_tasks(64))
    assert b.take(budget.call_tasks(50)) is not None  # 52 + 32 <= 90


def test_a_waiting_call_gives_up_at_its_timeout(monkeypatch):
    b = _Budget(121, 10)
    held = b.take(budget.call_tasks(64))
    monkeypatch.setattr(budget, 'budget', lambda: b)
    with pytest.raises(budget.NoProcessRoom, match=r'1 running calls may reach 66, 10 other tasks count for this '
                                                   r'user.*\(waited 0.2 s\)'):
        asyncio.run(budget.room(64, 0.2))
    held.release()
    ticket = asyncio.run(budget.room(64, 0.2))
    assert ticket is not None and b.held == 66


def test_the_tool_reports_no_room_as_a_refusal(monkeypatch):
    monkeypatch.setattr(budget, 'budget', lambda: _Budget(90, 10))
    tool = make_python_tool({'warm_pool': 0, 'timeout_s': 5})
    if not tool.isolation.available:
        pytest.skip(f'no isolation here: {tool.isolation.detail}')
    with pytest.raises(ToolError) as err:
        asyncio.run(tool('print(1)'))
    assert err.value.kind == 'refused' and 'process limit (ulimit -u 90)' in str(err.value)
