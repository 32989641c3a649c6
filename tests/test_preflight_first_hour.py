"""The first hour, round two (issue 40): mistakes that used to pass ``mtflow validate`` and show only
after a model load and a generation, each now one line naming file, line and key (or the flag),
found by ``validate`` and by ``mtflow run`` before the backend is built.

Every run here names a scripted ``model`` file that is there but holds no JSON: the backend's
preflight (which finds a script file that is missing) passes it, and building the backend would
fail on its first line, so an error about the mistake proves it was found first."""
from __future__ import annotations

import http.server
import json
import socket

import pytest

from mtflow.cli import main
from tests.helpers import http_server

REWARDS = '''
def wrong_sig_reward(completion):
    return 1.0


def good_reward(infer_request, rollout_infos):
    return 1.0


def compare_one(answer):
    return True
'''

SCHEDULERS = '''
import mtflow


class TwoArgStep(mtflow.Scheduler):
    def step(self, infer_request, response_choice):
        return {'infer_request': infer_request}


class GoodStep(mtflow.Scheduler):
    def step(self, infer_request, response_choice, current_turn):
        return {'infer_request': infer_request}

    def on_request_finished(self, infer_request):
        return None
'''


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv('MTFLOW_DEBUG', raising=False)
    (tmp_path / 'rewards.py').write_text(REWARDS)
    (tmp_path / 'never_built.jsonl').write_text('not a script: building the backend fails here\n')
    (tmp_path / 'scheds.py').write_text(SCHEDULERS)
    lines = [{'uuid': f'q{i}', 'prompt': f'{i} + 1?', 'answer': str(i + 1)} for i in range(6)]
    (tmp_path / 'data.jsonl').write_text(''.join(json.dumps(l) + '\n' for l in lines))

    def write(name, text):
        (tmp_path / name).write_text(text)
        return name

    return write


#: a run config over the scripted backend whose script cannot be read (see the module docstring)
BASE = 'backend: scripted\nmodel: never_built.jsonl\ndataset: data.jsonl\nout: out\n'


def _validate(args, capsys):
    code = main(['validate', *args])
    captured = capsys.readouterr()
    assert 'Traceback' not in captured.out + captured.err
    return code, captured.out + captured.err


def _run(args, capsys, tmp_path):
    code = main(['run', *args, '--no-progress'])
    err = capsys.readouterr().err
    assert 'Traceback' not in err, err
    assert 'never_built' not in err, 'the backend was built before the mistake was found'
    assert not (tmp_path / 'out').exists(), 'no run directory is written for a run that cannot start'
    return code, err


def test_a_reward_hook_with_the_wrong_signature_names_the_function_file_and_what_mtflow_passes(work, capsys,
                                                                                                 tmp_path):
    sched = work('sched.yaml', 'name: s\nmax_turns: 2\nreward: rewards:wrong_sig_reward\n'
                               'answer: {field: answer, compare: "rewards:compare_one"}\n')
    run = work('run.yaml', BASE + f'scheduler: {sched}\n')
    code, out = _validate([sched], capsys)
    assert code == 1
    reward_file = tmp_path / 'rewards.py'
    assert (f'sched.yaml:3: reward: wrong_sig_reward() in {reward_file}:2 takes (completion); mtflow calls it as '
            'reward(infer_request, rollout_infos)') in out
    assert (f'sched.yaml:4: answer.compare: compare_one() in {reward_file}:10 takes (answer); mtflow calls it as '
            'compare(answer, reference)') in out
    code, err = _run([run], capsys, tmp_path)
    assert code == 2 and 'sched.yaml:3: reward: wrong_sig_reward()' in err
    work('sched.yaml', 'name: s\nmax_turns: 2\nreward: rewards:good_reward\n')
    assert _validate([sched], capsys)[0] == 0


