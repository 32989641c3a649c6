"""Special tokens a parser reads reach it (``mtflow/backends/pairing.py``).

gpt-oss's harmony markers and Kimi-K2's section markers are special tokens of those models'
tokenizers; the HF and vLLM backends decoded replies with ``skip_special_tokens=True``, so with
them those families ended every request with ``stop_rule:no_tool_call``, 0 errors. Here the
tokenizer (built offline, as ``tests/tiny_model.py`` does) holds the family's markers as special
tokens, and a tiny Qwen2 whose ``generate`` is forced to write the family's call and then its answer
runs through the HF backend: at the backend's API the decode drops the markers until it is told to
keep them; through ``mtflow run`` the run keeps them itself (the parser declares them), the call
runs and the answer follows. A backend that cannot keep them is refused before the first turn,
naming the parser and the backend; a plain ``rollout_fn`` that drops them fails that request with
the reason, not silently."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, List

import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('transformers')

from mtflow import Executor, RequestConfig, RolloutInferRequest  # noqa: E402
from mtflow.backends import BackendError  # noqa: E402
from mtflow.backends.base import Backend  # noqa: E402
from mtflow.backends.hf import HFBackend  # noqa: E402
from mtflow.cli import main  # noqa: E402
from mtflow.declarative import load_scheduler  # noqa: E402
from tests.declarative.families import Family, families, harmony_family  # noqa: E402
from tests.tiny_model import make_model  # noqa: E402

SCHEDULER = {'name': 'calc', 'tools': [{'name': 'calculator'}], 'max_turns': 3, 'system_prompt': 'Use the tools.'}


def family(name: str) -> Family:
    if name == 'harmony':
        fam = harmony_family()
        if fam is None:
            pytest.skip('openai-harmony or its vocabulary is missing (scripts/test.sh installs both)')
        return fam
    return {f.parser: f for f in families()}[name]


def forced_model(tok: Any, replies: List[str]) -> Any:
    """A tiny Qwen2 whose ``generate`` writes ``replies`` in turn (each ended by the tokenizer's EOS),
    whatever the prompt: the backend's own decode, stop and EOS handling see a real ``generate`` result."""
    model = make_model(tok)
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    queue = [tok.encode(text, add_special_tokens=False) + [eos] for text in replies]
    model.generation_config.eos_token_id = eos

    def generate(input_ids=None, **kwargs: Any) -> Any:
        reply = torch.tensor([queue.pop(0)] * input_ids.shape[0], dtype=torch.long)
        return SimpleNamespace(sequences=torch.cat([input_ids, reply], dim=1), logits=None, scores=None)

    model.generate = generate
    return model


def forced_hf(model: Any = None, family_name: str = 'harmony', skip_special_tokens: bool = True) -> HFBackend:
    """The run config's backend (``backend: tests.backends.test_special_tokens:forced_hf``)."""
    fam = family(family_name)
    tok = fam.tokenizer()
    kept = {} if skip_special_tokens else {'skip_special_tokens': False}
    return HFBackend(forced_model(tok, [fam.call_turn, fam.answer_turn]), tok, **kept)


def _request() -> RolloutInferRequest:
    return RolloutInferRequest(messages=[{'role': 'user', 'content': 'What is 2 + 3 * 4?'}], uuid='q1')


@pytest.mark.parametrize('name, marker', [('harmony', '<|channel|>'), ('kimi_k2', '<|tool_calls_section_begin|>')])
def test_the_hf_backend_keeps_the_markers_once_told(name, marker):
    fam = family(name)
    tok = fam.tokenizer()
    backend = HFBackend(forced_model(tok, [fam.call_turn] * 2), tok)
    stripped = backend([_request()], RequestConfig(max_tokens=128))[0].response.choices[0]
    assert marker not in stripped.message.content  # the default decode removes them (what the parser missed)
    assert backend.keep_special_tokens() is None and backend.skip_special_tokens is False
    kept = backend([_request()], RequestConfig(max_tokens=128))[0].response.choices[0]
    assert kept.message.content == fam.call_turn  # the markers as the model wrote them, the EOS left out
    assert kept.token_ids[-1] == backend.tokenizer.convert_tokens_to_ids(fam.eos)


@pytest.mark.parametrize('name', ['harmony', 'kimi_k2'])
def test_mtflow_run_keeps_them_for_the_parser_and_the_call_runs(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'sched.yaml').write_text(f'name: {name}\nparser: {name}\ntools: [{{name: calculator}}]\nmax_turns: 3\n'
                                         'system_prompt: Use the tools.\n')
    (tmp_path / 'prompts.jsonl').write_text(json.dumps({'uuid': 'q1', 'prompt': 'What is 2 + 3 * 4?'}) + '\n')
    (tmp_path / 'run.yaml').write_text(f'scheduler: sched.yaml\nbackend: {__name__}:forced_hf\ndataset: prompts.jsonl\n'
                                       f'out: out\nbackend_options: {{family_name: {name}}}\n'
                                       'request_config: {max_tokens: 128}\n')
    assert main(['run', 'run.yaml', '--no-progress']) == 0
    line = json.loads((tmp_path / 'out' / 'trajectories.jsonl').read_text().splitlines()[0])
    assert line['rollout_infos']['tool_calls'] == 1 and line['num_turns'] == 2  # before: 0 calls, 1 turn
    tool = [m for m in line['messages'] if m['role'] == 'tool']
    assert [m['content'] for m in tool] == ['14'] and line['finish_reason'] == 'stop_rule:no_tool_call'
    assert f'the {name} parser reads them' in capsys.readouterr().err  # said once, before the first turn
    assert main(['check-tokens', 'out']) == 0


def test_the_vllm_backend_asks_the_engine_to_keep_them():
    from mtflow.backends.vllm_engine import VLLMBackend
    from tests.backends.fake_vllm import FakeLLM, SamplingParams

    fam = family('kimi_k2')
    tok = fam.tokenizer()
    llm = FakeLLM(make_model(tok), tok, forced=[tok.encode(fam.call_turn, add_special_tokens=False)
                                                + [tok.convert_tokens_to_ids(fam.eos)]] * 2)
    backend = VLLMBackend(llm, sampling_params_cls=SamplingParams)
    first = backend([_request()], RequestConfig(max_tokens=128, temperature=0))[0].response.choices[0]
    assert backend.keep_special_tokens() is None
    second = backend([_request()], RequestConfig(max_tokens=128, temperature=0))[0].response.choices[0]
    assert [c['params'][0].skip_special_tokens for c in llm.calls] == [True, False]
    assert '<|tool_calls_section_begin|>' not in first.message.content and second.message.content == fam.call_turn


def test_an_openai_server_in_token_mode_is_asked_for_them(tmp_path, monkeypatch):
    """Token mode (/v1/completions): the run sends skip_special_tokens: false, as vLLM's server takes it."""
    pytest.importorskip('httpx')
    from tests.backends.chat_server import ChatServer

    fam = family('kimi_k2')
    monkeypatch.chdir(tmp_path)
    fam.tokenizer().save_pretrained(tmp_path / 'tok')
    (tmp_path / 'sched.yaml').write_text('name: k\nparser: kimi_k2\ntools: [{name: calculator}]\nmax_turns: 3\n')
    (tmp_path / 'prompts.jsonl').write_text(json.dumps({'uuid': 'q1', 'prompt': 'What is 2 + 3 * 4?'}) + '\n')
    with ChatServer(forced_hf(family_name='kimi_k2'), model_name='m') as server:
        (tmp_path / 'run.yaml').write_text(f'scheduler: sched.yaml\nbackend: openai\nmodel: m\ndataset: prompts.jsonl\n'
                                           f'out: out\nbackend_options: {{base_url: "{server.base_url}", tokenizer: tok, '
                                           'flavor: vllm}\nrequest_config: {max_tokens: 128}\n')
        assert main(['run', 'run.yaml', '-q']) == 0
        assert [b.get('skip_special_tokens') for b in server.bodies] == [False, False]
    line = json.loads((tmp_path / 'out' / 'trajectories.jsonl').read_text().splitlines()[0])
    assert line['rollout_infos']['tool_calls'] == 1 and [m['content'] for m in line['messages'] if m['role'] == 'tool'] \
        == ['14']


class _Stripping(Backend):
    """A backend without a way to keep special tokens (the base class's answer)."""
    name = 'stripper'


def test_a_backend_that_cannot_keep_them_is_refused_naming_parser_and_backend():
    from mtflow.backends.pairing import fit_scheduler

    scheduler = load_scheduler(dict(SCHEDULER, parser='kimi_k2'))
    with pytest.raises(BackendError, match=r'parser kimi_k2 reads <\|tool_calls_section_begin\|>.* stripper backend '
                                           r'removes .*cannot return replies with their special tokens'):
        fit_scheduler(_Stripping(), scheduler)


def test_openai_chat_mode_is_refused_unless_the_server_parses_the_calls(tmp_path, monkeypatch, capsys):
    """In chat mode the server decodes the text (vLLM without special tokens): one line says what to do."""
    pytest.importorskip('httpx')
    from mtflow.backends.openai_server import OpenAIBackend
    from mtflow.backends.pairing import fit_scheduler
    from tests.backends.chat_server import ChatServer
    from mtflow.backends.scripted import ScriptedBackend

    with ChatServer(ScriptedBackend(outputs=['hi'], cycle=True), model_name='m') as server:
        monkeypatch.chdir(tmp_path)
        (tmp_path / 'sched.yaml').write_text('name: k\nparser: kimi_k2\ntools: [{name: calculator}]\n')
        (tmp_path / 'prompts.jsonl').write_text(json.dumps({'uuid': 'q1', 'prompt': 'hi'}) + '\n')
        (tmp_path / 'run.yaml').write_text(f'scheduler: sched.yaml\nbackend: openai\nmodel: m\ndataset: prompts.jsonl\n'
                                           f'out: out\nbackend_options: {{base_url: "{server.base_url}", '
                                           'prompt_mode: chat}\n')
        with pytest.warns(UserWarning, match='chat completions re-render'):
            assert main(['run', 'run.yaml', '-q']) == 2
        err = capsys.readouterr().err
        assert 'run.yaml' in err and 'parser kimi_k2 reads' in err and 'openai backend' in err
        assert 'server_tool_calls: true' in err and 'token mode' in err and not (tmp_path / 'out').exists()
        assert main(['validate', 'run.yaml']) == 1  # the same line, before anything is built
        said = capsys.readouterr().out
        assert 'run.yaml:2: backend: parser kimi_k2 reads <|tool_calls_section_begin|>' in said and \
            'server_tool_calls: true' in said
        (tmp_path / 'run.yaml').write_text((tmp_path / 'run.yaml').read_text().replace(
            'prompt_mode: chat}', 'prompt_mode: chat, server_tool_calls: "true"}'))  # quoted: a string, not true
        quoted = "run.yaml:6: backend_options.server_tool_calls: backend openai expects bool, not 'true' (a str)"
        assert main(['validate', 'run.yaml']) == 1 and quoted in capsys.readouterr().out  # the option's type, at its line
        assert main(['run', 'run.yaml', '-q']) == 2  # refused before the backend is built
        assert quoted in capsys.readouterr().err
        with pytest.raises(BackendError, match="server_tool_calls must be true or false, not str 'true'"):
            OpenAIBackend(model='m', base_url=server.base_url, prompt_mode='chat', server_tool_calls='true')
        with pytest.warns(UserWarning):
            backend = OpenAIBackend(model='m', base_url=server.base_url, prompt_mode='chat', server_tool_calls=True)
        try:  # the server returns the calls structured: the parser's markers are not needed
            assert fit_scheduler(backend, load_scheduler(dict(SCHEDULER, parser='kimi_k2'))) is not None
        finally:
            backend.close()


def test_a_plain_rollout_fn_that_drops_them_fails_the_request_with_the_reason():
    """No backend to set (a user's own function): the scheduler compares each reply's ids with its text."""
    from mtflow.core.errors import MultiTurnRolloutError

    backend = forced_hf(family_name='kimi_k2')  # decodes without special tokens
    scheduler = load_scheduler(dict(SCHEDULER, parser='kimi_k2'), tokenizer=backend.tokenizer)
    with pytest.raises(MultiTurnRolloutError, match=r"request q1, turn 1, field 'response.content': the reply's token "
                                                    r'ids hold .*<\|tool_calls_section_begin\|>.* but its text does not.*'
                                                    'skip_special_tokens: false'):
        Executor(scheduler, lambda requests, config=None: backend(requests, config)).run([_request()])


def test_a_quoted_false_is_refused_naming_the_option():
    """YAML's ``"false"`` is a string, which ``bool()`` reads as true: the option says so instead."""
    fam = family('kimi_k2')
    tok = fam.tokenizer()
    with pytest.raises(BackendError, match=r"hf backend: skip_special_tokens must be true or false, not str 'false'"):
        HFBackend(make_model(tok), tok, skip_special_tokens='false')


def test_the_gateway_has_its_backend_keep_the_markers_of_its_tool_parser(tmp_path):
    """``mtflow gateway`` with ``tool_parser: kimi_k2`` over the HF backend: the calls it hands the agent
    are read from a text that keeps the markers; a backend that cannot keep them is refused."""
    from mtflow.gateway.gateway import Gateway
    from mtflow.run.agent_config import GatewayConfig

    backend = forced_hf(family_name='kimi_k2')
    assert backend.skip_special_tokens
    gateway = Gateway(backend, tmp_path / 'gw', settings=GatewayConfig(tool_parser='kimi_k2'))
    assert not backend.skip_special_tokens and 'the kimi_k2 parser reads them' in gateway.notes[0]
    with pytest.raises(BackendError, match=r'parser kimi_k2 reads .* stripper backend removes'):
        Gateway(_Stripping(), tmp_path / 'gw2', settings=GatewayConfig(tool_parser='kimi_k2'))
