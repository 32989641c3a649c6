"""Token-in/token-out: every turn is generated from the exact ids of the turns before it.

Drift is provoked on purpose (a reply whose sampled split re-tokenizes differently: a BPE word
sampled in pieces, a reply cut inside a multi-byte character) through the vLLM stand-in, and by
sampling with a tiny random model through the HF backend; the old re-rendering path shows it,
the token path does not. The OpenAI backend sends token prompts to the local test server's
``/v1/completions``. The conformance check runs on every bundled template, on the tokenizers'
own templates, and on a template that strips ``<think>``, under both policies, and fails closed.
"""
import copy
import warnings

import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('transformers')

from mtflow import Executor, RequestConfig, RolloutInferRequest, Scheduler  # noqa: E402
from mtflow.backends import BackendError  # noqa: E402
from mtflow.backends.conformance import BUNDLED, SCENARIOS, check_tokens, resolve_template  # noqa: E402
from mtflow.backends.hf import HFBackend, render_prompt  # noqa: E402
from mtflow.backends.openai_server import OpenAIBackend  # noqa: E402
from mtflow.backends.vllm_engine import VLLMBackend  # noqa: E402
from mtflow.accounting.token_record import RecordAccounting, TokenRecord, record_of  # noqa: E402
from tests.backends.chat_server import ChatServer  # noqa: E402
from tests.backends.fake_vllm import FakeLLM, SamplingParams  # noqa: E402
from tests.tiny_model import make_model, make_tokenizer  # noqa: E402

pytestmark = pytest.mark.hf
GLUE = '<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n'


@pytest.fixture(scope='module')
def tok():
    return make_tokenizer()


@pytest.fixture(scope='module')
def model(tok):
    return make_model(tok, seed=3)


def _req(uuid, text='guess a number'):
    return RolloutInferRequest(messages=[{'role': 'user', 'content': text}], uuid=uuid)


