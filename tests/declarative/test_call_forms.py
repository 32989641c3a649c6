"""Calls read from the text get ids, and the conversation carries them the way the run's chat
template takes them (``mtflow/declarative/call_messages.py``): gpt-oss's, MiniMax-M2's and Mistral
Small 3.2's real templates take a tool result only after ``tool_calls`` (OpenAI's shape); Kimi-K2's
and Qwen3's take the calls as the model wrote them, the tool message now naming its call.

Each family runs two turns (a calculator call, then the answer) through ``mtflow run`` with its
real template (``.extras/chat-templates``, extracted by ``scripts/test.sh``) and a tokenizer whose
family markers are special tokens: the run passes ``mtflow check-tokens`` (the second prompt
extends the ids sampled at turn 1), the call is in the second prompt once (the sampled text, not
again as the template's rendering of ``tool_calls``), also when the template re-renders the history
(``prefix_policy: rerender``), and the trajectory holds the call as ``tool_calls`` answered by its
``tool_call_id``. On the code before, these runs were refused at load (the template raised)."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

from mtflow.cli import main
from tests.tiny_model import make_tokenizer

AutoTokenizer = pytest.importorskip('transformers').AutoTokenizer
TEMPLATES = Path(__file__).resolve().parents[2] / '.extras' / 'chat-templates' / 'llama.cpp'
EXPRESSION = '17 * 3'  # in the call only (the question spells it): counted in the prompts
QUESTION = 'What is seventeen times three?'


def _harmony_call() -> str:
    return ('<|channel|>analysis<|message|>Use the calculator.<|end|><|start|>assistant<|channel|>commentary '
            f'to=functions.calculator <|constrain|>json<|message|>{{"expression": "{EXPRESSION}"}}')


#: family -> (template file, special tokens, eos of the call turn, eos of the answer, turn 1, turn 2, form, extra)
CASES: Dict[str, Dict[str, Any]] = {
    'harmony': dict(template='openai-gpt-oss-120b.jinja', call_eos='<|call|>', answer_eos='<|return|>',
                    specials=['<|start|>', '<|end|>', '<|message|>', '<|channel|>', '<|constrain|>', '<|call|>',
                              '<|return|>'],
                    turns=[_harmony_call(), '<|channel|>analysis<|message|>Got 51.<|end|><|start|>assistant'
                           '<|channel|>final<|message|>It is 51.'],
                    form='openai', content='', reasoning='Use the calculator.',
                    frame='<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>'),
    'minimax_m2': dict(template='MiniMax-M2.jinja', call_eos='[e~[', answer_eos='[e~[',
                       specials=[']~!b[', ']~b]', '[e~[', '<minimax:tool_call>', '</minimax:tool_call>'],
                       turns=['I should compute.\n</think>\n\n<minimax:tool_call>\n<invoke name="calculator">\n'
                              f'<parameter name="expression">{EXPRESSION}</parameter>\n</invoke>\n</minimax:tool_call>',
                              'Done.\n</think>\n\nIt is 51.'],
                       form='openai', content='', reasoning='I should compute.\n',
                       frame=']~b]tool\n<response>51</response>[e~[\n]~b]ai\n<think>\n'),
    'mistral': dict(template='Mistral-Small-3.2-24B-Instruct-2506.jinja', call_eos='</s>', answer_eos='</s>',
                    specials=['<s>', '</s>', '[INST]', '[/INST]', '[TOOL_CALLS]', '[ARGS]', '[TOOL_RESULTS]',
                              '[TOOL_CONTENT]', '[/TOOL_RESULTS]', '[SYSTEM_PROMPT]', '[/SYSTEM_PROMPT]'],
                    turns=[f'[TOOL_CALLS]calculator[ARGS]{{"expression": "{EXPRESSION}"}}', 'It is 51.'],
                    form='openai', content='', reasoning='', frame='[TOOL_CONTENT]51[/TOOL_RESULTS]'),
    'kimi_k2': dict(template='moonshotai-Kimi-K2.jinja', call_eos='<|im_end|>', answer_eos='<|im_end|>',
                    specials=['<|im_system|>', '<|im_user|>', '<|im_assistant|>', '<|im_middle|>',
                              '<|tool_calls_section_begin|>', '<|tool_calls_section_end|>', '<|tool_call_begin|>',
                              '<|tool_call_argument_begin|>', '<|tool_call_end|>'],
                    turns=['<|tool_calls_section_begin|><|tool_call_begin|>functions.calculator:0'
                           f'<|tool_call_argument_begin|>{{"expression": "{EXPRESSION}"}}<|tool_call_end|>'
                           '<|tool_calls_section_end|>', 'It is 51.'],
                    form='text', frame=r'## Return of functions.calculator:0\n51<|im_end|>'),  # its template's own \n
    'hermes': dict(template='Qwen-Qwen3-0.6B.jinja', call_eos='<|im_end|>', answer_eos='<|im_end|>', specials=[],
                   turns=[f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{EXPRESSION}"}}}}\n'
                          '</tool_call>', 'It is 51.'],
                   form='text', frame='<tool_response>\n51\n</tool_response>'),
}


def _template(case: Dict[str, Any]) -> Path:
    path = TEMPLATES / case['template']
    if not path.is_file():
        pytest.skip(f"{path} is not there: scripts/test.sh extracts the families' templates")
    return path


def _tokenizer(case: Dict[str, Any]) -> Any:
    tok = copy.deepcopy(make_tokenizer())
    tok.add_tokens(case['specials'], special_tokens=True)
    if '<s>' in case['specials']:
        tok.bos_token = '<s>'
    tok.eos_token = case['call_eos']
    return tok


def family_run(name: str, tmp_path: Path, policy: str = 'exact') -> Tuple[Path, Any]:
    """``mtflow run`` of the family's two replies in its real template; the run directory, the tokenizer."""
    case = CASES[name]
    if name == 'harmony':
        pytest.importorskip('openai_harmony')
    template = _template(case)
    tok = _tokenizer(case)
    tok.save_pretrained(tmp_path / 'tok')
    lines = []
    for turn, (text, eos) in enumerate(zip(case['turns'], (case['call_eos'], case['answer_eos'])), 1):
        ids = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids(eos)]
        lines.append(json.dumps({'uuid': 'q1', 'turn': turn, 'content': text, 'token_ids': ids}))
    (tmp_path / 'model.jsonl').write_text('\n'.join(lines) + '\n')
    (tmp_path / 'sched.yaml').write_text(f'name: {name}\nparser: {name}\ntools: [{{name: calculator}}]\n'
                                         'system_prompt: "Use the tools."\nmax_turns: 3\n')
    (tmp_path / 'prompts.jsonl').write_text(json.dumps({'uuid': 'q1', 'prompt': QUESTION}) + '\n')
    (tmp_path / 'run.yaml').write_text(
        'scheduler: sched.yaml\nbackend: scripted\nbackend_options: {path: model.jsonl, tokenizer: tok, '
        f'chat_template: {template}, prefix_policy: {policy}}}\ndataset: prompts.jsonl\nout: out\n'
        'request_config: {max_tokens: 200}\n')
    assert main(['run', str(tmp_path / 'run.yaml'), '-q']) == 0
    return tmp_path / 'out', tok