def test_a_python_scheduler_hook_with_the_wrong_signature_is_found_before_the_run(work, capsys, tmp_path):
    run = work('run.yaml', BASE + 'scheduler: scheds.py:TwoArgStep\n')
    code, out = _validate([run], capsys)
    assert code == 1
    assert (f'run.yaml:5: scheduler: scheds.py:TwoArgStep: TwoArgStep.step() in {tmp_path / "scheds.py"}:6 takes '
            '(self, infer_request, response_choice); mtflow calls it as step(infer_request, response_choice, '
            'current_turn)') in out
    assert _run([run], capsys, tmp_path)[0] == 2
    work('run.yaml', BASE + 'scheduler: scheds.py:GoodStep\n')
    code, out = _validate(['run.yaml'], capsys)
    assert code == 1 and 'GoodStep.on_request_finished() in' in out
    assert 'mtflow calls it as on_request_finished(infer_request, reason, turn)' in out


def test_an_answer_field_the_dataset_lacks_names_both_files_and_the_keys_it_has(work, capsys, tmp_path):
    sched = work('sched.yaml', 'name: s\nmax_turns: 2\nanswer:\n  pattern: "<answer>(.*?)</answer>"\n')
    run = work('run.yaml', BASE + f'scheduler: {sched}\n')
    code, out = _validate([run], capsys)
    assert code == 1
    assert (f"{tmp_path / 'sched.yaml'}:3: answer.field: 'solution' is not a key of {tmp_path / 'data.jsonl'}:1 "
            "(answer.field defaults to 'solution'): its keys: answer") in out
    code, err = _run([run], capsys, tmp_path)
    assert code == 2 and "answer.field: 'solution' is not a key of" in err
    work('sched.yaml', 'name: s\nmax_turns: 2\nanswer:\n  pattern: "<answer>(.*?)</answer>"\n  field: answr\n')
    code, out = _validate([run], capsys)
    assert code == 1 and f"sched.yaml:5: answer.field: 'answr' is not a key of {tmp_path / 'data.jsonl'}:1: " \
        "its keys: answer; did you mean 'answer'?" in out
    work('sched.yaml', 'name: s\nmax_turns: 2\nanswer:\n  field: answer\n')
    assert _validate([run], capsys)[0] == 0


@pytest.mark.parametrize('lines, flags, message', [
    ('request_config:\n  max_tokens: 8\n  temperature: -1.0\n', [],
     'run.yaml:8: request_config.temperature: must be >= 0 (got -1.0)'),
    ('request_config: {max_tokens: 8}\n', ['--temperature', '-1'],
     '--temperature -1.0: request_config: temperature: must be >= 0 (got -1.0)'),
    ('request_config:\n  max_tokens: 8\n  top_p: -0.5\n', [], 'run.yaml:8: request_config.top_p: must be in (0, 1] '
     '(got -0.5)'),
    ('request_config:\n  top_k: -3\n', [], 'run.yaml:7: request_config.top_k: must be >= -1 (-1 and 0: off; got -3)'),
    ('request_config:\n  min_p: 1.5\n', [], 'run.yaml:7: request_config.min_p: must be in [0, 1] (got 1.5)'),
    ('request_config:\n  n: 4\n', [], 'run.yaml:7: request_config.n: must be 1 for multi-turn rollouts (got 4)'),
    ('max_turns: 1000000000000\n', [], 'run.yaml:6: max_turns: Input should be less than or equal to 100000 (got '
     '1000000000000)'),
    ('max_turns: 3\n', ['--max-turns', '1000000000000'], '--max-turns 1000000000000: max_turns: Input should be '
     'less than or equal to 100000'),
])
def test_sampling_values_out_of_bounds_name_the_file_line_and_key(work, capsys, tmp_path, lines, flags, message):
    sched = work('sched.yaml', 'name: s\nmax_turns: 2\n')
    run = work('run.yaml', BASE + f'scheduler: {sched}\n' + lines)
    code, err = _run([run, *flags], capsys, tmp_path)
    assert code == 2 and message in err, err
    if not flags:
        code, out = _validate([run], capsys)
        assert code == 1 and message in out


