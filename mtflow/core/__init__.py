"""The vocabulary and the rules every layer above shares.

- request and response models (:mod:`~mtflow.core.protocol`), errors (:mod:`~mtflow.core.errors`);
- the per-request state machine: states, triggers, finish reasons and the declared graph
  (:mod:`~mtflow.core.machine`), the records handed between phases (:mod:`~mtflow.core.records`),
  the stop decision (:mod:`~mtflow.core.stop`), the trace (:mod:`~mtflow.core.trace`);
- calling user code under deadlines (:mod:`~mtflow.core.calls`), checking what it returns
  (:mod:`~mtflow.core.validate`), whether it can be called as mtflow calls it
  (:mod:`~mtflow.core.signatures`), the shapes it must have (:mod:`~mtflow.core.types`), the
  Python scheduler API (:mod:`~mtflow.core.scheduler`);
- the ``module:attr`` resolver (:mod:`~mtflow.core.registry`) and the YAML reader
  (:mod:`~mtflow.core.safe_yaml`).

Nothing here imports another mtflow package; import the modules themselves.
"""
