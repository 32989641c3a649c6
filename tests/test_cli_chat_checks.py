"""``mtflow run``, ``mtflow validate`` and ``mtflow check-tokens`` check the chat template and the
context before the model generates (``mtflow/run/chat_check.py``): a template path that is not a
file, a template that drops the tool's result, ``max_tokens`` past the model's context are each
one line naming the file, the key and what is wrong, with a non-zero exit and no run directory;
a good template passes and the run says which one it used. (Before: a path where text was
expected rendered every prompt as the path, a template without tool messages ran to the end, and
453-token turns ran on a 64-position model, each with exit 0.)"""
import json
from pathlib import Path

import pytest

pytest.importorskip('transformers')

from mtflow.cli import main  # noqa: E402
from tests.backends.test_chat_templates import CHATML_BODY, GENERATION, TEMPLATES  # noqa: E402

SCHEDULER = '''
name: calc
max_turns: 2
parser: hermes
tools: [{name: calculator}]
system_prompt: "Call a tool."
'''
NO_TOOL_MESSAGES = CHATML_BODY.replace('{% for m in messages %}', "{% for m in messages if m.role != 'tool' %}") + \
    GENERATION


@pytest.fixture(scope='module')
def models(tmp_path_factory):
    from tests.tiny_model import make_model, make_tokenizer

    root = tmp_path_factory.mktemp('tiny-models')
    tok = make_tokenizer()
    for name, positions in (('tiny', 512), ('tiny64', 64)):
        make_model(tok, seed=2, max_position_embeddings=positions).save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


@pytest.fixture
def project(tmp_path, models, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv('MTFLOW_CACHE', str(tmp_path / 'cache'))
    (tmp_path / 'calc.yaml').write_text(SCHEDULER)
    lines = [{'uuid': f'p{i}', 'prompt': f'What is {i} + {i}?'} for i in range(2)]
    (tmp_path / 'prompts.jsonl').write_text(''.join(json.dumps(line) + '\n' for line in lines))
    (tmp_path / 'no_tool.jinja').write_text(NO_TOOL_MESSAGES)
    (tmp_path / 'good.jinja').write_text(CHATML_BODY + GENERATION)
    return tmp_path


def config(project, models, *, model='tiny', max_tokens=4, template=None):
    text = (f'scheduler: calc.yaml\nbackend: hf\nmodel: {models / model}\ndataset: prompts.jsonl\nout: out\n'
            f'request_config: {{max_tokens: {max_tokens}, temperature: 0}}\n')
    if template is not None:
        text += f'backend_options:\n  chat_template: {template}\n'
    (project / 'run.yaml').write_text(text)
    return 'run.yaml'


def refused(capsys, argv, code):
    """Run ``argv``; its one-line refusal (stdout and stderr together)."""
    assert main(argv) == code
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if 'run.yaml' in line or 'chat template' in line]
    assert len(lines) == 1, out.out + out.err
    return lines[0]


def test_a_template_path_that_is_not_a_file_is_refused_before_the_model_loads(project, models, capsys):
    path = config(project, models, template='templates/qwen3.jinja')
    line = refused(capsys, ['run', path, '--no-progress'], 2)
    assert line.startswith('mtflow: run.yaml:8: backend_options.chat_template: ') and \
        "'templates/qwen3.jinja' is not a file" in line and 'Jinja text' in line
    assert not (project / 'out').exists()
    assert refused(capsys, ['validate', path], 1) == line.removeprefix('mtflow: ')


def test_a_template_that_drops_the_tool_result_is_refused_before_the_first_turn(project, models, capsys):
    path = config(project, models, template='no_tool.jinja')
    line = refused(capsys, ['run', path, '--no-progress'], 2)
    assert line.startswith('mtflow: run.yaml:8: backend_options.chat_template: chat template ') and \
        f"{project / 'no_tool.jinja'}: drops the tool's result (role tool)" in line
    assert not (project / 'out').exists(), 'nothing was generated, no run directory is left'
    assert refused(capsys, ['validate', path], 1) == line.removeprefix('mtflow: ')



