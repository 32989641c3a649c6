"""Requests, configs, messages, choices, responses and outputs, between mtflow's pydantic models
and ms-swift's types, losing no field.

ms-swift's trainers and engines check the class of what they are given, and mtflow's executor
and backends read mtflow's models, so every object that crosses is rebuilt as the other side's
class. Values are not copied and nothing is validated away: a field one side's class does not
declare travels as an attribute (a pydantic extra), so a round trip gives back what went in.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import swift.infer_engine.protocol as swift_protocol

from mtflow.core import protocol as mtflow_protocol

__all__ = ['to_swift', 'from_swift']

#: nested fields that hold protocol objects: class name -> {field: (shape, class name)}
NESTED_FIELDS: Dict[str, Dict[str, Tuple[str, str]]] = {
    'RolloutOutput': {'response': ('one', 'ChatCompletionResponse')},
    'ChatCompletionResponse': {'choices': ('list', 'ChatCompletionResponseChoice'), 'usage': ('one', 'UsageInfo')},
    'ChatCompletionResponseChoice': {'message': ('one', 'ChatMessage')},
    'ChatMessage': {'tool_calls': ('list', 'ChatCompletionMessageToolCall')},
    'ChatCompletionMessageToolCall': {'function': ('one', 'Function')},
}
#: the protocol classes both sides define under the same name
CONVERTIBLE = ('RolloutInferRequest', 'RequestConfig', 'Function', 'ChatCompletionMessageToolCall', 'ChatMessage',
               'UsageInfo', 'ChatCompletionResponseChoice', 'ChatCompletionResponse', 'RolloutOutput')
#: ms-swift's plain request becomes a rollout request (mtflow has only the rollout one)
CLASS_ALIASES = {'InferRequest': 'RolloutInferRequest'}


def _fields_of(obj: Any) -> Dict[str, Any]:
    """Every field of a pydantic model or dataclass, plus any attribute it carries undeclared."""
    if hasattr(type(obj), 'model_fields'):
        values = {k: getattr(obj, k) for k in type(obj).model_fields}
        values.update(getattr(obj, '__pydantic_extra__', None) or {})
        extra = {k: v for k, v in vars(obj).items() if k not in values and not k.startswith('_')}
        values.update(extra)
        return values
    if dataclasses.is_dataclass(obj):
        values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        values.update({k: v for k, v in vars(obj).items() if k not in values and not k.startswith('_')})
        return values
    raise TypeError(f'cannot convert {type(obj).__name__}: not a protocol object')


def _build(cls: type, values: Dict[str, Any]) -> Any:
    """An instance of ``cls`` holding exactly ``values`` (no validation rewrites a value; fields
    the class does not declare are kept as attributes / pydantic extras)."""
    if hasattr(cls, 'model_fields'):
        if cls.model_config.get('extra') == 'allow':
            return cls.model_construct(**values)
        known = {k: v for k, v in values.items() if k in cls.model_fields}
        obj = cls.model_construct(**known)
        for k, v in values.items():
            if k not in known:
                object.__setattr__(obj, k, v)
        return obj
    init = {f.name for f in dataclasses.fields(cls) if f.init}
    obj = cls(**{k: v for k, v in values.items() if k in init})
    for k, v in values.items():
        if k not in init:
            setattr(obj, k, v)
    return obj


def _convert(obj: Any, target_module: Any, name: Optional[str] = None) -> Any:
    """``obj`` rebuilt as the class of the same name in ``target_module``, nested objects too."""
    if obj is None:
        return None
    name = name or CLASS_ALIASES.get(type(obj).__name__, type(obj).__name__)
    if name not in CONVERTIBLE:
        raise TypeError(f'cannot convert {type(obj).__name__}: not one of {", ".join(CONVERTIBLE)}')
    values = _fields_of(obj)
    for field, (shape, sub) in NESTED_FIELDS.get(name, {}).items():
        value = values.get(field)
        if value is None:
            continue
        if shape == 'list':
            values[field] = [_convert(v, target_module, sub) if not isinstance(v, dict) else v for v in value]
        elif not isinstance(value, dict):
            values[field] = _convert(value, target_module, sub)
    return _build(getattr(target_module, name), values)


def to_swift(obj: Any) -> Any:
    """The ms-swift counterpart of an mtflow protocol object (or a list of them).

    Objects that already are ms-swift's pass through unchanged. Values are not copied (a
    request's ``messages`` list is the same list), and nothing is validated away: e.g. a
    ``RequestConfig(stop=None)`` stays ``None``."""
    if isinstance(obj, list):
        return [to_swift(o) for o in obj]
    if obj is None or type(obj).__module__.startswith('swift.'):
        return obj
    return _convert(obj, swift_protocol)


def from_swift(obj: Any) -> Any:
    """The mtflow counterpart of an ms-swift protocol object (or a list of them); fields mtflow's
    classes do not declare (e.g. ``add_eos``, ``routed_experts``, ``images_size``) are kept as
    pydantic extras, so :func:`to_swift` restores them."""
    if isinstance(obj, list):
        return [from_swift(o) for o in obj]
    if obj is None or type(obj).__module__.startswith('mtflow.'):
        return obj
    return _convert(obj, mtflow_protocol)
