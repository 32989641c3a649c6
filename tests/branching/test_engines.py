"""A fork's children reach the cache that holds their parent's prefix: real test chat servers on
127.0.0.1 with a simulated prefix cache (``tests/backends/chat_server.py``) behind one OpenAI
backend; each child's first turn is placed on its parent's server and served from its cache.
And the backends that keep per-request state go on from the parent (scripted, the turn log)."""
from __future__ import annotations

import pytest

pytest.importorskip('httpx')
pytest.importorskip('transformers')

from mtflow import Branching, Executor  # noqa: E402
from mtflow.accounting.token_record import RecordAccounting  # noqa: E402
from mtflow.backends.openai_server import OpenAIBackend  # noqa: E402
from mtflow.backends.scripted import ScriptedBackend  # noqa: E402
from mtflow.run.turn_log import TurnLog  # noqa: E402
from tests.backends.routing_util import CONFIG, GoOn, enter, hf, leave, make_servers, task, tok  # noqa: E402,F401
from tests.helpers import req  # noqa: E402

pytestmark = pytest.mark.hf


@pytest.mark.parametrize('routing', ['sticky_least_loaded', 'consistent_hash'])
def test_each_child_goes_where_its_parent_is_cached(hf, tok, routing):
    servers = make_servers(hf, 3, cache_block=16)
    enter(servers)
    try:
        with OpenAIBackend(urls=[s.base_url for s in servers], routing=routing, tokenizer=tok, backoff=0.01,
                           model='tiny-qwen2', health_interval_s=0) as client:
            requests = [task(i) for i in range(4)]
            result = Executor(GoOn(), client, CONFIG, max_turns=3, accounting=RecordAccounting(),
                              branch=Branching(at={'turn': 2}, copies=3)).run(requests)
            logs = {r.uuid: client.serving(r.uuid) for r in requests}
    finally:
        leave(servers)
    assert result.ok and len(requests) == 12
    for uuid, log in logs.items():
        assert [e['replica'] for e in log] == [log[0]['replica']] * 3, (uuid, log)  # every turn, one server
        if '~' in uuid:
            parent = logs[uuid.split('~')[0]]
            assert log[0] == parent[0]  # its turn 1 is its parent's entry
            assert log[1]['replica'] == parent[1]['replica']
            # the child's first own prompt is the parent's turn-1 sequence and more: served from the cache
            assert log[1]['cached_tokens'] >= 16 * ((parent[0]['prompt_tokens']) // 16) > 0
            assert log[1]['cached_tokens'] / log[1]['prompt_tokens'] > 0.8


def test_the_scripted_backend_and_the_turn_log_go_on_from_the_parent():
    script = ScriptedBackend(outputs=[{'uuid': 'a', 'turn': 1, 'content': 'one', 'token_ids': [1]},
                                      {'uuid': 'a', 'turn': 2, 'content': 'two a', 'token_ids': [2]},
                                      {'uuid': 'a~1', 'turn': 2, 'content': 'two b', 'token_ids': [3]},
                                      {'uuid': 'a', 'turn': 3, 'content': 'three', 'token_ids': [4]}])
    log = TurnLog()
    requests = [req('a')]
    result = Executor(GoOn(), log.wrap(script), max_turns=3, branch={'at': {'turn': 2}}).run(requests)
    assert result.ok
    by_uuid = {r.uuid: o for r, o in zip(requests, result.outputs)}
    assert [m['content'] for m in by_uuid['a~1'].messages if m['role'] == 'assistant'] == ['one', 'two b', 'three']
    assert [m['content'] for m in by_uuid['a'].messages if m['role'] == 'assistant'] == ['one', 'two a', 'three']
    # the child's notes (its trajectory line's turns) start with its parent's turn 1
    assert [t['text'] for t in log._notes['a~1']] == ['one', 'two b', 'three']
