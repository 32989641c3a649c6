"""Schema features beyond the ready schedulers: stop tools, predicates, rewards, a Python
subclass named in YAML, the JSON parser, system prompt modes, observation truncation."""
from __future__ import annotations

from mtflow import Executor
from mtflow.declarative import YamlScheduler, load_scheduler
from tests.helpers import Scripted, req

from .util import ids_of, model_out, tok

ME = __name__


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: the key
    """
    return f'value of {key} ' * 20


def submit(answer: str) -> str:
    """Submit the final answer."""
    raise AssertionError('a stop tool is never run')


def says_bye(infer_request, response_choice, turn):
    return 'bye' if 'bye' in response_choice.message.content else False


def reward(infer_request, infos):
    return 10.0 * infos.get('tool_calls', 0) + (1.0 if infos['stop_rule'] == 'stop_rule:stop_tool' else 0.0)


class Counting(YamlScheduler):
    """A Python subclass named by ``scheduler_class``: overrides one hook, keeps the rest."""
    finished = []

    async def on_request_finished(self, infer_request, reason, turn):
        Counting.finished.append((infer_request.uuid, reason, turn))
        await super().on_request_finished(infer_request, reason, turn)


def config(**kw):
    cfg = {'name': 'features', 'parser': 'json',
           'tools': [{'name': 'lookup', 'impl': f'{ME}:lookup', 'max_observation': 6},
                     {'name': 'submit', 'impl': f'{ME}:submit'}],
           'stop': {'stop_tools': ['submit'], 'predicate': f'{ME}:says_bye'},
           'reward': f'{ME}:reward', 'scheduler_class': f'{ME}:Counting',
           'system_prompt': 'Tools:\n{tools}', 'system_prompt_mode': 'prepend'}
    cfg.update(kw)
    return cfg


def run(s, script, requests):
    return Executor(s, Scripted({u: [model_out(t) for t in ts] for u, ts in script.items()})).run(requests)


def test_stop_tool_predicate_reward_and_subclass():
    Counting.finished.clear()
    s = load_scheduler(config(), tokenizer=tok())
    assert type(s) is Counting
    assert s.finish_reasons == ('stop_rule:stop_tool', 'stop_rule:predicate', 'stop_rule:no_tool_call')
    look = '{"name": "lookup", "arguments": {"key": "k"}}'
    res = run(s, {'a': [look, '```json\n{"name": "submit", "arguments": {"answer": "v"}}\n```'],
                  'b': ['ok bye'], 'c': ['nothing']},
              [req('a', {'role': 'system', 'content': 'Mine.'}, {'role': 'user', 'content': 'q'}), req('b'), req('c')])
    assert res.finish_reasons == ['stop_rule:stop_tool', 'stop_rule:bye', 'stop_rule:no_tool_call']
    a = res.outputs[0]
    assert a.messages[0]['content'].startswith('Tools:\n{"type": "function"') and a.messages[0]['content'].endswith(
        '\n\nMine.')
    # the observation was cut to 6 tokens of the test tokenizer, with a marker
    obs = a.messages[3]['content']
    head, marker = obs.split('\n')
    assert tok().encode(head, add_special_tokens=False) == ids_of(lookup('k'))[:6]
    assert marker.startswith('[... ') and marker.endswith(' tokens truncated]')
    assert a.rollout_infos['reward'] == 11.0 and a.rollout_infos['tool_calls'] == 1
    assert res.outputs[1].rollout_infos['reward'] == 0.0
    assert sorted(Counting.finished) == [('a', 'stop_rule:stop_tool', 2), ('b', 'stop_rule:bye', 1),
                                         ('c', 'stop_rule:no_tool_call', 1)]


def test_replace_and_if_missing_system_prompt():
    s = load_scheduler(config(system_prompt_mode='replace', scheduler_class=None))
    r = s.prepare(req('x', {'role': 'system', 'content': 'Mine.'}, {'role': 'user', 'content': 'q'}))
    assert r.messages[0]['content'].startswith('Tools:') and 'Mine.' not in r.messages[0]['content']
    s = load_scheduler(config(system_prompt_mode='if_missing', scheduler_class=None))
    r = s.prepare(req('y', {'role': 'system', 'content': 'Mine.'}))
    assert r.messages[0] == {'role': 'system', 'content': 'Mine.'}


def test_nudge_tip_when_no_tool_call_and_max_turns():
    s = load_scheduler({'name': 'nudge', 'max_turns': 3, 'tools': [{'name': 'calculator'}],
                        'tips': [{'name': 'nudge', 'when': 'no_tool_call', 'placement': 'user', 'max_times': 5,
                                  'text': 'Please call a tool.'}]})
    res = run(s, {'a': ['hi', 'hello', 'hey']}, [req('a')])
    assert res.finish_reasons == ['max_turns']
    o = res.outputs[0]
    assert [m['content'] for m in o.messages if m['role'] == 'user'][1:] == ['Please call a tool.'] * 2
    assert o.rollout_infos['tips_given'] == {'nudge': 2}
