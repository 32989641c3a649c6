"""Integrations with training frameworks.

``mtflow.integrations.swift`` plugs mtflow into ms-swift both ways (it imports ms-swift, which
takes seconds, so it is never imported from here); ``mtflow.accounting.swift46`` is
ms-swift 4.6's token accounting, importable without ms-swift.
"""
__all__ = ['swift', 'swift_accounting']
