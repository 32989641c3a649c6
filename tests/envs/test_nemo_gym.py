"""NeMo Gym resources servers (``env: {nemo_gym: ...}``, nemo-gym 0.7) through ``mtflow run`` with
the scripted model replaying NeMo Gym's own recorded rollouts (``data/example_rollouts.jsonl`` of
three of its servers that run offline): each request's reward equals the reward NeMo Gym's own
pipeline gave those outputs, and every tool output the server returned under mtflow equals the one
it recorded (a differential test). The servers are started by the run (``launch``) in NeMo Gym's
venv; a failing server or verify fails its own request, named.

nemo-gym 0.7 declares Python >= 3.13.14; the newest Python here is 3.13.0, so scripts/test.sh
installs it with --ignore-requires-python into ``.extras/nemo-gym-venv`` (docs/environments.md)."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

pytest.importorskip('aiohttp', reason="needs aiohttp (the 'nemo-gym' extra)")

from mtflow.cli import main
from mtflow.run.token_check import check_run_tokens

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / '.extras' / 'nemo-gym-venv'
PYTHON = VENV / 'bin' / 'python'
SERVERS = next(iter(sorted(VENV.glob('lib/python3*/site-packages/resources_servers'))), None)

pytestmark = pytest.mark.skipif(SERVERS is None, reason='the NeMo Gym venv is not there (scripts/test.sh makes '
                                '.extras/nemo-gym-venv with nemo-gym 0.7 on Python 3.13)')

CASES = {  # server directory -> its resources server class
    'example_single_tool_call': 'SimpleWeatherResourcesServer',
    'example_session_state_mgmt': 'StatefulCounterResourcesServer',
    'example_multi_step': 'ExampleMultiStepResourcesServer',
}


def _turns(output):
    """A recorded response's model turns as completion texts (hermes tool calls; a message's text),
    and the recorded tool outputs."""
    turns, current, outputs = [], [], []
    for item in output:
        if item['type'] == 'function_call_output':
            outputs.append(item['output'])
            if current:
                turns.append('\n'.join(current))
                current = []
        elif item['type'] == 'function_call':
            call = {'name': item['name'], 'arguments': json.loads(item['arguments'])}
            current.append(f'<tool_call>{json.dumps(call)}</tool_call>')
        elif item['type'] == 'message':
            current.append(''.join(c.get('text', '') for c in item['content']))
    if current:
        turns.append('\n'.join(current))
    return turns, outputs


def _files(tmp_path, server):
    data = SERVERS / server / 'data'
    rows = {json.dumps(r['responses_create_params']['input'][-1]['content']): r
            for r in map(json.loads, (data / 'example.jsonl').read_text().splitlines())}
    rollouts = [json.loads(l) for l in (data / 'example_rollouts.jsonl').read_text().splitlines()]
    dataset, script, expected = [], [], {}
    for k, rollout in enumerate(rollouts):
        uuid = f'{server}-{k}'
        row = rows[json.dumps(rollout['responses_create_params']['input'][-1]['content'])]
        dataset.append({'uuid': uuid, **row})
        turns, outputs = _turns(rollout['response']['output'])
        script += [{'uuid': uuid, 'turn': t + 1, 'content': text} for t, text in enumerate(turns)]
        expected[uuid] = (rollout['reward'], outputs, len(turns))
    (tmp_path / 'rows.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in dataset))
    (tmp_path / 'model.jsonl').write_text(''.join(json.dumps(l) + '\n' for l in script))
    (tmp_path / 's.yaml').write_text(textwrap.dedent(f'''\
        name: nemo_{server}
        max_turns: 12
        env:
          nemo_gym:
            launch: resources_servers.{server}.app:{CASES[server]}
            python: {PYTHON}
          observation_role: tool
        stop: {{on_length: false}}
        '''))
    (tmp_path / 'run.yaml').write_text('scheduler: s.yaml\nbackend: scripted\nmodel: model.jsonl\n'
                                       'backend_options: {tokenizer: embedded}\n'  # exact token records
                                       'dataset: rows.jsonl\nout: out\nbatch_size: 8\n')
    return expected


@pytest.mark.parametrize('server', sorted(CASES))
def test_rewards_are_nemo_gyms_own_for_its_recorded_rollouts(tmp_path, monkeypatch, server):
    monkeypatch.chdir(tmp_path)
    expected = _files(tmp_path, server)
    assert main(['run', str(tmp_path / 'run.yaml'), '--no-progress']) == 0
    runs = {t['uuid']: t for t in map(json.loads, (tmp_path / 'out' / 'trajectories.jsonl').read_text().splitlines())}
    assert sorted(runs) == sorted(expected)
    for uuid, (reward, outputs, turns) in expected.items():
        line = runs[uuid]
        assert (line['reward'], line['finish_reason'], line['num_turns']) == (reward, 'stop_rule:env_done', turns), uuid
        seen = [json.loads(text) for m in line['messages'] if m['role'] == 'tool' for text in m['content'].split('\n')]
        assert seen == [json.loads(o) for o in outputs], uuid  # the server's own answers, as recorded
    report = check_run_tokens(tmp_path / 'out' / 'trajectories.jsonl')  # exact tokens on mtflow's side
    assert report.ok and not report.problems and report.segments >= len(expected), report.problems
    if server == 'example_single_tool_call':  # some recorded rollouts earn nothing: the comparison can fail
        assert {r for r, _, _ in expected.values()} == {0.0, 1.0}


def test_a_failing_row_or_server_fails_its_own_request_named():
    from mtflow import Executor
    from mtflow.core.protocol import RolloutInferRequest
    from mtflow.data import nemo_gym_row
    from mtflow.declarative import load_scheduler
    from tests.helpers import out
    sched = load_scheduler({'max_turns': 4, 'env': {'nemo_gym': {
        'launch': 'resources_servers.example_session_state_mgmt.app:StatefulCounterResourcesServer',
        'python': str(PYTHON)}, 'observation_role': 'tool'}})
    tools = [{'type': 'function', 'name': n, 'parameters': {'type': 'object', 'properties': {}}, 'strict': False}
             for n in ('increment_counter', 'get_counter_value')]

    def request(uuid, extra, names=('increment_counter', 'get_counter_value')):
        row = nemo_gym_row({'uuid': uuid, 'responses_create_params': {'input': [{'role': 'user', 'content': 'add 2'}],
                           'tools': [t for t in tools if t['name'] in names] + (
                               [{'type': 'function', 'name': 'reset_counter'}] if 'reset_counter' in names else [])},
                            **extra}, 'test')
        return RolloutInferRequest(messages=row['messages'], tools=row['tools'], data_dict=row['data_dict'], uuid=uuid)

    reqs = [request('good', {'initial_count': 1, 'expected_count': 3}),
            request('no-expected', {'initial_count': 1}),
            request('unknown-tool', {'initial_count': 1, 'expected_count': 3}, names=('reset_counter', ))]
    replies = ['<tool_call>{"name": "increment_counter", "arguments": {"count": 2}}</tool_call>', 'Done.']

    def rollout(requests, request_config=None):
        return [out(replies[sum(1 for m in r.messages if m['role'] == 'assistant')]) for r in requests]

    try:
        result = Executor(sched, rollout, max_turns=4, on_error='return').run(reqs)
    finally:
        sched.close()
    assert result.finish_reasons == ['stop_rule:env_done', 'error', 'error']
    assert result.outputs[0].rollout_infos['reward'] == 1.0 and reqs[0].messages[-2]['content'] == '{"success":true}'
    errors = {f.uuid: str(f.error) for f in result.failures}
    name = "NeMo Gym environment 'resources_servers.example_session_state_mgmt.app:StatefulCounterResourcesServer'"
    assert errors['no-expected'].startswith(f'{name} failed at verify (step 2): NemoGymError: status 422:')
    assert 'expected_count' in errors['no-expected']
    assert errors['unknown-tool'] == (f"{name} failed at reset: NemoGymError: the row names tool(s) 'reset_counter' "
                                      'that the server does not serve; it serves: get_counter_value, increment_counter')


def test_a_server_that_is_not_there_is_each_requests_error():
    from mtflow import Executor
    from mtflow.declarative import load_scheduler
    from mtflow.declarative.envs.local_servers import free_port
    from tests.helpers import out, req
    url = f'http://127.0.0.1:{free_port()}'
    sched = load_scheduler({'max_turns': 2, 'env': {'nemo_gym': {'url': url, 'request_timeout_s': 2}}})
    result = Executor(sched, lambda rs, rc=None: [out('hi') for _ in rs], max_turns=2, on_error='return').run(
        [req('a', {'role': 'user', 'content': 'x'})])
    sched.close()
    (failure, ) = result.failures
    assert str(failure.error).startswith(f"NeMo Gym environment '{url}' failed to start: NemoGymError: NeMo Gym server "
                                         f"'{url}': URLError:")
