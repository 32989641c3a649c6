"""The Ray fan-out with compaction on gives the single-process outputs: each actor resolves the
budget against its own backend, and every trajectory (segments included) and its trace path are
the ones a single executor produces."""
from __future__ import annotations

from pathlib import Path

import pytest

ray = pytest.importorskip('ray')

from mtflow import ContextBudget, Executor, RequestConfig  # noqa: E402
from mtflow.declarative.context import count_words  # noqa: E402
from mtflow.distributed import WorkerSpec, ray_run  # noqa: E402
from mtflow.run.trajectories import finished_to_record  # noqa: E402

from tests.context.helpers import growing_scheduler, requests, scripted_backend  # noqa: E402

pytestmark = pytest.mark.slow
BUDGET = ContextBudget(context_length=1000, policy='drop_observations', keep_last_turns=1, count_tokens=count_words)
CONFIG = RequestConfig(max_tokens=50)


def _path(events):
    return [(e['turn'], e['from'], e['to'], e['trigger'], e['reason']) for e in events]


def test_ray_fan_out_gives_the_single_process_outputs_with_compaction():
    reference = {}

    def on_finished(f):
        reference[f.uuid] = finished_to_record(f)

    Executor(growing_scheduler(), scripted_backend(), CONFIG, on_error='return', on_finished=on_finished,
             context=BUDGET).run(requests(4))
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address='127.0.0.1', object_store_memory=100 * 1024**2,
             runtime_env={'env_vars': {'PYTHONPATH': str(Path(__file__).resolve().parents[2])}})
    try:
        records = []
        spec = WorkerSpec(make_backend=scripted_backend, make_scheduler=growing_scheduler, request_config=CONFIG,
                          executor_options={'context': BUDGET})
        result = ray_run(requests(4), spec, num_actors=2, batch_size=2, sink=records.append)
    finally:
        ray.shutdown()
    assert result.delivered == 4 and result.finish_reasons == {'max_turns': 4}
    for rec in records:
        traj, events = reference[rec.uuid]
        drop = ('rank', 'turns', 'index')
        assert {k: v for k, v in rec.trajectory.items() if k not in drop} == \
            {k: v for k, v in traj.items() if k not in drop}
        assert rec.trajectory['rollout_infos']['compactions'] == 1
        assert _path(rec.events) == _path(events)
