"""A typo in ``scheduler_args`` is never ignored: mtflow's base ``Scheduler`` refuses a keyword no
class of the scheduler takes, naming it and the closest one, also when a subclass forwards
``**kwargs`` (which the preflight cannot read ahead); the keywords ms-swift 4.6 passes every
scheduler it builds (``tokenizer``, ``template``, ``gym_env``, ``use_gym_env``) keep working."""
from __future__ import annotations

import json

import pytest

from mtflow import Executor, Scheduler
from mtflow.cli import main
from mtflow.core.scheduler import UnknownSchedulerArgument
from tests.helpers import out, req

HINTED = '''
from mtflow import Scheduler


class Hinted(Scheduler):
    """ms-swift style: its own keyword, the rest forwarded to the base class."""

    def __init__(self, hint='higher', **kwargs):
        super().__init__(**kwargs)
        self.hint = hint

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': self.hint})
        return {'infer_request': infer_request}
'''


class Hinted(Scheduler):
    def __init__(self, hint: str = 'higher', **kwargs):
        super().__init__(**kwargs)
        self.hint = hint

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': self.hint})
        return {'infer_request': infer_request}


def test_an_unknown_keyword_names_the_closest_one_the_classes_take():
    with pytest.raises(UnknownSchedulerArgument) as caught:
        Hinted(hnit='lower')
    message = str(caught.value)
    assert message.startswith("Hinted() got an unexpected keyword argument 'hnit'; did you mean 'hint'? (known: hint, "
                              'infer_engine, max_turns, tokenizer, template, gym_env, use_gym_env)')
    assert isinstance(caught.value, TypeError)  # what Python raises for an unexpected keyword
    with pytest.raises(TypeError, match=r"Scheduler\(\) takes infer_engine and max_turns .* got 1 more \('extra'\)"):
        Scheduler(None, 3, 'extra')


def test_what_ms_swift_passes_every_scheduler_still_builds_and_runs():
    tokenizer, template = object(), object()
    sched = Hinted(hint='lower', infer_engine=None, max_turns=2, tokenizer=tokenizer, template=template,
                   gym_env='env-name', use_gym_env=True)
    assert (sched.tokenizer, sched._template, sched.max_turns, sched.hint) == (tokenizer, template, 2, 'lower')
    result = Executor(sched, lambda rs, cfg=None: [out('ok', [1]) for _ in rs]).run([req('a')])
    assert result.ok and [m['content'] for m in result.outputs[0].messages if m['role'] == 'user'][-1] == 'lower'


def test_mtflow_run_names_the_key_at_its_line_and_the_flag_that_set_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv('MTFLOW_DEBUG', raising=False)
    (tmp_path / 'hinted.py').write_text(HINTED)
    (tmp_path / 'data.jsonl').write_text(json.dumps({'uuid': 'a', 'prompt': 'guess'}) + '\n')
    (tmp_path / 'run.yaml').write_text('scheduler: hinted.py:Hinted\nscheduler_args:\n  hnit: lower\nbackend: scripted\n'
                                       'backend_options: {outputs: [fifty], cycle: true}\ndataset: data.jsonl\n'
                                       'out: out\nmax_turns: 2\n')
    assert main(['run', 'run.yaml', '-q']) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("mtflow: run.yaml:3: scheduler_args.hnit: unknown key 'hnit' for hinted.py:Hinted; did you "
                           "mean 'hint'? (known: hint, infer_engine, max_turns, tokenizer, template, gym_env, "
                           'use_gym_env)')
    assert not (tmp_path / 'out').exists()  # nothing of a run is left behind
    (tmp_path / 'run.yaml').write_text((tmp_path / 'run.yaml').read_text().replace('  hnit: lower\n', '  {}\n'))
    assert main(['run', 'run.yaml', '-q', '--set', 'scheduler_args.hnit=lower']) == 2
    assert capsys.readouterr().err.startswith("mtflow: command line: --set scheduler_args.hnit=lower: "
                                              "scheduler_args.hnit: unknown key 'hnit'")
    assert main(['run', 'run.yaml', '-q', '--set', 'scheduler_args.hint=lower']) == 0
    messages = json.loads((tmp_path / 'out' / 'trajectories.jsonl').read_text())['messages']
    assert [m['content'] for m in messages if m['role'] == 'user'][-1] == 'lower'
