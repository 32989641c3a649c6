"""Which accounting a scheduler gets by default, and the one rule that tells an ms-swift 4.6-style
scheduler (assistant messages kept as exact token ids) from a contract-style one."""
from __future__ import annotations

from typing import Any

from mtflow.core.types import Accounting
from mtflow.accounting.segments import ContractAccounting
from mtflow.accounting.swift46 import Swift46Accounting

__all__ = ['accounting_for', 'keeps_messages_as_ids']


def keeps_messages_as_ids(scheduler: Any) -> bool:
    """ms-swift 4.6's shape: the scheduler's class has ``append_assistant_completion`` (every
    ``MultiTurnScheduler`` does), so it keeps assistant messages as exact token ids."""
    return callable(getattr(type(scheduler), 'append_assistant_completion', None))


def accounting_for(scheduler: Any) -> Accounting:
    """The accounting an executor uses for ``scheduler`` when none is passed: ms-swift 4.6's for
    schedulers that keep assistant messages as token ids, else the contract's."""
    if keeps_messages_as_ids(scheduler):
        return Swift46Accounting(scheduler)
    return ContractAccounting()