class _Higher(Scheduler):
    """Answers every turn with a user message, never stops on its own (max_turns does)."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return False

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'higher'})
        return {'infer_request': infer_request}


class _Probe:
    """rollout_fn wrapper that keeps (prompt ids, sampled ids) per request and turn."""

    def __init__(self, backend):
        self.backend = backend
        self.turns = {}

    def __call__(self, requests, request_config=None):
        outs = self.backend(requests, request_config)
        for r, o in zip(requests, outs):
            self.turns.setdefault(r.uuid, []).append((o.response.prompt_token_ids, o.response.choices[0].token_ids))
        return outs


def _drift(probe):
    """(transitions whose prompt does not start with the previous prompt + sampled ids, all)."""
    bad = total = 0
    for turns in probe.turns.values():
        for (p0, s0), (p1, _) in zip(turns, turns[1:]):
            total += 1
            bad += p1[:len(p0) + len(s0)] != p0 + s0
    return bad, total


def _vllm(tok, model, forced, **kw):
    llm = FakeLLM(model, tok, forced=[list(f) for f in forced])
    return llm, VLLMBackend(llm, sampling_params_cls=SamplingParams, **kw)


@pytest.mark.parametrize('case, forced', [
    ('a BPE word sampled in pieces', [[327, 90, 392, 86, 2]]),  # ' br' 'own' -> ' brown' is one token
    ('a reply cut inside a multi-byte character', [[136]]),  # the first byte of 'é', then max_tokens
])
def test_provoked_drift_is_there_when_re_rendering_and_gone_with_exact_ids(tok, model, case, forced):
    sampled = forced[0]
    assert tok.encode(tok.decode(sampled, skip_special_tokens=True), add_special_tokens=False) != [
        t for t in sampled if t != 2], 'the sampled split re-tokenizes differently'
    config = RequestConfig(max_tokens=len(sampled), temperature=0)
    prompts = {}
    for exact in (False, True):
        llm, backend = _vllm(tok, model, forced * 2, exact_ids=exact)
        probe = _Probe(backend)
        result = Executor(_Higher(), probe, config, max_turns=2, accounting=RecordAccounting()).run([_req('a')])
        assert result.ok
        prompts[exact] = [p for p, _ in probe.turns['a']]
        assert [c['method'] for c in llm.calls] == ['generate', 'generate'], 'token prompts only'
        assert probe.turns['a'][0][1] == sampled
        assert _drift(probe) == ((0, 1) if exact else (1, 1)), case
    first, second = prompts[True]
    tail = [] if sampled[-1] == 2 else [2]  # the template's <|im_end|> closes a reply cut by length
    assert second == first + sampled + tok.encode(GLUE[len('<|im_end|>'):] if not tail else GLUE,
                                                  add_special_tokens=False)
    assert prompts[False][1] != second, 'the re-rendered prompt is not what the model sampled'


def test_hf_multi_turn_sampling_never_drifts_and_outputs_come_from_the_record(tok, model):
    reqs = [_req(f'r{i}', f'guess {i} é') for i in range(4)]
    config = RequestConfig(max_tokens=6, temperature=1.0, seed=0, logprobs=True)
    drift = {}
    for exact in (False, True):
        probe = _Probe(HFBackend(model, tok, exact_ids=exact))
        result = Executor(_Higher(), probe, config, max_turns=4, accounting=RecordAccounting()).run(copy.deepcopy(reqs))
        assert result.ok
        drift[exact] = _drift(probe)
    assert drift[False][0] > 0, 'sampling from a tiny random model re-tokenizes differently (the bug)'
    assert drift[True] == (0, 12)
    for out in result.outputs:
        info = out.rollout_infos['token_record']
        assert info['exact'] and info['turns'] == 4
        # one segment per assistant message (ms-swift 4.6's layout); the glue between them (the
        # template's <|im_end|>, the user message, the generation prompt) is in the record's summary
        lengths = [len(s) for s in out.response_token_ids]  # max_tokens 6, or up to a sampled EOS
        assert len(lengths) == 4 and all(0 < n <= 6 for n in lengths)
        assert out.response_loss_mask == [[1] * n for n in lengths]
        glue = tok.encode(GLUE, add_special_tokens=False)  # from <|im_end|>: a sampled EOS is the reply's own
        assert info['glue_ids'] == [glue[1:] if seg[-1] == glue[0] else glue for seg in out.response_token_ids[:-1]]
        full = info['prompt_ids']
        for seg, glue in zip(out.response_token_ids, info['glue_ids'] + [[]]):
            full = full + seg + glue
        assert full == out.response.prompt_token_ids + out.response.choices[0].token_ids
        assert sum(map(len, out.rollout_logprobs)) == sum(map(sum, out.response_loss_mask)) == sum(lengths)


class _Continue(Scheduler):

    def check_finished(self, infer_request, response_choice, current_turn):
        return False

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages[-1]['content'] += ' so'
        return {'infer_request': infer_request}


def test_a_continuation_appends_only_the_new_text(tok, model):
    probe = _Probe(HFBackend(model, tok))
    out = Executor(_Continue(), probe, RequestConfig(max_tokens=3, temperature=0), max_turns=3,
                   accounting=RecordAccounting()).run([_req('c')]).outputs[0]
    turns = probe.turns['c']
    for (p0, s0), (p1, _) in zip(turns, turns[1:]):
        assert p1 == p0 + s0 + tok.encode(' so', add_special_tokens=False)
    so = tok.encode(' so', add_special_tokens=False)
    assert len(out.response_token_ids) == 1, 'a continuation extends its segment'
    assert out.response_token_ids[0] == turns[0][1] + so + turns[1][1] + so + turns[2][1]
    assert out.response_loss_mask[0] == [1] * 3 + [0] * len(so) + [1] * 3 + [0] * len(so) + [1] * 3


class _NewObject(Scheduler):
    """Returns a new request object each turn (without the record): the uuid map keeps it."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return False

    def step(self, infer_request, response_choice, current_turn):
        messages = copy.deepcopy(infer_request.messages) + [{'role': 'user', 'content': 'higher'}]
        return {'infer_request': RolloutInferRequest(messages=messages, uuid=infer_request.uuid)}


