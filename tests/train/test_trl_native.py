"""An mtflow scheduler as an environment of TRL's own tool loop (``mtflow.train.trl_native``),
without TRL: the class TRL would be given, its methods as TRL calls them (``await
env.calculator(expression=...)``), and every scheduler feature TRL's loop cannot run refused
with one line. ``tests/train/trl116/test_native_tool_loop.py`` trains through TRL 1.16 itself."""
from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

import pytest

from mtflow.core.errors import SchedulerResultError
from mtflow.declarative import YamlScheduler, load_scheduler
from mtflow.train import NotExpressibleInTRL, TRLToolEnvironment, trl_tool_environment

from tests.train.helpers import ToolEveryTurn
from tests.train.trl116 import native_tools

SUBMIT = native_tools.ARITH['tools'][1]
ARITH = dict(native_tools.ARITH, observation=dict(native_tools.ARITH['observation'], prefix='[', suffix=']'))


def methods(cls):
    """What TRL 1.16 exposes as tools: the class's public functions but ``reset`` and ``get_reward``."""
    return sorted(n for n, _ in inspect.getmembers(cls, inspect.isfunction)
                  if not n.startswith('_') and n not in ('reset', 'get_reward'))


def run(coro):
    return asyncio.run(coro)


def test_the_tools_are_methods_whose_schema_reads_back_as_the_scheduler_declares_it():
    from transformers.utils import get_json_schema

    scheduler = load_scheduler(ARITH)
    env = trl_tool_environment(scheduler)
    assert issubclass(env, TRLToolEnvironment) and env.__name__ == 'arith' and methods(env) == ['calculator', 'submit']
    assert 'ids are TRL\'s, not mtflow\'s' in ' '.join(env.__doc__.split())
    for tool in scheduler.tools:
        method = getattr(env(), tool.name)
        assert inspect.iscoroutinefunction(method)  # run on TRL's event loop, like mtflow's async tools
        assert get_json_schema(method) == tool.spec()


def test_richer_schemas_read_back_typed_and_what_a_signature_cannot_say_is_refused(tmp_path):
    from transformers.utils import get_json_schema

    params = {'type': 'object', 'required': ['query'], 'properties': {
        'query': {'type': 'string', 'description': 'what to look for'},
        'limit': {'type': 'integer', 'description': 'at most this many', 'default': 5},
        'mode': {'type': 'string', 'enum': ['fast', 'exact'], 'description': 'how'},
        'tags': {'type': 'array', 'items': {'type': 'string'}, 'description': 'filters'},
        'cursor': {'type': ['string', 'null'], 'description': 'where to go on'}}}
    tool = dict(SUBMIT, name='search', description='Search the notes.', parameters=params)
    env = trl_tool_environment(load_scheduler({'tools': [tool]}))
    read = get_json_schema(env.search)['function']
    assert read['description'] == 'Search the notes.' and read['parameters']['required'] == ['query']
    props = read['parameters']['properties']
    assert props['limit'] == {'type': 'integer', 'description': 'at most this many'}
    assert props['mode'] == {'type': 'string', 'enum': ['fast', 'exact'], 'description': 'how'}
    assert props['tags'] == {'type': 'array', 'items': {'type': 'string'}, 'description': 'filters'}
    assert props['cursor'] == {'type': 'string', 'nullable': True, 'description': 'where to go on'}
    bounded = dict(tool, parameters={'type': 'object', 'properties': {'n': {'type': 'integer', 'minimum': 1}}})
    with pytest.raises(NotExpressibleInTRL, match=r"tool 'search', argument 'n': minimum cannot be carried"):
        trl_tool_environment(load_scheduler({'tools': [bounded]}))
    misread = dict(tool, description='Search. Returns: the hits')  # transformers' docstring parser would cut it
    with pytest.raises(NotExpressibleInTRL, match=r"TRL would read its description as 'Search.'"):
        trl_tool_environment(load_scheduler({'tools': [misread]}))


def test_a_call_runs_mtflows_tool_and_answers_with_the_schedulers_observation():
    env = trl_tool_environment(load_scheduler(ARITH))()
    env.reset(prompt=[{'role': 'user', 'content': 'What is 6 * 7?'}], answer='42')
    assert run(env.calculator(expression='6 * 7')) == '[Result: 42]'
    assert run(env.calculator(expression='6 *')).startswith('[Oops: calculator raised')
    assert run(env.calculator(expr='6 * 7')) == ('[Oops: bad arguments for calculator: missing required argument(s): '
                                                'expression]')  # mtflow's argument check, as the model reads it
    native_tools.SUBMITTED.clear()
    assert run(env.submit(answer='42')) == '[Result: received 42]' and native_tools.SUBMITTED == ['42']
    request, infos = env._reward_args()
    assert [m['role'] for m in request.messages] == ['user'] + ['assistant', 'tool'] * 4
    assert infos == {'tool_calls': 4, 'tool_errors': 2, 'tool_error_kinds': {'exception': 1, 'bad_arguments': 1}}
    assert env.get_reward() == 1.0 - 0.5  # the scheduler's reward: right answer, two failed calls


