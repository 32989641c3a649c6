"""The one message for a key that is not known, used by every config of mtflow (scheduler YAML,
run configs, ``scheduler_args``, ``request_config``): the key, the closest known key, and every
known key, so a typo is fixed from the message alone."""
from __future__ import annotations

import difflib
from typing import Iterable, List, Optional

__all__ = ['closest_key', 'unknown_key_message']


def closest_key(key: str, known: Iterable[str]) -> Optional[str]:
    """The known key ``key`` most likely misspells (``max_turn`` -> ``max_turns``, ``gymnasium``
    -> ``gym``), or ``None``."""
    names: List[str] = [str(k) for k in known]
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
    if close:
        return close[0]
    lowered = str(key).lower()
    prefixed = [k for k in names if len(k) >= 3 and (lowered.startswith(k.lower()) or k.lower().startswith(lowered))]
    if prefixed:
        return max(prefixed, key=len)
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
    return close[0] if close else None


def unknown_key_message(key: str, known: Iterable[str], what: str = '') -> str:
    """``unknown key 'max_session'[ for <what>]; did you mean 'max_sessions'? (known: ...)``."""
    names = [str(k) for k in known]
    close = closest_key(key, names)
    return (f'unknown key {str(key)!r}' + (f' for {what}' if what else '')
            + (f'; did you mean {close!r}?' if close else '') + f' (known: {", ".join(names)})')