def _line(run_dir: Path) -> Dict[str, Any]:
    return json.loads((run_dir / 'trajectories.jsonl').read_text().splitlines()[0])


def _prompts(line: Dict[str, Any], tok: Any) -> List[str]:
    """The text of each turn's prompt, as the model was given it (the token record's ids)."""
    record = line['rollout_infos']['token_record']
    prompt = list(record['prompt_ids'])
    texts = [tok.decode(prompt, skip_special_tokens=False)]
    for seg, glue in zip(line['response_token_ids'], record['glue_ids']):
        prompt = prompt + list(seg) + list(glue)
        texts.append(tok.decode(prompt, skip_special_tokens=False))
    return texts


@pytest.mark.parametrize('name', sorted(CASES))
def test_a_two_turn_run_in_the_familys_real_template_passes_check_tokens(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    case = CASES[name]
    run_dir, tok = family_run(name, tmp_path)
    assert main(['check-tokens', str(run_dir)]) == 0
    line = _line(run_dir)
    assert line['finish_reason'] == 'stop_rule:no_tool_call'
    msgs = line['messages']
    call, result, answer = msgs[-3], msgs[-2], msgs[-1]
    assert [m['role'] for m in (call, result, answer)] == ['assistant', 'tool', 'assistant']
    assert result['content'] == '51' and 'It is 51.' in answer['content']  # the call ran
    assert isinstance(result.get('tool_call_id'), str) and result['tool_call_id']  # it answers its call
    if case['form'] == 'openai':
        (entry, ) = call['tool_calls']
        assert entry['id'] == result['tool_call_id'] and entry['type'] == 'function'
        assert entry['function'] == {'name': 'calculator', 'arguments': json.dumps({'expression': EXPRESSION})}
        assert call['content'] == case['content'] and call['reasoning_content'] == case['reasoning']
        assert EXPRESSION not in call['content']  # the call is in the message once: as tool_calls
    else:
        assert 'tool_calls' not in call and EXPRESSION in call['content']  # as the model wrote it
    if name == 'mistral':
        assert len(result['tool_call_id']) == 9 and result['tool_call_id'].isalnum()  # its template's rule
    if name == 'kimi_k2':
        assert result['tool_call_id'] == 'functions.calculator:0'  # the id the model wrote
    second = _prompts(line, tok)[1]
    # the next prompt holds the sampled call once (not again as the template's tool_calls), then the result
    assert second.count(EXPRESSION) == 1 and case['turns'][0] in second and case['frame'] in second
    assert second.index(case['turns'][0]) < second.index(case['frame'])


@pytest.mark.parametrize('name', ['harmony', 'minimax_m2', 'mistral'])
def test_the_template_rerendering_the_history_shows_each_call_once(name, tmp_path, monkeypatch):
    """Where the template renders the conversation again (``prefix_policy: rerender``; a trainer rendering
    the trajectory's messages), the call is the template's rendering of tool_calls, not that plus the text."""
    from mtflow import Executor, RolloutInferRequest
    from mtflow.backends.pairing import fit_scheduler
    from mtflow.backends.scripted import ScriptedBackend
    from mtflow.declarative import load_scheduler

    monkeypatch.chdir(tmp_path)
    case = CASES[name]
    family_run(name, tmp_path)  # writes the tokenizer, the script and the scheduler
    tok = AutoTokenizer.from_pretrained(tmp_path / 'tok')
    backend = ScriptedBackend(tmp_path / 'model.jsonl', tokenizer=tok, chat_template=str(_template(case)),
                              prefix_policy='rerender')
    scheduler = load_scheduler(str(tmp_path / 'sched.yaml'), tokenizer=tok)
    assert fit_scheduler(backend, scheduler) and scheduler.call_form == 'openai'
    prompts = []

    def rollout(requests, config=None):
        outs = backend(requests, config)
        prompts.extend(o.response.prompt_token_ids for o in outs)
        return outs

    request = scheduler.prepare(RolloutInferRequest(messages=[{'role': 'user', 'content': QUESTION}], uuid='q1'))
    result = Executor(scheduler, rollout, max_turns=3).run([request])
    assert result.ok and len(prompts) == 2
    second = tok.decode(prompts[1], skip_special_tokens=False)
    assert second.count(EXPRESSION) == 1 and case['frame'] in second  # re-rendered: tool_calls once
    assert case['turns'][0] not in second  # not the sampled text: the template's rendering of the call
    text = tok.apply_chat_template(_dict_args(result.outputs[0].messages[:-1]), chat_template=_template(case).read_text(),
                                   tokenize=False, add_generation_prompt=True)  # as a trainer renders them
    assert text.count(EXPRESSION) == 1 and case['frame'] in text


def _dict_args(messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Tool-call arguments as dicts, as vLLM's server and transformers' templates take them."""
    out = []
    for m in messages:
        if m.get('tool_calls'):
            m = dict(m, tool_calls=[dict(c, function=dict(c['function'], arguments=json.loads(c['function']['arguments'])))
                                    for c in m['tool_calls']])
        out.append(m)
    return out


@pytest.mark.parametrize('name', ['minimax_m2', 'kimi_k2'])
def test_a_replay_carries_the_calls_as_the_recorded_run_did(name, tmp_path, monkeypatch):
    """``mtflow replay`` reads the recorded run's form (``run.json``: ``tool_calls_as``) and gives the same
    messages, ids and all; its token record passes check-tokens too."""
    monkeypatch.chdir(tmp_path)
    run_dir, _ = family_run(name, tmp_path)
    info = json.loads((run_dir / 'run.json').read_text())
    assert info['attempts'][-1]['tool_calls_as'] == CASES[name]['form']
    assert main(['replay', str(run_dir), '--out', str(tmp_path / 'again'), '-q']) == 0
    assert main(['check-tokens', str(tmp_path / 'again')]) == 0
    assert _line(tmp_path / 'again')['messages'] == _line(run_dir)['messages']
