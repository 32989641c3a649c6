"""``mtflow replay`` of a gateway run serves the recorded outputs to a re-run agent by session and
turn: an agent that asks the same thing gets the same answers (the exact ids rebuilt), one whose
prompt differs gets a 409 ``replay_diverged``; ``mtflow diff`` tells the two runs apart."""
from __future__ import annotations

import json
import signal

import httpx
import pytest

from mtflow.cli import main
from tests.gateway.helpers import ADD_TOOL, TIMEOUT_S, assert_tokens_exact, lines
from tests.gateway.test_cli import Served
from tests.tiny_model import make_tokenizer

openai = pytest.importorskip('openai')


def _episode(url: str, session: str, tool_result: str) -> list:
    """An agent: a tool call, the tool's result, an answer; the texts it got."""
    client = openai.OpenAI(base_url=f'{url}/s/{session}/v1', api_key='unused', timeout=TIMEOUT_S, max_retries=0)
    messages = [{'role': 'user', 'content': f'Add two and three ({session}).'}]
    first = client.chat.completions.create(model='m', messages=messages, tools=[ADD_TOOL]).choices[0].message
    messages += [first.model_dump(exclude_none=True),
                 {'role': 'tool', 'tool_call_id': first.tool_calls[0].id, 'content': tool_result}]
    second = client.chat.completions.create(model='m', messages=messages, tools=[ADD_TOOL]).choices[0].message
    assert httpx.post(f'{url}/s/{session}/finish', json={'reward': 1}, timeout=TIMEOUT_S).status_code == 200
    return [first.tool_calls[0].function.arguments, second.content]


def test_a_gateway_run_replays_by_session_and_turn(tmp_path, capsys):
    make_tokenizer().save_pretrained(tmp_path / 'tok')
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    script = [{'uuid': s, 'turn': 1, 'content': call} for s in ('same', 'other')]
    script += [{'uuid': s, 'turn': 2, 'content': f'Five ({s}).'} for s in ('same', 'other')]
    (tmp_path / 'script.jsonl').write_text(''.join(json.dumps(line) + '\n' for line in script))
    config = tmp_path / 'gateway.yaml'
    config.write_text(f'backend: scripted\nbackend_options: {{path: script.jsonl, tokenizer: {tmp_path / "tok"}}}\n'
                      'request_config: {max_tokens: 64}\n')
    served = Served(config, tmp_path / 'first')
    recorded = {s: _episode(served.url, s, '5') for s in ('same', 'other')}
    assert served.stop(signal.SIGINT)[0] == 0

    again = Served(config, tmp_path / 'replayed', argv=['replay', str(tmp_path / 'first'), '--out',
                                                        str(tmp_path / 'replayed'), '-q'])
    assert _episode(again.url, 'same', '5') == recorded['same']
    client = openai.OpenAI(base_url=f'{again.url}/s/other/v1', api_key='unused', timeout=TIMEOUT_S, max_retries=0)
    messages = [{'role': 'user', 'content': 'Add two and three (other).'}]
    first = client.chat.completions.create(model='m', messages=messages, tools=[ADD_TOOL]).choices[0].message
    assert first.tool_calls[0].function.arguments == recorded['other'][0]  # turn 1 is the same prompt
    messages += [first.model_dump(exclude_none=True),
                 {'role': 'tool', 'tool_call_id': first.tool_calls[0].id, 'content': '6'}]  # a tool answers otherwise
    with pytest.raises(openai.ConflictError, match='replay_diverged'):
        client.chat.completions.create(model='m', messages=messages, tools=[ADD_TOOL])
    code, err = again.stop(signal.SIGINT)
    assert code == 0, err
    by_uuid = {line['uuid']: line for line in lines(tmp_path / 'replayed')}
    assert by_uuid['same']['finish_reason'] == 'client_finished'
    other = by_uuid['other']  # ended at turn 2, whose recorded output answered another prompt: not applied
    assert (other['finish_reason'], other['num_turns']) == ('replay_diverged', 2)
    assert other['messages'][-1]['content'] == '6'
    summary = json.loads((tmp_path / 'replayed' / 'summary.json').read_text())
    assert summary['replay'] == {'of': str(tmp_path / 'first'), 'replayed_outputs': 3, 'diverged': 1,
                                 'live_outputs': 0}
    first_run = {line['uuid']: line for line in lines(tmp_path / 'first')}
    assert by_uuid['same']['response_token_ids'] == first_run['same']['response_token_ids']
    capsys.readouterr()
    assert main(['diff', str(tmp_path / 'first'), str(tmp_path / 'replayed')]) == 1
    assert_tokens_exact(tmp_path / 'first', segments=2)

