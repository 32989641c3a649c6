"""``mtflow run`` end to end with a tiny local model (saved with ``save_pretrained``), a Python
scheduler from a file, and a JSONL dataset; plus every user error as one line."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mtflow.cli import main
from mtflow.core.trace import Trace
from mtflow.run.trajectories import read_trajectories

SCHEDULER = '''
import re
from mtflow import Scheduler

class HigherLower(Scheduler):
    """Answers every guess with higher/lower; counts each answer as one tool call."""
    finish_reasons = ('stop_rule:correct',)

    def __init__(self, hint='Guess again.', tokenizer=None, **kw):
        super().__init__(tokenizer=tokenizer, **kw)
        self.hint = hint
        self.had_tokenizer = tokenizer is not None

    def check_finished(self, infer_request, response_choice, current_turn):
        return False

    def step(self, infer_request, response_choice, current_turn):
        numbers = re.findall(r'\\d+', response_choice.message.content or '')
        obs = f'{numbers[-1]} is wrong. ' if numbers else ''
        infer_request.messages.append({'role': 'user', 'content': obs + self.hint})
        ids = response_choice.token_ids or []
        return {'infer_request': infer_request, 'response_token_ids': ids, 'response_loss_mask': [1] * len(ids),
                'rollout_infos': {'had_tokenizer': self.had_tokenizer},
                'trace_info': {'tool_calls': 1, 'tool_errors': 0 if numbers else 1}}
'''


@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
    pytest.importorskip('transformers')
    from tests.tiny_model import make_model, make_tokenizer

    d = tmp_path_factory.mktemp('tiny-qwen2')
    tok = make_tokenizer()
    make_model(tok, seed=2).save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture
def project(tmp_path, model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv('MTFLOW_CACHE', str(tmp_path / 'cache'))
    (tmp_path / 'sched.py').write_text(SCHEDULER)
    lines = [{'uuid': f'p{i}', 'prompt': f'guess a number {i}', 'target': i} for i in range(5)]
    (tmp_path / 'prompts.jsonl').write_text(''.join(json.dumps(l) + '\n' for l in lines))
    (tmp_path / 'run.yaml').write_text(textwrap.dedent(f'''\
        scheduler: sched.py:HigherLower
        scheduler_args: {{hint: "Try higher."}}
        backend: hf
        model: {model_dir}
        dataset: prompts.jsonl
        out: out
        max_turns: 3
        batch_size: 2
        seed: 0
        request_config: {{max_tokens: 6, temperature: 1.0, logprobs: true}}
        '''))
    return tmp_path


def test_run_writes_trajectories_trace_and_summary(project, capsys):
    assert main(['run', 'run.yaml', '--no-progress']) == 0
    shown = capsys.readouterr().out
    assert 'requests' in shown and 'max_turns 5' in shown and 'min 3  mean 3.0  max 3' in shown
    assert '5 of 5 went past turn 1' in shown
    trajectories = read_trajectories(project / 'out' / 'trajectories.jsonl')
    assert list(trajectories) == ['p0', 'p1', 'p2', 'p3', 'p4']
    generated = 0
    for i, (uuid, t) in enumerate(trajectories.items()):
        assert t.index == i and t.finish_reason == 'max_turns' and t.num_turns == 3
        assert [m['role'] for m in t.messages] == ['user', 'assistant', 'user', 'assistant', 'user', 'assistant']
        assert t.messages[2]['content'].endswith('Try higher.'), 'scheduler_args reached the scheduler'
        lengths = [len(s) for s in t.response_token_ids]  # max_tokens 6, or up to the EOS it sampled
        assert len(lengths) == 3 and all(0 < n <= 6 for n in lengths) and sum(lengths) > 3
        assert t.response_loss_mask == [[1] * n for n in lengths] and [len(s) for s in t.rollout_logprobs] == lengths
        generated += sum(lengths)
        assert t.rollout_infos['had_tokenizer'] is True, "the backend's tokenizer was handed to the scheduler"
    trace = Trace.read_jsonl(project / 'out' / 'trace.jsonl')
    assert trace.uuids() == ['p0', 'p1', 'p2', 'p3', 'p4']
    assert [e.index for e in trace.events if e.dst == 'finished'] == [0, 1, 2, 3, 4], 'indices run across batches'
    assert trace.path('p3') == ('pending -> generating -> tool_step -> generating -> tool_step -> generating -> '
                                'finished(max_turns)')
    summary = json.loads((project / 'out' / 'summary.json').read_text())
    assert summary['requests'] == 5 and summary['finish_reasons'] == {'max_turns': 5}
    assert summary['turns']['histogram'] == {'3': 5}
    assert summary['rollout_fn_calls'] >= 9, '3 batches x 3 turns (the executor may add a last empty call)'
    assert summary['generated_tokens'] == generated
    assert summary['tool_calls'] == 10, 'two steps per request, one call each'
    assert summary['errors'] == 0 and summary['tokens_per_s'] > 0


def test_command_line_overrides_the_config(project, capsys):
    assert main(['run', 'run.yaml', '-q', '--max-turns', '1', '--limit', '2', '--out', 'o2', '--max-tokens', '3',
                 '--option', 'max_batch_size=1']) == 0
    assert capsys.readouterr().out == '', '--quiet prints nothing'
    summary = json.loads((project / 'o2' / 'summary.json').read_text())
    assert summary['requests'] == 2 and summary['turns']['max'] == 1 and summary['generated_tokens'] == 6
    t = read_trajectories(project / 'o2' / 'trajectories.jsonl')['p1']
    assert t.response_token_ids == [t.response_token_ids[0]] and len(t.response_token_ids[0]) == 3


def test_scripted_backend_through_the_command_line(project, capsys):
    (project / 'script.jsonl').write_text('{"content": "50", "token_ids": [7, 8], "logprobs": [-0.1, -0.2]}\n')
    assert main(['run', 'run.yaml', '--no-progress', '--backend', 'scripted', '--model', 'script.jsonl', '-o',
                 'cycle=true', '--max-turns', '2', '--out', 'o3']) == 0
    t = read_trajectories(project / 'o3' / 'trajectories.jsonl')['p0']
    assert t.messages[1] == {'role': 'assistant', 'content': '50'}
    assert t.messages[2]['content'] == '50 is wrong. Try higher.'
    assert t.response_token_ids == [[7, 8], [7, 8]] and t.rollout_logprobs == [[-0.1, -0.2], [-0.1, -0.2]]


def _error(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count('\n') == 1 and 'Traceback' not in err, err
    return err


def test_missing_config(project, capsys):
    assert 'config file not found: nope.yaml' in _error(['run', 'nope.yaml'], capsys)


def test_unknown_key_names_file_line_and_field(project, capsys):
    (project / 'bad.yaml').write_text('scheduler: sched.py:HigherLower\nmax_turn: 3\n')
    err = _error(['run', 'bad.yaml'], capsys)
    assert 'bad.yaml:2: max_turn: unknown key' in err


def test_wrong_type_names_the_line(project, capsys):
    (project / 'bad.yaml').write_text('scheduler: sched.py:HigherLower\nrequest_config:\n  temperature: hot\n')
    assert 'bad.yaml:3: request_config' in _error(['run', 'bad.yaml'], capsys)


def test_unknown_backend(project, capsys):
    assert "unknown backend 'llamacpp'" in _error(['run', 'run.yaml', '--backend', 'llamacpp'], capsys)


def test_model_that_cannot_load(project, capsys):
    (project / 'empty_model').mkdir()
    err = _error(['run', 'run.yaml', '--model', 'empty_model'], capsys)
    assert "cannot load model '" in err and "empty_model'" in err


def test_a_scripted_model_file_that_is_not_there_is_named_at_its_line(project, capsys):
    """The error named neither the file nor the line of the config's model: key."""
    (project / 'bad.yaml').write_text('scheduler: sched.py:HigherLower\nbackend: scripted\nmodel: modle.jsonl\n'
                                      'dataset: prompts.jsonl\n')
    assert 'bad.yaml:3: model: scripted backend: file not found: modle.jsonl' in _error(['run', 'bad.yaml'], capsys)


