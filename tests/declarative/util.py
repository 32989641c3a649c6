"""Scripted model outputs with real token ids (the shared BPE tokenizer) and fixed logprobs."""
from __future__ import annotations

from typing import Any, List, Optional

from tests.helpers import out
from tests.tiny_model import make_tokenizer


def tok() -> Any:
    return make_tokenizer()


def logprobs_for(n: int, start: float = -0.1) -> List[float]:
    """Distinct, recognisable logprobs so misalignment shows up in comparisons."""
    return [round(start - 0.01 * i, 4) for i in range(n)]


def model_out(text: str, finish_reason: Optional[str] = 'stop', with_logprobs: bool = True) -> Any:
    """An output whose token ids are the tokenizer's encoding of ``text`` (as a backend gives)."""
    ids = tok().encode(text, add_special_tokens=False)
    return out(text, ids, logprobs_for(len(ids)) if with_logprobs else None, finish_reason=finish_reason)


def ids_of(text: str) -> List[int]:
    return tok().encode(text, add_special_tokens=False)
