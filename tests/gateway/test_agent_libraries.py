"""Agent libraries from the registry, unchanged, each run as its own process with its OpenAI client
pointed at a gateway session (``OPENAI_BASE_URL``): the OpenAI Agents SDK with a function tool (on
its default Responses API and on chat completions), smolagents' ``ToolCallingAgent`` (which sends
``tool_choice: required``) and ``CodeAgent`` with ``OpenAIServerModel``. The scripted model
makes the calls (a tiny random model would not call a tool); every segment passes ``mtflow
check-tokens``. smolagents writes its own history (``Calling tools: [...]``, ``Observation: ...``)
instead of the model's text, so each of its calls starts a new segment (``assistant_edited``)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mtflow import RequestConfig
from mtflow.gateway import Gateway
from tests.gateway.helpers import TIMEOUT_S, assert_tokens_exact, lines, scripted

ROOT = Path(__file__).resolve().parents[2]
AGENTS = Path(__file__).resolve().parent / 'agents'
#: the OpenAI Agents SDK, installed apart from the venv by scripts/test.sh (its wheel pins websockets<17)
AGENTS_SDK = ROOT / '.extras' / 'openai-agents'
ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def _run_agent(tmp_path: Path, outputs: list, script: str, extra_path: str = '', flags: tuple = ()) -> tuple:
    """Serve ``outputs``, run ``script`` against session ``ep``, finish it with reward 1; the
    agent's output and the trajectory line."""
    with Gateway(scripted(*outputs), tmp_path / 'run', request_config=RequestConfig(max_tokens=64)) as gw:
        path = os.pathsep.join(p for p in (extra_path, str(ROOT)) if p)
        env = dict(os.environ, OPENAI_BASE_URL=gw.base_url('ep'), OPENAI_API_KEY='unused', PYTHONPATH=path,
                   OPENAI_AGENTS_DISABLE_TRACING='1')
        done = subprocess.run([sys.executable, str(AGENTS / script), *flags, 'What is 2 + 3?'], env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S * 2)
        assert done.returncode == 0, done.stderr[-3000:]
        assert httpx.post(f'{gw.url}/s/ep/finish', json={'reward': 1}, timeout=TIMEOUT_S).status_code == 200
    [line] = lines(tmp_path / 'run')
    return done.stdout.strip(), line


@pytest.mark.parametrize('api', ['responses', 'chat_completions'])
def test_the_openai_agents_sdk_with_a_function_tool(tmp_path, api):
    """On its default Responses API, and on chat completions."""
    if (AGENTS_SDK / 'agents').is_dir():
        extra = str(AGENTS_SDK)
    elif importlib.util.find_spec('agents') is not None:
        extra = ''
    else:
        pytest.skip('openai-agents is not installed (scripts/test.sh installs it into .extras/openai-agents)')
    answer, line = _run_agent(tmp_path, [ADD, 'The sum is 5.'], 'openai_agents_sdk.py', extra,
                              ('--chat', ) if api == 'chat_completions' else ())
    assert answer == 'The sum is 5.'
    assert [m['role'] for m in line['messages']] == ['system', 'user', 'assistant', 'tool', 'assistant']
    assert line['messages'][3]['content'] == '5'  # the SDK ran the tool the model called
    assert line['num_turns'] == 2 and line['reward'] == 1.0
    assert_tokens_exact(tmp_path / 'run', segments=1)  # the SDK sends the history back unchanged: one segment


def test_smolagents_tool_calling_agent(tmp_path):
    pytest.importorskip('smolagents')
    final = '<tool_call>\n{"name": "final_answer", "arguments": {"answer": "5"}}\n</tool_call>'
    answer, line = _run_agent(tmp_path, [ADD, final], 'smolagents_tool_calling.py')
    assert answer == '5'
    assert line['messages'][-2] == {'role': 'user', 'content': 'Observation:\n5'}
    [closed] = line['rollout_infos']['context_segments']
    assert closed['ended_by']['kind'] == 'assistant_edited'
    assert_tokens_exact(tmp_path / 'run', segments=2)


def test_smolagents_code_agent(tmp_path):
    pytest.importorskip('smolagents')
    outputs = ['Thought: I compute it.\n<code>\nresult = 2 + 3\nprint(result)\n</code>',
               'Thought: done.\n<code>\nfinal_answer(result)\n</code>']
    answer, line = _run_agent(tmp_path, outputs, 'smolagents_code.py')
    assert answer == '5'
    assert 'Execution logs:\n5' in line['messages'][-2]['content']
    # it keeps the model's text and appends its own note: an edit that extends the text, still a new segment
    [closed] = line['rollout_infos']['context_segments']
    assert closed['ended_by']['kind'] == 'assistant_edited' and closed['ended_by']['char'] == len(outputs[0])
    assert_tokens_exact(tmp_path / 'run', segments=2)