def test_validate_finds_what_the_scripted_backend_would_refuse(project, capsys):
    """validate said OK to a respond that does not resolve and to a script file that is not there;
    the run then refused them."""
    (project / 'bad.yaml').write_text('scheduler: sched.py:HigherLower\nbackend: scripted\nbackend_options: '
                                      '{respond: go}\ndataset: prompts.jsonl\n')
    assert main(['validate', 'bad.yaml']) == 1
    assert "bad.yaml:3: backend_options.respond: scripted backend: respond: reference 'go'" in capsys.readouterr().out
    (project / 'bad.yaml').write_text('scheduler: sched.py:HigherLower\nbackend: scripted\nmodel: modle.jsonl\n'
                                      'dataset: prompts.jsonl\n')
    assert main(['validate', 'bad.yaml']) == 1
    assert 'bad.yaml:3: model: scripted backend: file not found: modle.jsonl' in capsys.readouterr().out


def test_missing_dataset_and_bad_dataset_line(project, capsys):
    assert 'dataset not found: nothere.jsonl' in _error(['run', 'run.yaml', '--dataset', 'nothere.jsonl'], capsys)
    (project / 'broken.jsonl').write_text('{"prompt": "a"}\n{"messages": 3}\n')
    assert "broken.jsonl:2: 'messages' must be" in _error(['run', 'run.yaml', '--dataset', 'broken.jsonl'], capsys)


def test_missing_scheduler(project, capsys):
    (project / 'bad.yaml').write_text('scheduler: nowhere/guess.yaml\nmodel: x\n')
    assert 'scheduler file not found: nowhere/guess.yaml' in _error(['run', 'bad.yaml', '--backend', 'scripted',
                                                                     '--model', 'run.yaml'], capsys)


