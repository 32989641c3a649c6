"""One way for every trainer integration to name its scheduler: a scheduler object, a YAML file,
or ``'module:Class'`` / ``'file.py:Class'`` (what ``mtflow run``'s ``scheduler:`` takes), so a
trainer's own config (verl's agent-loop YAML, a TRL script) can name the scheduler as text."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from mtflow.declarative import load_scheduler
from mtflow.run.assembly import load_python_scheduler, takes_tokenizer

__all__ = ['make_scheduler']

YAML_SUFFIXES = ('.yaml', '.yml')


def make_scheduler(spec: Any, tokenizer: Any = None, args: Optional[Dict[str, Any]] = None) -> Any:
    """The scheduler ``spec`` names: itself when it is one (it has ``step``), a YAML file loaded
    with ``tokenizer``, or a ``module:Class`` factory called with ``args`` (and ``tokenizer``
    when it takes one). A wrong value is an error naming it."""
    if spec is not None and not isinstance(spec, (str, Path)) and callable(getattr(spec, 'step', None)):
        return spec
    if not isinstance(spec, (str, Path)) or not str(spec):
        raise ValueError(f"scheduler must be a scheduler, a YAML file or 'module:Class', not {spec!r}")
    text = str(spec)
    if text.endswith(YAML_SUFFIXES):
        if not Path(text).is_file():
            raise FileNotFoundError(f'scheduler file not found: {text}')
        return load_scheduler(text, tokenizer=tokenizer)
    factory = load_python_scheduler(text, Path.cwd())
    kwargs = dict(args or {})
    try:
        built = factory(**kwargs, tokenizer=tokenizer) if tokenizer is not None and 'tokenizer' not in kwargs \
            and takes_tokenizer(factory) else factory(**kwargs)
    except TypeError as exc:
        raise ValueError(f'scheduler {text!r}: bad arguments {sorted(kwargs)}: {exc}') from None
    if not callable(getattr(built, 'step', None)):
        raise ValueError(f'scheduler {text!r} built a {type(built).__name__}, which has no step() method')
    return built