def test_each_instance_keeps_its_own_episode_and_reset_starts_a_new_one():
    cls = trl_tool_environment(load_scheduler(ARITH))
    a, b = cls(), cls()
    a.reset(prompt='What is 6 * 7?', answer='42')
    b.reset(prompt='What is 5 + 5?', answer='10')
    run(a.submit(answer='42'))
    run(b.calculator(expression='5 +'))
    run(b.submit(answer='11'))
    assert (a.get_reward(), b.get_reward()) == (1.0, -0.25)
    assert a._request.uuid != b._request.uuid
    a.reset(prompt='What is 6 * 7?', answer='42')  # TRL reuses instances: a reset forgets the last episode
    assert a.get_reward() == 0.0 and a._request.messages == [{'role': 'user', 'content': 'What is 6 * 7?'}]
    with pytest.raises(RuntimeError, match='before reset'):
        run(cls().submit(answer='1'))


def test_the_reward_is_checked_may_be_async_and_is_absent_without_one(monkeypatch):
    bad = trl_tool_environment(load_scheduler(dict(ARITH, reward='tests.train.test_trl_native:says_great')))()
    bad.reset(prompt='hi', answer='1')
    with pytest.raises(SchedulerResultError, match=r"arith-0.*reward \(tests.train.test_trl_native:says_great\).*"
                                                   "must be a number"):
        bad.get_reward()
    slow = trl_tool_environment(load_scheduler(dict(ARITH, reward='tests.train.test_trl_native:async_graded')))
    assert inspect.iscoroutinefunction(slow.get_reward)  # TRL awaits an async get_reward on its loop
    episode = slow()
    episode.reset(prompt='hi', answer='7')
    run(episode.submit(answer='7'))
    assert run(episode.get_reward()) == 1.0
    unscored = trl_tool_environment(load_scheduler({'tools': [{'name': 'calculator'}]}))
    assert not hasattr(unscored, 'get_reward')  # TRL then asks for reward_funcs, as for any environment without one


def test_a_tool_that_returns_images_stops_at_the_reward():
    env = trl_tool_environment(load_scheduler(dict(ARITH, tools=[dict(SUBMIT, name='snap', impl='tests.train.'
                                                                      'test_trl_native:snapshot')])))()
    env.reset(prompt='hi', answer='1')
    run(env.snap(answer='x'))
    with pytest.raises(Exception, match=r"tool 'snap' returned 1 image\(s\)"):
        env.get_reward()


def test_max_turns_becomes_trls_bound_on_tool_rounds():
    scheduler = load_scheduler(dict(ARITH, max_turns=4))
    args = SimpleNamespace(max_tool_calling_iterations=None)
    trl_tool_environment(scheduler, args)
    assert args.max_tool_calling_iterations == 3  # four turns: three rounds of tool calls
    trl_tool_environment(scheduler, args)  # the same bound again: fine
    with pytest.raises(NotExpressibleInTRL, match=r'max_turns \(4\) is 3 rounds of tool calls, but the GRPOConfig has '
                                                  r'max_tool_calling_iterations=5'):
        trl_tool_environment(scheduler, SimpleNamespace(max_tool_calling_iterations=5))
    with pytest.raises(NotExpressibleInTRL, match=r'pass its GRPOConfig .* max_tool_calling_iterations=3'):
        trl_tool_environment(scheduler)


