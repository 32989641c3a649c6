"""Checks for everything a scheduler hook or an engine hands the executor.

Each check either returns the value in the shape the executor works with, or raises a
:class:`~mtflow.core.errors.RequestError` subclass naming the request, the turn and the field. They
run before anything is changed, so a rejected value leaves the request exactly as it was. They
are cheap on the common path (one ``type() is`` test per value), because they run once per
request and turn.
"""
from __future__ import annotations

from array import array
from collections.abc import Mapping
from numbers import Integral, Real
from typing import Any, Dict, List, Optional, Tuple, Type

from mtflow.core.errors import RequestError, RolloutFnError, SchedulerResultError

__all__ = [
    'check_output', 'check_turn_result', 'check_bool', 'check_ids', 'check_mask', 'check_logprobs', 'check_infos',
    'check_reward'
]


def _fail(cls: Type[RequestError], message: str, uuid: str, turn: Optional[int], field: str) -> RequestError:
    return cls(message, uuid=uuid, turn=turn, field=field)


def check_ids(value: Any, uuid: str, turn: Optional[int], field: str,
              cls: Type[RequestError] = SchedulerResultError) -> Optional[List[int]]:
    """``None`` or a list of ints (token ids)."""
    if value is None:
        return None
    if value.__class__ is list:  # the common case, checked at C speed (ints that fit 64 bits)
        try:
            array('q').fromlist(value)  # raises for anything but ints (fromlist: 3x faster than array('q', value))
            return value
        except (TypeError, OverflowError):
            pass
    if not isinstance(value, (list, tuple)):
        raise _fail(cls, f'must be a list of ints, got {type(value).__name__}', uuid, turn, field)
    for k, v in enumerate(value):
        if type(v) is not int and (not isinstance(v, Integral) or isinstance(v, bool)):
            raise _fail(cls, f'must be a list of ints, item {k} is {type(v).__name__} {v!r:.40}', uuid, turn, field)
    return value if type(value) is list else list(value)


def check_mask(value: Any, uuid: str, turn: Optional[int], field: str) -> Optional[List[int]]:
    """``None`` or a list of 0/1 values (a loss mask)."""
    if value is None:
        return None
    if value.__class__ is list:
        try:
            if set(value) <= _ZERO_ONE:
                return value
        except TypeError:  # unhashable items
            pass
    if not isinstance(value, (list, tuple)):
        raise _fail(SchedulerResultError, f'must be a list of 0/1, got {type(value).__name__}', uuid, turn, field)
    for k, v in enumerate(value):
        if v.__class__ not in (int, bool) or (v != 0 and v != 1):
            raise _fail(SchedulerResultError, f'must be a list of 0/1, item {k} is {v!r:.40}', uuid, turn, field)
    return value if type(value) is list else list(value)


def check_logprobs(value: Any, uuid: str, turn: Optional[int], field: str) -> Optional[List[float]]:
    """``None`` or a list of numbers (per-token logprobs)."""
    if value is None:
        return None
    if value.__class__ is list:
        try:
            array('d').fromlist(value)  # raises for anything but numbers
            return value
        except TypeError:
            pass
    if not isinstance(value, (list, tuple)):
        raise _fail(SchedulerResultError, f'must be a list of floats, got {type(value).__name__}', uuid, turn,
                    field)
    for k, v in enumerate(value):
        if type(v) is not float and (not isinstance(v, Real) or isinstance(v, bool)):
            raise _fail(SchedulerResultError, f'must be a list of floats, item {k} is {v!r:.40}', uuid, turn, field)
    return value if type(value) is list else list(value)


def check_infos(value: Any, uuid: str, turn: Optional[int], field: str = 'rollout_infos') -> Optional[Mapping]:
    """``None``, a mapping, or what ``dict.update`` takes (an iterable of key/value pairs, as
    ms-swift's driver accepts it), returned as a mapping."""
    if value is None or value.__class__ is dict or isinstance(value, Mapping):
        return value
    if isinstance(value, (str, bytes)) or not hasattr(value, '__iter__'):
        raise _fail(SchedulerResultError, f'must be a dict, got {type(value).__name__}', uuid, turn, field)
    try:
        return dict(value)
    except (TypeError, ValueError) as exc:
        raise _fail(SchedulerResultError, f'must be a dict (or key/value pairs), got {type(value).__name__}: {exc}',
                    uuid, turn, field) from None


def check_bool(value: Any, uuid: str, turn: Optional[int], field: str) -> bool:
    """A real boolean: ``bool``, numpy's ``bool_``, or ``None``/``0``/``1``. Anything else
    (``"no"``, a list) is rejected instead of being read as truthy."""
    if value is True or value is False:
        return value
    if value is None:
        return False
    if type(value).__name__ == 'bool_' or (type(value) is int and value in (0, 1)):
        return bool(value)
    raise _fail(SchedulerResultError, f'must be a bool, got {type(value).__name__} {value!r:.40}', uuid, turn, field)