def test_another_familys_template_is_refused_naming_the_markers_the_tokenizer_lacks(project, models, capsys):
    """Llama 3's template under a ChatML tokenizer shows every part of the conversation, so the probe
    passed it, and the run trained on prompts whose header markers were spelt in pieces of text."""
    path = config(project, models, template='llama3')
    line = refused(capsys, ['run', path, '--no-progress'], 2)
    assert line == ("mtflow: run.yaml:8: backend_options.chat_template: chat template llama3 writes "
                    "<|start_header_id|>, <|end_header_id|>, <|eot_id|>, which the model's tokenizer does not have as "
                    "tokens (each is spelt in several): it is another model family's template; leave chat_template out "
                    "for the tokenizer's own, or give one written for this model")
    assert not (project / 'out').exists()
    assert refused(capsys, ['validate', path], 1) == line.removeprefix('mtflow: ')

def test_check_tokens_runs_the_same_template_check(project, models, capsys):
    assert main(['check-tokens', '--model', str(models / 'tiny'), '--template', 'no_tool.jinja',
                 '--scenario', 'tool call']) == 1
    failed = [line for line in capsys.readouterr().out.splitlines() if line.startswith('  FAIL')]
    assert failed == ["  FAIL template: chat template no_tool.jinja: drops the tool's result (role tool): the probe "
                      "conversation rendered through it lacks that message's text ('probe-tool-result-q7x')"]


def test_max_tokens_past_the_context_is_refused_without_a_context_block(project, models, capsys):
    path = config(project, models, model='tiny64', max_tokens=453)
    line = refused(capsys, ['run', path, '--no-progress'], 2)
    assert line.startswith('mtflow: run.yaml:6: request_config.max_tokens: 453 new tokens after the longest prompt '
                           "(request 'p") and "more than the model's context of 64 tokens" in line, line
    assert 'set max_tokens to at most' in line and not (project / 'out').exists()
    validated = refused(capsys, ['validate', path], 1)
    assert validated.startswith('run.yaml:6: request_config.max_tokens: 453 new tokens') and \
        'max_position_embeddings in its config.json' in validated


def test_a_good_template_runs_and_the_run_says_which_it_used(project, models, capsys):
    path = config(project, models, template='good.jinja')
    assert main(['run', path, '--no-progress']) == 0
    said = capsys.readouterr().err
    assert f"chat template: {project / 'good.jinja'} (a template file): shows every part of a tool-use " \
        'conversation; longest prompt' in said and '+ max_tokens 4 <= context 512' in said
    assert main(['validate', path]) == 0
    assert f"run.yaml: chat template: {project / 'good.jinja'} (a template file)" in capsys.readouterr().out


def test_a_familys_own_template_file_runs(project, models, capsys):
    family = TEMPLATES / 'llama.cpp' / 'Qwen-Qwen2.5-7B-Instruct.jinja'
    if not family.is_file():
        pytest.skip(f'{family} is not there: scripts/test.sh extracts the families\' templates')
    assert main(['run', config(project, models, template=str(family)), '--no-progress', '-q']) == 0
    lines = (Path(project) / 'out' / 'trajectories.jsonl').read_text().splitlines()
    assert len(lines) == 2


# ---- --ray: the checks run in the driver before the fan-out, and in each actor before its first turn ----
def test_with_ray_the_driver_checks_before_any_actor_starts(project, models, capsys):
    pytest.importorskip('ray')
    path = config(project, models, model='tiny64', max_tokens=453)
    line = refused(capsys, ['run', path, '--ray', '2', '--no-progress'], 2)
    assert line.startswith('mtflow: run.yaml:6: request_config.max_tokens: 453 new tokens after the longest prompt')
    assert not (project / 'out').exists()  # refused before Ray started or any model loaded


def test_each_ray_actor_checks_its_own_backend_before_its_first_turn(project, models):
    """What the driver cannot read from disk (a hub model, a server) each actor checks once built."""
    import functools

    from mtflow.core.errors import RunSetupError
    from mtflow.distributed import ShardWorker
    from mtflow.distributed.ray_cli import RayRollout
    from mtflow.run.config import load_run_config

    cfg = load_run_config(config(project, models, template='no_tool.jinja'))
    spec = RayRollout.spec(type('R', (), {'cfg': cfg})())
    assert isinstance(spec.prepare, functools.partial)
    with pytest.raises(RunSetupError, match=r"run.yaml:8: backend_options.chat_template: chat template .*no_tool.jinja: "
                                            r"drops the tool's result \(role tool\)"):
        ShardWorker(spec, slot=0)