REFUSED = [
    ({'env': {'impl': 'guess_number'}, 'tools': []}, 'env: the environment reads every reply'),
    ({'stop': {'stop_tools': ['submit']}}, 'stop.stop_tools (submit): a stop rule that ends an episode'),
    ({'stop': {'regex': {'answered': '<answer>'}}}, 'stop.regex (answered): a stop rule'),
    ({'stop': {'correct_answer': True}, 'answer': {'field': 'answer'}}, 'stop.correct_answer: a stop rule'),
    ({'stop': {'predicate': 'tests.train.test_trl_native:never'}}, 'stop.predicate: a stop rule'),
    ({'stop': {'on_length': False}}, 'stop.on_length: false continues a reply'),
    ({'answer': {'field': 'answer'}}, 'answer: reads the final reply'),
    ({'tips': [{'when': 'always', 'text': 'check'}]}, 'tips: a hint after a reply'),
    ({'observation': {'mode': 'inline'}}, 'observation.mode: inline continues the assistant message'),
    ({'observation': {'role': 'user'}}, 'observation.role: user'),
    ({'observation': {'one_message_per_call': False}}, 'observation.one_message_per_call: false'),
    ({'observation': {'template': '{index}. {result}'}}, 'observation.template: {index}'),
    ({'system_prompt': 'Use {tools}'}, 'system_prompt: TRL renders the prompt'),
    ({'tool_errors': 'finish'}, 'tool_errors: finish ends the episode'),
    ({'max_tool_calls_per_turn': 2}, 'max_tool_calls_per_turn: a TRL environment cannot tell'),
    ({'turn_reward': 'tests.train.test_trl_native:turn_zero'}, 'turn_reward: a per-turn reward'),
    ({'tools': [{'name': 'calculator', 'reward': {'ok': 0.1}}]}, 'tools[0].reward (calculator): a per-turn reward'),
    ({'finish_policy': {'length': 'mask'}}, 'finish_policy: decides by finish reason'),
    ({'branch': {'at': {'turn': 2}}}, 'branch: forks an episode'),
    ({'tools': []}, "tools: none, and TRL's loop calls an environment only through its tools"),
    ({'tools': [dict(SUBMIT, name='reset')]}, "tools[0].name ('reset'): TRL takes it for the environment's own method"),
]


@pytest.mark.parametrize('change, named', REFUSED, ids=[named.split(':')[0] for _, named in REFUSED])
def test_what_trls_loop_cannot_run_is_refused_in_one_line_naming_it(change, named):
    with pytest.raises(NotExpressibleInTRL) as refused:
        trl_tool_environment(load_scheduler(dict(ARITH, **change)))
    message = str(refused.value)
    assert '\n' not in message and named in message, message
    assert message.startswith("scheduler 'arith' cannot be a TRL environment without rollout_func: ")


def test_every_problem_is_named_at_once_and_real_schedulers_say_why():
    with pytest.raises(NotExpressibleInTRL) as refused:
        trl_tool_environment(load_scheduler('schedulers/scripted_tools.yaml'))
    message = str(refused.value)
    for feature in ('stop.regex (answered)', 'answer:', 'system_prompt:', 'max_turns (5)'):
        assert feature in message, message
    hermes = load_scheduler('schedulers/hermes_tools.yaml')
    with pytest.raises(NotExpressibleInTRL, match='system_prompt: TRL renders the prompt and the tools with the chat '
                                                  "template; put the system message in the dataset's prompt"):
        trl_tool_environment(hermes, SimpleNamespace(max_tool_calling_iterations=None))


class Graded(YamlScheduler):
    """A Python scheduler that can be one: the YAML behaviour, its reward written in Python."""

    @property
    def reward_function(self):
        return lambda request, infos: float(infos['tool_calls'])


class Reviewing(YamlScheduler):
    async def on_turn_end(self, infer_request, response_choice, current_turn):
        return await super().on_turn_end(infer_request, response_choice, current_turn)


def test_a_path_or_a_wrong_config_is_named():
    with pytest.raises(NotExpressibleInTRL, match=r'takes a scheduler \(load_scheduler\(path_or_dict, tokenizer=...\) '
                                                  r'makes one\), not a str'):
        trl_tool_environment('schedulers/hermes_tools.yaml')
    with pytest.raises(NotExpressibleInTRL, match="args must be TRL's GRPOConfig, and a SimpleNamespace has no "
                                                  'max_tool_calling_iterations'):
        trl_tool_environment(load_scheduler(dict(ARITH, max_turns=2)), SimpleNamespace())


def test_python_schedulers_are_one_where_their_hooks_are_the_yaml_ones():
    from mtflow.declarative.schema import SchedulerConfig

    config = SchedulerConfig.model_validate({'tools': [{'name': 'calculator'}]})
    env = trl_tool_environment(Graded(config))()
    env.reset(prompt='hi')
    run(env.calculator(expression='1 + 1'))
    assert env.get_reward() == 1.0
    with pytest.raises(NotExpressibleInTRL, match="Reviewing.on_turn_end: overrides a per-turn hook"):
        trl_tool_environment(Reviewing(config))
    with pytest.raises(NotExpressibleInTRL, match=r"ToolEveryTurn.step: a Python scheduler acts on every reply"):
        trl_tool_environment(ToolEveryTurn(max_turns=3))


def says_great(infer_request, rollout_infos):
    return 'great'


async def async_graded(infer_request, rollout_infos):
    return native_tools.graded(infer_request, rollout_infos)


def never(infer_request, response_choice, turn):
    return False


def turn_zero(infer_request, completion, rollout_infos, turn):
    return 0.0


def snapshot(answer: str):
    """Return a tiny picture.

    Args:
        answer: ignored.
    """
    from PIL import Image

    return [Image.new('RGB', (2, 2)), 'a picture']
