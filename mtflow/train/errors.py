"""The error of the training layer."""
from __future__ import annotations

from mtflow.core.errors import RequestError

__all__ = ['SampleError']


class SampleError(RequestError):
    """A trajectory that cannot give exact training samples; the message names the request, the
    turn and the field (``request r0#1, turn 2, field 'prompt_ids': ...``)."""
