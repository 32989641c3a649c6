"""ms-swift 4.6's token accounting: re-exported from the core (:mod:`mtflow.id_accounting`),
where it lives because it is a set of rules over the scheduler's own methods, not ms-swift code."""
from __future__ import annotations

from ..id_accounting import Swift46Accounting

__all__ = ['Swift46Accounting']
