"""mtflow inside ms-swift (tested against ms-swift 4.6.0), both ways.

=======================  =========================================================================
module                   what it does
=======================  =========================================================================
:mod:`.converters`       :func:`to_swift` / :func:`from_swift`: requests, configs, messages, choices,
                         responses and outputs between mtflow's models and ms-swift's types
:mod:`.adapter`          mtflow schedulers as ms-swift ``MultiTurnScheduler`` s
                         (:func:`as_swift_scheduler`, :func:`register`), for ms-swift's driver
:mod:`.patching`         mtflow's executor inside ms-swift's trainers (:func:`install`,
                         :func:`uninstall`, :func:`installed`)
=======================  =========================================================================

Every module here imports ms-swift (seconds), so nothing outside this package imports it at
start-up: ``import mtflow`` and ``import mtflow.integrations`` never load ms-swift.
"""
from mtflow.integrations.swift.adapter import FINISH_REASON_KEY, SwiftSchedulerAdapter, as_swift_scheduler, register
from mtflow.integrations.swift.converters import from_swift, to_swift
from mtflow.integrations.swift.patching import (PATCH_TARGETS, InstallState, install, installed, mtflow_run_multi_turn,
                                                uninstall)

__all__ = [
    'to_swift', 'from_swift', 'SwiftSchedulerAdapter', 'as_swift_scheduler', 'register', 'install', 'uninstall',
    'installed', 'InstallState', 'FINISH_REASON_KEY', 'PATCH_TARGETS', 'mtflow_run_multi_turn'
]
