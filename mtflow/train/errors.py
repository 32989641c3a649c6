"""The errors of the training layer."""
from __future__ import annotations

from mtflow.core.errors import RequestError, UserError

__all__ = ['SampleError', 'NotExpressibleInTRL']


class SampleError(RequestError):
    """A trajectory that cannot give exact training samples; the message names the request, the
    turn and the field (``request r0#1, turn 2, field 'prompt_ids': ...``)."""


class NotExpressibleInTRL(UserError, ValueError):
    """A scheduler that TRL's own tool loop cannot run (``environment_factory`` without
    ``rollout_func``): one line naming each feature and why, raised before training starts."""
