"""``mtflow run --until SPEC``: when a streamed run stops, as the command line says it.

``SPEC`` is ``KEY=N`` pairs separated by commas: ``groups=8``, ``requests=100``,
``seconds=30``, ``tokens=50000`` (``groups=8,seconds=600``: whichever comes first). It becomes
the ``until`` of :meth:`mtflow.Executor.stream` (:class:`mtflow.StreamUntil`); the run stops
after that many *delivered* (written) groups, requests or tokens. What was in flight is not
written, so ``--resume`` runs those requests again from their prompts and the directory ends up
as an uninterrupted run's.
"""
from __future__ import annotations

from typing import Dict, Optional, Union

from mtflow.core.errors import UserError
from mtflow.engine.stream import StreamUntil

__all__ = ['parse_until', 'UNTIL_KEYS']

UNTIL_KEYS = ('requests', 'groups', 'seconds', 'tokens')


def parse_until(spec: Optional[str]) -> Optional[StreamUntil]:
    """The budget of ``--until SPEC`` (``None`` for no flag); a mistake is one :class:`UserError`."""
    if spec is None:
        return None
    values: Dict[str, Union[int, float]] = {}
    for part in spec.split(','):
        key, sep, raw = part.strip().partition('=')
        key = key.strip()
        if not sep or key not in UNTIL_KEYS:
            raise UserError(f'--until {spec!r}: each part is KEY=N with KEY one of {", ".join(UNTIL_KEYS)}')
        if key in values:
            raise UserError(f'--until {spec!r}: {key} given twice')
        try:
            values[key] = float(raw) if key == 'seconds' else int(raw)
        except ValueError:
            kind = 'a number of seconds' if key == 'seconds' else 'an int'
            raise UserError(f'--until {spec!r}: {key} must be {kind}, not {raw.strip()!r}') from None
    try:
        return StreamUntil(**values)
    except ValueError as exc:
        raise UserError(f'--until {spec!r}: {str(exc).replace("until: ", "")}') from None