def test_a_ray_actor_refuses_a_server_template_the_driver_cannot_read(project, capsys):
    """A real fan-out: the driver has no template to read (a server in chat mode), so the actor asks the
    server before its first turn and the run fails with the actor's line, nothing written."""
    pytest.importorskip('ray')
    with serve(template=NO_TOOL_MESSAGES, max_model_len=512) as server:
        chat_config(project, server, 8)
        assert main(['run', 'run.yaml', '--ray', '1', '--no-progress']) != 0  # (the actor warns of chat mode)
    said = capsys.readouterr()
    (line, ) = [ln for ln in (said.out + said.err).splitlines() if 'could not start' in ln]
    assert line.startswith("mtflow: Ray actor 0 could not start: RunSetupError: run.yaml:3: model: chat template the "
                           "server's template (http://127.0.0.1:") and "drops the tool's result (role tool)" in line
    assert not list((project / 'out').glob('trajectories*.jsonl')) or \
        not (project / 'out' / 'trajectories.jsonl').read_text().strip()

# ---- chat mode: the server's context and template, asked of the server ---------------------------------
def serve(template=None, **kw):
    from mtflow.backends.scripted import ScriptedBackend
    from tests.backends.chat_server import ChatServer
    from tests.tiny_model import make_tokenizer

    tok = make_tokenizer()
    if template is not None:
        tok = __import__('copy').deepcopy(tok)
        tok.chat_template = template
    return ChatServer(ScriptedBackend(outputs=['It is 4.'], cycle=True, tokenizer=tok), model_name='m', **kw)


def chat_config(project, server, max_tokens):
    (project / 'run.yaml').write_text(f'scheduler: calc.yaml\nbackend: openai\nmodel: m\ndataset: prompts.jsonl\nout: out\n'
                                      f'request_config: {{max_tokens: {max_tokens}, temperature: 0}}\n'
                                      f'backend_options: {{base_url: "{server.base_url}", prompt_mode: chat}}\n')
    return 'run.yaml'


def test_chat_mode_checks_max_tokens_against_the_servers_context(project, capsys):
    """vLLM's server says its max_model_len (GET /v1/models) and counts a prompt (POST /tokenize)."""
    with serve(max_model_len=64) as server:
        with pytest.warns(UserWarning, match='chat completions'):
            line = refused(capsys, ['run', chat_config(project, server, 453), '--no-progress'], 2)
        counted = [b for b in server.tokenize_bodies if 'messages' in b]
    assert line.startswith('mtflow: run.yaml:6: request_config.max_tokens: 453 new tokens after the longest prompt '
                           "(request 'p") and "more than the model's context of 64 tokens (as GET /v1/models reports " \
        'it, max_model_len)' in line and not (project / 'out').exists()
    assert counted, 'the prompts were rendered and counted by the server (/tokenize)'
    with serve(max_model_len=512) as server:
        with pytest.warns(UserWarning, match='chat completions'):
            assert main(['run', chat_config(project, server, 8), '--no-progress']) == 0
    said = capsys.readouterr().err
    assert "chat template: the server's template (http://127.0.0.1:" in said and '+ max_tokens 8 <= context 512' in said


def test_chat_mode_without_a_tokenize_endpoint_says_what_it_did_not_check(project, capsys):
    with serve(max_model_len=64, tokenize=False) as server:
        with pytest.warns(UserWarning, match='chat completions'):
            line = refused(capsys, ['run', chat_config(project, server, 453), '--no-progress'], 2)
        assert "453 new tokens do not fit the served model's context of 64 tokens" in line
        with pytest.warns(UserWarning, match='chat completions'):
            assert main(['run', chat_config(project, server, 8), '--no-progress', '--overwrite']) == 0
    assert "chat template: the server's, not checked (it has no /tokenize endpoint to render with), nor the prompts' " \
        'lengths; max_tokens 8 < context 64' in capsys.readouterr().err


def test_chat_mode_refuses_a_server_template_that_drops_the_tool_result(project, capsys):
    with serve(template=NO_TOOL_MESSAGES, max_model_len=512) as server:
        with pytest.warns(UserWarning, match='chat completions'):
            line = refused(capsys, ['run', chat_config(project, server, 8), '--no-progress'], 2)
    assert line.startswith("mtflow: run.yaml:3: model: chat template the server's template (http://127.0.0.1:") and \
        "drops the tool's result (role tool)" in line and not (project / 'out').exists()
