"""Token accounting: how each turn's messages, token ids, loss mask and logprobs join a trajectory.

Three accountings behind one interface (:class:`mtflow.core.types.Accounting`):

- :class:`ContractAccounting` (``segments``): the contract's rules, ms-swift's original driver;
- :class:`Swift46Accounting` (``swift46``): ms-swift 4.6's, for schedulers that keep assistant
  messages as exact token ids;
- :class:`RecordAccounting` (``token_record``): exact per-turn ids from a backend's token record.

:func:`accounting_for` is the one place that picks the default, and :func:`keeps_messages_as_ids`
the one rule that tells an ms-swift 4.6-style scheduler apart.
"""
from __future__ import annotations

from mtflow.accounting.choose import accounting_for, keeps_messages_as_ids
from mtflow.accounting.segments import ContractAccounting
from mtflow.accounting.swift46 import Swift46Accounting
from mtflow.accounting.token_record import RecordAccounting, TokenRecord, record_accounting

__all__ = ['ContractAccounting', 'Swift46Accounting', 'RecordAccounting', 'TokenRecord', 'accounting_for',
           'keeps_messages_as_ids', 'record_accounting']