def check_reward(value: Any, uuid: str, turn: Optional[int], field: str = 'reward') -> float:
    """A finite number (an int, a float, numpy's or torch's scalars: anything ``float()`` takes
    but text and bools), as a float: a reward of ``'great'`` or ``True`` is a mistake, named."""
    if not isinstance(value, (str, bytes, bool)) and value is not None:
        try:
            number = float(value)
        except (TypeError, ValueError):
            pass
        else:
            if number == number and number not in (float('inf'), float('-inf')):
                return number
            raise _fail(SchedulerResultError, f'must be a finite number, got {number}', uuid, turn, field)
    raise _fail(SchedulerResultError, f'must be a number, got {type(value).__name__} {value!r:.40}', uuid, turn, field)


_EMPTY: Dict[str, Any] = {}
_ZERO_ONE = frozenset((0, 1))


def check_turn_result(value: Any, uuid: str, turn: int) -> Mapping[str, Any]:
    """What ``on_turn_end`` returned: ``None`` or a dict whose mtflow/ms-swift keys have the
    right types (``done`` bool, ``finish_reason`` non-empty str, ``rollout_infos`` mapping,
    ``response_token_ids``/``response_loss_mask``/``rollout_logprobs`` lists)."""
    if value is None:
        return _EMPTY
    if value.__class__ is dict and len(value) == 1 and value.get('rollout_infos').__class__ is dict:
        return value  # the common shape, {'rollout_infos': {...}}: nothing else to check
    if not isinstance(value, dict):
        if isinstance(value, Mapping):
            value = dict(value)
        else:
            if hasattr(value, '__await__'):
                getattr(value, 'close', lambda: None)()
            raise _fail(SchedulerResultError, f'on_turn_end must return a dict, got {type(value).__name__}', uuid,
                        turn, 'on_turn_end')
    if not value:
        return value
    checked = None
    if 'done' in value:
        done = check_bool(value['done'], uuid, turn, 'done')
        if done is not value['done']:
            checked = dict(value)
            checked['done'] = done
    reason = value.get('finish_reason')
    if reason is not None and (not isinstance(reason, str) or not reason):
        raise _fail(SchedulerResultError, f'must be a non-empty str, got {type(reason).__name__} {reason!r:.40}', uuid,
                    turn, 'finish_reason')
    infos = value.get('rollout_infos')
    if infos is not None and infos.__class__ is not dict:
        mapped = check_infos(infos, uuid, turn)
        if mapped is not infos:
            checked = checked or dict(value)
            checked['rollout_infos'] = mapped
    if 'response_token_ids' in value:
        check_ids(value['response_token_ids'], uuid, turn, 'response_token_ids')
    if 'response_loss_mask' in value:
        check_mask(value['response_loss_mask'], uuid, turn, 'response_loss_mask')
    if 'rollout_logprobs' in value:
        check_logprobs(value['rollout_logprobs'], uuid, turn, 'rollout_logprobs')
    return checked if checked is not None else value


def check_output(output: Any, uuid: str, turn: int) -> Tuple[Any, Any]:
    """One engine output: ``(response, choice)`` with a str ``message.content``, ids a list of
    ints or ``None``, ``logprobs`` ``None`` or a dict whose ``content`` items carry a number
    ``logprob``, ``finish_reason`` a str or ``None``. Raises :class:`RolloutFnError`."""
    try:
        response = output.response
        choice = response.choices[0]
        content = choice.message.content
        ids = choice.token_ids
        logprobs = choice.logprobs
        finish_reason = choice.finish_reason
    except Exception as exc:
        raise _fail(RolloutFnError, f'cannot read the output: {type(exc).__name__}: {exc}', uuid, turn,
                    'response') from None
    if content.__class__ is not str and not isinstance(content, str):
        raise _fail(RolloutFnError, f'must be a str, got {type(content).__name__}', uuid, turn,
                    'response.choices[0].message.content')
    if ids is not None:
        try:
            array('q').fromlist(ids)  # check_ids' fast path, inlined (once per request and turn)
        except (TypeError, OverflowError):
            check_ids(ids, uuid, turn, 'response.choices[0].token_ids', RolloutFnError)
    if finish_reason is not None and finish_reason.__class__ is not str and not isinstance(finish_reason, str):
        raise _fail(RolloutFnError, f'must be a str or None, got {type(finish_reason).__name__}', uuid, turn,
                    'response.choices[0].finish_reason')
    if logprobs is not None:
        if logprobs.__class__ is not dict and not isinstance(logprobs, dict):
            raise _fail(RolloutFnError, f'must be a dict or None, got {type(logprobs).__name__}', uuid, turn,
                        'response.choices[0].logprobs')
        items = logprobs.get('content')
        if items is not None:
            if items.__class__ is not list:
                raise _fail(RolloutFnError, f"'content' must be a list, got {type(items).__name__}", uuid, turn,
                            'response.choices[0].logprobs')
            try:
                array('d').fromlist([item['logprob'] for item in items])
                bad = False
            except (TypeError, KeyError, IndexError):
                bad = True
            if bad:
                raise _fail(RolloutFnError, "every item of 'content' must be a dict with a number 'logprob'", uuid,
                            turn, 'response.choices[0].logprobs')
    return response, choice
