"""One rollout of a dataset into a run directory: what ``mtflow run`` does, as a library.

- :mod:`~mtflow.run.config`: the run config (``RunConfig``, ``load_run_config``).
- :mod:`~mtflow.run.preflight`: every problem of a config before anything runs (``mtflow validate``).
- :mod:`~mtflow.run.assembly`: the backend, scheduler and seeds a run is built from (locally, or
  inside each Ray actor).
- :mod:`~mtflow.run.progress`: requests, turns against the bound, tokens/s and ETA, as a live bar
  or log lines; :mod:`~mtflow.run.tracking`: the same and the summary to TensorBoard or W&B.
- :mod:`~mtflow.run.driver`: the rollout loop, every finished request streamed to the store.
- :mod:`~mtflow.run.store`: the crash-safe run directory (``--resume``, ``--overwrite``), built
  from :mod:`~mtflow.run.files`, :mod:`~mtflow.run.recovery` and :mod:`~mtflow.run.groups`.
- :mod:`~mtflow.run.trajectories`: the ``trajectories.jsonl`` format (with ``reward``, ``group``,
  ``reference``).
- :mod:`~mtflow.run.tally`, :mod:`~mtflow.run.reward_spread`, :mod:`~mtflow.run.summary`:
  ``summary.json`` and the table printed at the end.
- :mod:`~mtflow.run.fingerprint`, :mod:`~mtflow.run.signals`: what a resume must match; clean
  stops on SIGINT/SIGTERM.

Nothing is re-exported here: the viewer imports :mod:`mtflow.run.trajectories` alone and must not
load the rest (backends, executor, declarative schedulers) with it.
"""