def test_the_installed_command_prints_one_line(project):
    script = Path(sys.executable).with_name('mtflow')
    cmd = [str(script)] if script.exists() else [sys.executable, '-c', 'import sys; from mtflow.cli import main; '
                                                                      'sys.exit(main())']
    proc = subprocess.run(cmd + ['run', 'missing.yaml'], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr == 'mtflow: config file not found: missing.yaml\n'


ROOT = Path(__file__).resolve().parents[1]


def test_the_default_config_plays_several_turns(tmp_path, monkeypatch, capsys):
    """configs/default.yaml (the README's main job) with its model swapped for replayed outputs:
    the guess-the-number scheduler makes every request play several turns."""
    monkeypatch.chdir(tmp_path)
    assert main(['run', str(ROOT / 'configs' / 'default.yaml'), '--no-progress', '--backend', 'scripted', '--model',
                 str(ROOT / 'configs' / 'scripted_guesses.jsonl'), '-o', 'cycle=true', '--limit', '4']) == 0
    shown = capsys.readouterr().out
    assert '4 of 4 went past turn 1' in shown
    summary = json.loads((tmp_path / 'runs' / 'default' / 'summary.json').read_text())
    assert summary['turns']['min'] >= 2 and summary['errors'] == 0
    t = read_trajectories(tmp_path / 'runs' / 'default' / 'trajectories.jsonl')['guess-00']
    assert t.messages[0]['role'] == 'system' and 'too' in t.messages[3]['content']
    assert t.rollout_infos['env_info']['target'] == 42, 'the bundled dataset sets the target'


def test_the_scripted_demo_config_runs_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(['run', str(ROOT / 'configs' / 'scripted_demo.yaml'), '-q']) == 0
    summary = json.loads((tmp_path / 'runs' / 'scripted_demo' / 'summary.json').read_text())
    assert summary['requests'] == 16 and summary['turns']['min'] == 6


def test_a_scheduler_by_module_and_class(project, capsys):
    (project / 'bymodule.yaml').write_text(textwrap.dedent('''\
        scheduler: tests.test_cli_run:OneTurn
        backend: scripted
        model: script.jsonl
        dataset: prompts.jsonl
        out: o4
        '''))
    (project / 'script.jsonl').write_text('"7"\n' * 5)
    assert main(['run', 'bymodule.yaml', '-q']) == 0
    summary = json.loads((project / 'o4' / 'summary.json').read_text())
    assert summary['finish_reasons'] == {'check_finished': 5}


class OneTurn:
    """A duck-typed scheduler (no base class): stops after the first turn."""

    def step(self, infer_request, response_choice, current_turn):
        return {'infer_request': infer_request}

    def check_finished(self, infer_request, response_choice, current_turn):
        return True


def test_paths_in_a_config_are_found_next_to_it(project, tmp_path_factory, monkeypatch):
    elsewhere = tmp_path_factory.mktemp('elsewhere')
    sub = project / 'exp'
    sub.mkdir()
    (sub / 'data.jsonl').write_text('{"prompt": "guess"}\n')
    (sub / 'script.jsonl').write_text('"12"\n')
    (sub / 'c.yaml').write_text('scheduler: ../sched.py:HigherLower\nbackend: scripted\nmodel: script.jsonl\n'
                                'dataset: data.jsonl\nout: here\nmax_turns: 1\n')
    monkeypatch.chdir(elsewhere)
    assert main(['run', str(sub / 'c.yaml'), '-q']) == 0
    t = read_trajectories(elsewhere / 'here' / 'trajectories.jsonl')['data-1']
    assert t.messages == [{'role': 'user', 'content': 'guess'}, {'role': 'assistant', 'content': '12'}]


def test_openai_backend_through_the_command_line(project, model_dir, capsys):
    """`mtflow run --backend openai` against a real HTTP server on 127.0.0.1 serving the tiny model."""
    pytest.importorskip('httpx')
    from mtflow.backends.hf import HFBackend
    from tests.backends.chat_server import ChatServer

    hf = HFBackend(str(model_dir))
    with ChatServer(hf, model_name='tiny') as server:
        assert main(['run', 'run.yaml', '--no-progress', '--backend', 'openai', '--model', 'tiny', '-o',
                     f'base_url={server.base_url}', '-o', 'max_connections=2', '--out', 'o5', '--limit', '3']) == 0
        bodies = list(server.bodies)
    assert 'openai (tiny at http://127.0.0.1' in capsys.readouterr().out
    summary = json.loads((project / 'o5' / 'summary.json').read_text())
    lines = read_trajectories(project / 'o5' / 'trajectories.jsonl')
    generated = sum(len(s) for t in lines.values() for s in t.response_token_ids)  # up to 6 a turn, or an EOS
    assert summary['finish_reasons'] == {'max_turns': 3} and summary['generated_tokens'] == generated > 3 * 3
    assert len(bodies) == 9 and all(b['return_token_ids'] and b['max_tokens'] == 6 for b in bodies)
    t = lines['p2']
    lengths = [len(s) for s in t.response_token_ids]
    assert len(lengths) == 3 and all(0 < n <= 6 for n in lengths) and [len(s) for s in t.rollout_logprobs] == lengths