def test_a_scheduler_returning_new_request_objects_keeps_exact_ids(tok, model):
    probe = _Probe(HFBackend(model, tok))
    Executor(_NewObject(), probe, RequestConfig(max_tokens=4, temperature=1.0, seed=1), max_turns=3).run([_req('n')])
    assert _drift(probe) == (0, 2)


class _Rewrite(Scheduler):
    """Edits the history: the assistant text is replaced, so no exact delta exists."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return False

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages[-1]['content'] = 'something else'
        infer_request.messages.append({'role': 'user', 'content': 'higher'})
        return {'infer_request': infer_request}


def test_an_edited_history_is_rendered_from_text_and_says_so(tok, model):
    probe = _Probe(HFBackend(model, tok))
    out = Executor(_Rewrite(), probe, RequestConfig(max_tokens=4, temperature=0), max_turns=2,
                   accounting=RecordAccounting()).run([_req('e')]).outputs[0]
    request = RolloutInferRequest(messages=out.messages[:-1], uuid='e')
    assert probe.turns['e'][1][0] == render_prompt(tok, request)
    assert 'token_record' not in out.rollout_infos, 'the contract segments stay: the record was restarted'


def test_the_record_travels_with_copies_and_is_never_dumped(tok, model):
    backend = HFBackend(model, tok)
    request = _req('d')
    backend([request], RequestConfig(max_tokens=2, temperature=0))
    rec = record_of(request)
    assert isinstance(rec, TokenRecord) and len(rec.turns) == 1
    assert 'token_record' not in request.model_dump()
    assert record_of(copy.deepcopy(request)).turns[0].sampled == rec.turns[0].sampled


# ---- the OpenAI-compatible backend ---------------------------------------------------------------
@pytest.fixture(scope='module')
def hf(tok, model):
    return HFBackend(model, tok)


def test_openai_token_prompts_go_to_completions_and_keep_exact_ids(hf, tok):
    with ChatServer(hf) as server:
        with OpenAIBackend(base_url=server.base_url, tokenizer=tok, backoff=0.01) as client:
            assert client.prompt_mode == 'tokens'
            probe = _Probe(client)
            result = Executor(_Higher(), probe, RequestConfig(max_tokens=5, temperature=1.0, seed=0, logprobs=True),
                              max_turns=3, accounting=RecordAccounting()).run([_req('a'), _req('b', 'é?')])
        assert result.ok and _drift(probe) == (0, 4)
        assert all(isinstance(b['prompt'], list) and b['return_token_ids'] is True for b in server.bodies)
        # the two requests of a turn are sent concurrently: their order on the server varies
        assert sorted(b['prompt'] for b in server.bodies[:2]) == sorted(t[0][0] for t in probe.turns.values())
        for out in result.outputs:
            assert len(out.response.choices[0].logprobs['content']) == 5
            assert out.rollout_infos['token_record']['exact']


def test_openai_without_token_prompts_warns_or_fails_clearly(hf, tok):
    with ChatServer(hf, token_prompts=False) as server:
        with pytest.warns(UserWarning, match='not guaranteed the exact ids'):
            OpenAIBackend(base_url=server.base_url, backoff=0.01).close()  # no tokenizer: chat mode
        with OpenAIBackend(base_url=server.base_url, tokenizer=tok, max_retries=0) as client:
            with pytest.raises(BackendError, match='HTTP 400: prompt must be a string'):
                client([_req('a')], RequestConfig(max_tokens=2))
    with pytest.raises(BackendError, match="prompt_mode='tokens' needs the model's tokenizer"):
        OpenAIBackend(base_url='http://127.0.0.1:9/v1', prompt_mode='tokens')


# ---- conformance --------------------------------------------------------------------------------
@pytest.mark.parametrize('style, name, policy', [
    ('chatml', 'model', 'exact'),
    ('chatml', 'chatml', 'exact'),
    ('chatml', 'qwen3_think', 'exact'),
    ('chatml', 'qwen3_think', 'rerender'),
    ('llama', 'llama3', 'exact'),  # the llama tokenizer's own template
    ('llama', 'llama3', 'rerender'),
])
def test_conformance_on_every_bundled_template(style, name, policy):
    tk = make_tokenizer(style=style)
    backend = HFBackend(make_model(tk, seed=5), tk, prefix_policy=policy)
    label, template = resolve_template(name)
    report = check_tokens(backend, template=template, template_name=label)
    assert report.ok, (label, report.problems)
    assert report.transitions == 13 and report.passed['prefix'] == 13
    if name == 'qwen3_think':
        assert report.unstable_turns >= 1 and report.passed['think policy'] >= 2, 'the stripped <think> was seen'
    if name == 'llama3':
        assert report.unstable_turns >= 1, 'llama3 trims content: the whitespace scenario is not prefix-stable'
    if name in ('chatml', 'model'):
        assert report.unstable_turns == 0 and report.passed['special tokens'] == 13
    assert set(BUNDLED) == {'chatml', 'qwen3_think', 'llama3'}


def test_conformance_fails_closed_on_a_re_rendering_backend(tok, model):
    report = check_tokens(HFBackend(model, tok, exact_ids=False))
    assert not report.ok and report.failed['prefix'] > 0
    with pytest.raises(TypeError, match='keeps no token record'):
        check_tokens(object())


def test_vllm_chat_mode_warns_that_exact_ids_are_not_guaranteed(tok, model):
    with pytest.warns(UserWarning, match="prompt_mode='chat' re-renders"):
        VLLMBackend(FakeLLM(model, tok), sampling_params_cls=SamplingParams, prompt_mode='chat')
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        VLLMBackend(FakeLLM(model, tok), sampling_params_cls=SamplingParams)


# ---- the command and the pytest fixture -----------------------------------------------------------
def test_the_fixture_passes_a_conforming_backend_and_fails_a_re_rendering_one(mtflow_check_tokens, tok, model):
    report = mtflow_check_tokens(HFBackend(model, tok), template='qwen3_think', scenarios=SCENARIOS[1:3])
    assert report.ok and report.passed['think policy'] >= 1
    with pytest.raises(AssertionError, match=r'(?s)token conformance failed for template model:.*prefix.*FAIL'):
        mtflow_check_tokens(HFBackend(model, tok, exact_ids=False), scenarios=SCENARIOS[2:3])


@pytest.fixture(scope='module')
def model_dir(tmp_path_factory, tok, model):
    d = tmp_path_factory.mktemp('tiny')
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_check_tokens_command_prints_a_table_per_template_and_fails_closed(model_dir, tmp_path, capsys):
    from mtflow.cli import main

    few = ['--scenario', 'thinking', '--scenario', 'unicode']
    assert main(['check-tokens', '--model', str(model_dir), '--template', 'model', '--template', 'qwen3_think',
                 *few]) == 0
    out = capsys.readouterr().out
    assert 'template model (policy exact)' in out and 'template qwen3_think (policy exact)' in out
    assert '2 of 2 template/policy runs passed every check' in out
    assert main(['check-tokens', '--model', str(model_dir), '-o', 'exact_ids=false', *few]) == 1
    assert 'FAIL' in capsys.readouterr().out
    assert main(['check-tokens', '--model', str(model_dir), '--template', str(tmp_path / 'none.jinja')]) == 2
    assert 'no such file' in capsys.readouterr().err
    assert main(['check-tokens', '--model', str(model_dir), '--scenario', 'nope']) == 2
    assert "no scenario 'nope'" in capsys.readouterr().err
    assert main(['check-tokens', '--model', str(tmp_path / 'missing')]) == 2


def test_check_tokens_with_a_yaml_scheduler(model_dir, capsys):
    from pathlib import Path

    from mtflow.cli import main

    root = Path(__file__).resolve().parents[2]
    assert main(['check-tokens', '--model', str(model_dir), '--scheduler', str(root / 'schedulers' / 'guess_number.yaml'),
                 '--limit', '2', '--max-turns', '3']) == 0
    assert '1 of 1 template/policy runs passed every check' in capsys.readouterr().out


def test_token_backed_assistant_messages_render_as_their_text(tok, model):
    """ms-swift 4.6 schedulers freeze assistant messages as token ids; a text backend renders
    their text (never the list's repr) and keeps the exact ids where the history extends."""
    backend = HFBackend(model, tok)
    req = _req('t')
    out = backend([req], RequestConfig(max_tokens=4, temperature=0))[0]
    sampled = out.response.choices[0].token_ids
    req.messages += [{'role': 'assistant', 'content': list(sampled)}, {'role': 'user', 'content': 'higher'}]
    nxt = backend([req], RequestConfig(max_tokens=2, temperature=0))[0]
    prompt = nxt.response.prompt_token_ids
    assert '[' not in tok.decode(prompt) and prompt[:len(out.response.prompt_token_ids) + 4] == (
        out.response.prompt_token_ids + sampled)


def test_requests_forked_by_a_shallow_copy_keep_their_own_records(tok, model):
    backend = HFBackend(model, tok)
    base = _req('f')
    backend([base], RequestConfig(max_tokens=3, temperature=0))
    forks = [base.model_copy(update={'uuid': f'f{i}'}) for i in range(2)]  # shares the record object
    for i, fork in enumerate(forks):
        fork.messages = copy.deepcopy(base.messages) + [
            {'role': 'assistant', 'content': record_of(base).history[-1]['content']},
            {'role': 'user', 'content': f'branch {i}'}]
    outs = backend(forks, RequestConfig(max_tokens=3, temperature=1.0, seed=3))
    first = record_of(base)
    assert len(first.turns) == 1, 'the shared record was not written into'
    for fork, out in zip(forks, outs):
        rec = record_of(fork)
        assert rec is not first and len(rec.turns) == 2 and rec.turns[-1].sampled == out.response.choices[0].token_ids
        assert out.response.prompt_token_ids[:len(first.last_prompt) + 3] == first.next_prefix()


class _GoOn(Scheduler):
    """The README's example scheduler: a user message every turn, ``max_turns`` ends the run
    (also for replies cut by ``max_tokens``)."""

    def check_finished(self, infer_request, response_choice, current_turn):
        return False

    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({'role': 'user', 'content': 'go on'})
        return {'infer_request': infer_request}


def test_executor_default_keeps_every_turns_exact_ids_and_run_multi_turn_keeps_the_contract(tok, model):
    """The README's own example with the HF backend and no ``accounting=``: a 6-turn request used
    to keep only the last turn's ids (segments ``[3]``). The native default takes every turn's
    ids from the backend's token record; the drop-in ``run_multi_turn`` stays the contract."""
    import mtflow

    config = RequestConfig(max_tokens=3, temperature=0)
    reqs = [RolloutInferRequest(messages=[{'role': 'user', 'content': 'hi'}], uuid=u) for u in 'ab']
    result = mtflow.Executor(_GoOn(max_turns=6), HFBackend(model, tok), config).run(copy.deepcopy(reqs))
    assert result.ok and result.finish_reasons == ['max_turns'] * 2
    for out in result.outputs:
        rec = out.rollout_infos['token_record']
        assert rec['exact'] and rec['turns'] == 6
        assert [len(s) for s in out.response_token_ids] == [3] * 6
        assert out.response_loss_mask == [[1] * 3] * 6
        seq = rec['prompt_ids']
        for seg, glue in zip(out.response_token_ids, rec['glue_ids'] + [[]]):
            seq = seq + seg + glue
        assert seq[-3:] == list(out.response.choices[0].token_ids)
    backend = HFBackend(model, tok)
    drop_in = copy.deepcopy(reqs)
    first = backend(drop_in, config)
    outs = mtflow.run_multi_turn(drop_in, first, _GoOn(max_turns=6), backend, config, max_turns=6)
    assert [[len(s) for s in o.response_token_ids] for o in outs] == [[3], [3]], 'the contract: last turn only'
    assert all('token_record' not in o.rollout_infos for o in outs)
