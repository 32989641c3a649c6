"""Token ids to text for the detail views: optional, and only as good as the tokenizer given.

Without a tokenizer the views show ids. A tokenizer is either a ``tokenizers`` JSON file
(``tokenizer.json``) or anything ``transformers.AutoTokenizer`` loads from a local path; both are
imported only here, only when asked for.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional, Sequence

from mtflow.backends.base import BackendError
from mtflow.backends.models import EMBEDDED_NAMES, embedded_model_dir


def load_tokenizer(spec: Optional[str]) -> Any:
    """Load a tokenizer from a ``tokenizer.json`` file, a local model/tokenizer directory, or
    ``embedded`` (the embedded model's, from its converted copy: no hub, no network)."""
    if not spec:
        return None
    if spec in EMBEDDED_NAMES:
        try:
            spec = str(embedded_model_dir())
        except BackendError as exc:
            raise ValueError(f'cannot load tokenizer {spec!r}: {exc}') from None
    path = Path(spec)
    if path.is_file() and path.suffix == '.json':
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))
    if path.is_dir() and (path / 'tokenizer.json').is_file() and not (path / 'tokenizer_config.json').is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path / 'tokenizer.json'))
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ValueError(f'cannot load tokenizer {spec!r}: transformers is not installed ({exc})') from exc
    if not path.exists():
        raise ValueError(f'cannot load tokenizer {spec!r}: no such file or directory (give a tokenizer.json, a local '
                         f"model directory, or 'embedded')")
    try:
        return AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except Exception as exc:
        raise ValueError(f'cannot load tokenizer {spec!r}: {type(exc).__name__}: {" ".join(str(exc).split())}') from exc


def token_texts(ids: Sequence[int], tokenizer: Any) -> List[str]:
    """The text of each token on its own (``str(id)`` for each without a tokenizer).

    Each id is decoded alone, so byte-level pieces render as they would in the text (``Ġ`` becomes
    a space); a token that is part of a multi-byte character shows as ``�``."""
    if tokenizer is None:
        return [str(i) for i in ids]
    out = []
    for i in ids:
        try:
            text = tokenizer.decode([int(i)])
        except Exception:  # an id outside the vocabulary: show it rather than fail the view
            text = f'<{i}>'
        out.append(text)
    return out