def test_a_backend_options_typo_names_the_file_line_or_the_flag(work, capsys, tmp_path):
    sched = work('sched.yaml', 'name: s\nmax_turns: 2\n')
    run = work('run.yaml', BASE + f'scheduler: {sched}\nbackend_options:\n  cycle: true\n  cylce: true\n')
    message = ("backend_options.cylce: unknown key 'cylce' for backend scripted; did you mean 'cycle'? (known: path, "
               'outputs, respond, cycle, honor_max_tokens, tokenizer, chat_template, sample, seed, prefix_policy)')
    code, out = _validate([run], capsys)
    assert code == 1 and f'run.yaml:8: {message}' in out
    assert _run([run], capsys, tmp_path) == (2, f'mtflow: run.yaml:8: {message}\n')
    work('run.yaml', BASE + f'scheduler: {sched}\n')
    code, err = _run([run, '-o', 'cylce=true'], capsys, tmp_path)
    assert code == 2 and f'command line: -o cylce=True: {message}' in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class _Models(http.server.BaseHTTPRequestHandler):
    """``GET /v1/models`` of an OpenAI-compatible server that serves ``served-model``."""

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path != '/v1/models':
            self.send_error(404)
            return
        body = json.dumps({'object': 'list', 'data': [{'id': 'served-model', 'object': 'model'}]}).encode()
        self.send_response(200)
        self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def models_server():
    with http_server(_Models) as url:
        yield url


def test_an_openai_base_url_nobody_answers_fails_before_the_run_directory_is_written(work, capsys, tmp_path):
    sched = work('sched.yaml', 'name: s\nmax_turns: 2\n')
    port = _free_port()  # nothing listens there
    run = work('run.yaml', f'scheduler: {sched}\nbackend: openai\nmodel: served-model\ndataset: data.jsonl\n'
                           f'out: out\nbackend_options:\n  base_url: http://127.0.0.1:{port}/v1\n  max_retries: 5\n')
    message = (f'run.yaml:7: backend_options.base_url: openai backend: no server answers (GET '
               f'http://127.0.0.1:{port}/v1/models: Connection refused): start it, or fix base_url/urls')
    code, err = _run([run], capsys, tmp_path)
    assert code == 2 and err == f'mtflow: {message}\n'
    assert _run([run], capsys, tmp_path)[0] == 2, 'the rerun is not refused for a directory left behind'
    code, out = _validate([run], capsys)  # the server may be started later: a warning, as for OpenEnv urls
    assert code == 0 and f'warning: {message} (mtflow run stops on it)' in out
    code, out = _validate(['-q', run], capsys)
    assert code == 0 and f'warning: {message}' in out


def test_an_openai_model_the_server_does_not_list_names_what_it_serves(work, capsys, tmp_path, models_server):
    sched = work('sched.yaml', 'name: s\nmax_turns: 2\n')
    run = work('run.yaml', f'scheduler: {sched}\nbackend: openai\nmodel: served-modle\ndataset: data.jsonl\n'
                           f'out: out\nbackend_options: {{base_url: "{models_server}"}}\n')
    code, err = _run([run], capsys, tmp_path)
    assert code == 2
    assert err == (f"mtflow: run.yaml:6: backend_options.base_url: openai backend: {models_server} does not serve "
                   "model 'served-modle' (GET /models lists: served-model; did you mean 'served-model'?)\n")
    code, out = _validate([run], capsys)
    assert code == 1
    assert _validate([work('ok.yaml', open(run).read().replace('served-modle', 'served-model'))], capsys)[0] == 0


def test_a_stop_regex_that_matches_everything_is_an_error_at_its_line(work, capsys, tmp_path):
    """An empty stop regex used to stop every request at turn 1, silently."""
    sched = work('sched.yaml', "name: s\nmax_turns: 3\nstop:\n  regex:\n    answered: '<answer>'\n    done: ''\n"
                               "    maybe: 'x*'\n")
    code, out = _validate([sched], capsys)
    assert code == 1
    assert ("sched.yaml:6: stop.regex.done: regex '' matches the empty string, so it matches every completion and "
            'would stop every request at turn 1') in out
    assert "sched.yaml:7: stop.regex.maybe: regex 'x*' matches the empty string" in out
    code, err = _run([work('run.yaml', BASE + f'scheduler: {sched}\n')], capsys, tmp_path)
    assert code == 2 and 'sched.yaml:6: stop.regex.done:' in err
    run = work('run.yaml', BASE + "scheduler: sched.yaml\nrequest_config:\n  stop: ['</answer>', '']\n")
    work('sched.yaml', 'name: s\nmax_turns: 3\n')
    code, err = _run([run], capsys, tmp_path)
    assert code == 2 and ("run.yaml:7: request_config.stop: must be a list of non-empty strings (got ['</answer>', ''])"
                          ': an empty one stops every generation at once') in err


def test_several_greedy_copies_of_a_prompt_warn_that_they_are_identical(work, capsys, tmp_path):
    """``-n 4`` at temperature 0: four identical copies, every group's reward spread 0: no GRPO
    signal. A warning (the run is valid), from ``validate`` and at the start of ``run``."""
    (tmp_path / 'script.jsonl').write_text(json.dumps({'content': 'hello'}) + '\n')
    sched = work('sched.yaml', 'name: s\nmax_turns: 1\n')
    run = work('run.yaml', f'scheduler: {sched}\nbackend: scripted\nmodel: script.jsonl\nbackend_options: '
                           '{cycle: true}\ndataset: data.jsonl\nout: out\nrequest_config:\n  temperature: 0\n')
    warning = ('run.yaml:8: request_config.temperature: num_generations 4 at temperature 0 (greedy decoding) makes '
               'the 4 copies of each prompt identical: every group has the same reward, zero GRPO signal; sample '
               '(temperature > 0) or set num_generations: 1')
    assert main(['run', run, '-q', '-n', '4']) == 0
    assert f'mtflow: warning: {warning}\n' in capsys.readouterr().err
    assert main(['run', run, '-q', '-n', '1', '--overwrite', '--delete-old']) == 0
    assert 'warning' not in capsys.readouterr().err
    work('run.yaml', open(run).read() + 'num_generations: 4\n')
    code, out = _validate([run], capsys)
    assert code == 0 and f'warning: {warning}' in out
    work('run.yaml', open(run).read().replace('temperature: 0', 'temperature: 0.7'))
    code, out = _validate([run], capsys)
    assert code == 0 and 'warning' not in out


@pytest.mark.parametrize('section, line, key, call', [
    ('turn_reward: rewards:good_reward\n', 3, 'turn_reward', 'turn_reward(infer_request, completion, rollout_infos, turn)'),
    ('stop: {predicate: "rewards:good_reward"}\n', 3, 'stop.predicate', 'predicate(infer_request, response_choice, turn)'),
    ('tips:\n  - {when: predicate, predicate: "rewards:good_reward", text: hint}\n', 4, 'tips[0].predicate',
     'predicate(infer_request, response_choice, turn)'),
    ('observation: {mode: message, images_from: {impl: "rewards:good_reward"}}\n', 3, 'observation.images_from.impl',
     'images_from.impl(name, result, index)'),
])
def test_every_hook_a_scheduler_file_names_is_checked_against_its_call(work, capsys, tmp_path, section, line, key,
                                                                        call):
    sched = work('sched.yaml', 'name: s\nmax_turns: 2\n' + section)
    code, out = _validate([sched], capsys)
    assert code == 1
    assert (f'sched.yaml:{line}: {key}: good_reward() in {tmp_path / "rewards.py"}:6 takes (infer_request, '
            f'rollout_infos); mtflow calls it as {call}') in out, out
