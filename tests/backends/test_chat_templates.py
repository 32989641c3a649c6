"""Chat templates checked before the first turn (``mtflow/backends/chat_templates.py``): every
family's own template shows the model the whole tool-use conversation; a template that drops a
role, the tool's result or the generation prompt is refused in one line naming it and the role;
``chat_template:`` takes a file, Jinja text or a bundled name and refuses anything else.

The families' templates are the files their model repositories ship, as two registry packages
carry them (``scripts/test.sh`` extracts them into ``.extras/chat-templates``, offline here):
llama.cpp's test copies inside the ``llama-cpp-python`` 0.3.36 sdist and TRL 1.16's originals
inside its wheel. Rendering needs no model: the tiny test tokenizer renders any template."""
from pathlib import Path

import pytest

pytest.importorskip('transformers')

from mtflow.backends import BackendError  # noqa: E402
from mtflow.backends.chat_templates import (BUNDLED, CALL_ID, PROBE_TOOLS, TEXT_CALL_MESSAGES, call_form,  # noqa: E402
                                            resolve_chat_template, template_problems)
from tests.tiny_model import make_tokenizer  # noqa: E402

TEMPLATES = Path(__file__).resolve().parents[2] / '.extras' / 'chat-templates'
#: family -> its template, as the model's repository ships it (llama.cpp/: llama-cpp-python's sdist; trl/: TRL's wheel)
FAMILIES = {
    'Qwen2.5': 'llama.cpp/Qwen-Qwen2.5-7B-Instruct.jinja',
    'Qwen3': 'llama.cpp/Qwen-Qwen3-0.6B.jinja',
    'Qwen3-Coder': 'llama.cpp/Qwen3-Coder.jinja',
    'gpt-oss (harmony)': 'llama.cpp/openai-gpt-oss-120b.jinja',
    'GLM-4.5': 'trl/glm4moe.jinja',
    'GLM-4.6': 'llama.cpp/GLM-4.6.jinja',
    'Kimi-K2': 'llama.cpp/moonshotai-Kimi-K2.jinja',
    'DeepSeek-V3': 'trl/deepseekv3.jinja',
    'DeepSeek-V3.1': 'llama.cpp/deepseek-ai-DeepSeek-V3.1.jinja',
    'DeepSeek-V3.2': 'llama.cpp/deepseek-ai-DeepSeek-V3.2.jinja',
    'MiniMax-M2': 'llama.cpp/MiniMax-M2.jinja',
    'Llama 3.1': 'llama.cpp/meta-llama-Llama-3.1-8B-Instruct.jinja',
    'Llama 3.2': 'llama.cpp/meta-llama-Llama-3.2-3B-Instruct.jinja',
    'Llama 3.3': 'llama.cpp/meta-llama-Llama-3.3-70B-Instruct.jinja',
    'Mistral Small 3.2': 'llama.cpp/Mistral-Small-3.2-24B-Instruct-2506.jinja',
    'Devstral (Mistral)': 'llama.cpp/unsloth-mistral-Devstral-Small-2507.jinja',
}
#: families whose template refuses a tool message after an assistant message without tool_calls:
#: a YAML scheduler carries the calls it read from the text as tool_calls for them (call_form 'openai')
NEEDS_STRUCTURED_CALLS = {'gpt-oss (harmony)', 'MiniMax-M2', 'Mistral Small 3.2'}

CHATML_BODY = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
GENERATION = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
#: (template, the role its refusal names, words the refusal says)
BAD = {
    'drops tool messages': (CHATML_BODY.replace('{% for m in messages %}', "{% for m in messages if m.role != 'tool' %}")
                            + GENERATION, 'role tool', "drops the tool's result"),
    'drops the system message': (CHATML_BODY.replace('{% for m in messages %}',
                                                     "{% for m in messages if m.role != 'system' %}") + GENERATION,
                                 'role system', 'drops the system message'),
    'no generation prompt': (CHATML_BODY, 'role assistant', "writes '<|im_start|>assistant' before an assistant"),
    'a generation prompt after user messages only': (
        CHATML_BODY + GENERATION.replace('add_generation_prompt', "add_generation_prompt and messages[-1].role == 'user'"),
        'role assistant', 'no generation prompt after a tool result'),
    'drops the tool call': (CHATML_BODY.replace("{{ m.content }}", "{% if m.role != 'assistant' or not m.tool_calls %}"
                                                "{{ m.content }}{% endif %}") + GENERATION,
                            'role assistant', 'drops the tool call'),
}


@pytest.fixture(scope='module')
def tok():
    return make_tokenizer()


def family_template(family):
    path = TEMPLATES / FAMILIES[family]
    if not path.is_file():
        pytest.skip(f'{path} is not there: scripts/test.sh extracts the families\' templates')
    return str(path)


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_each_familys_own_template_passes(tok, family):
    """Every family's template passes, text-parsed calls included: in the form it takes them."""
    path = family_template(family)
    assert template_problems(tok, path) == []
    assert template_problems(tok, path, text_calls=True) == []
    assert call_form(tok, path) == ('openai' if family in NEEDS_STRUCTURED_CALLS else 'text')


@pytest.mark.parametrize('family', sorted(set(FAMILIES) - NEEDS_STRUCTURED_CALLS))
def test_the_id_on_a_tool_message_leaves_the_prompt_as_it_was(tok, family):
    """Calls read from the text now give their tool message a tool_call_id: the templates that took such a
    conversation before render the same prompt, but Kimi-K2's, which now names the call it answers."""
    path = family_template(family)
    with_id = TEXT_CALL_MESSAGES[:4]
    without = with_id[:3] + [{k: v for k, v in with_id[3].items() if k != 'tool_call_id'}]
    render = [tok.apply_chat_template(m, chat_template=Path(path).read_text(), tools=PROBE_TOOLS, tokenize=False,
                                      add_generation_prompt=True) for m in (with_id, without)]
    if family == 'Kimi-K2':
        assert f'## Return of {CALL_ID}' in render[0] and '## Return of \\n' in render[1]
    else:
        assert render[0] == render[1]


def test_a_template_that_takes_calls_in_neither_form_is_refused(tok, tmp_path):
    """A template that raises on a tool message after calls in the text, and on tool_calls too."""
    path = tmp_path / 'strict.jinja'
    path.write_text("{% for m in messages %}{% if m.role == 'tool' and not loop.previtem.tool_calls_ok %}"
                    "{{ raise_exception('no tool messages here') }}{% endif %}<|im_start|>{{ m.role }}\n"
                    "{{ m.content }}<|im_end|>\n{% endfor %}" + GENERATION)
    assert call_form(tok, str(path)) is None
    assert template_problems(tok, str(path)) != []  # the probe's own tool message fails it first


def test_the_bundled_and_tiny_templates_pass(tok):
    assert template_problems(tok, None) == []
    assert template_problems(make_tokenizer(style='llama'), None, text_calls=True) == []
    for name in BUNDLED:
        assert template_problems(tok, name, text_calls=True) == [], name


@pytest.mark.parametrize('case', sorted(BAD))
def test_a_bad_template_is_refused_naming_it_and_the_role(tok, tmp_path, case):
    text, role, words = BAD[case]
    path = tmp_path / 'bad.jinja'
    path.write_text(text)
    problems = template_problems(tok, str(path))
    assert len(problems) >= 1 and all('\n' not in p and str(path) in p for p in problems)
    assert any(role in p and words in p for p in problems), problems


def test_chat_template_takes_a_file_text_or_a_bundled_name(tmp_path):
    path = tmp_path / 'mine.jinja'
    path.write_text(CHATML_BODY + GENERATION)
    assert resolve_chat_template(str(path)).text == CHATML_BODY + GENERATION
    assert resolve_chat_template(str(path)).origin == 'a template file'
    assert resolve_chat_template(CHATML_BODY).origin.startswith('Jinja text given inline')
    assert resolve_chat_template('llama3').origin == 'bundled template llama3'
    assert resolve_chat_template(None).text is None
    with pytest.raises(BackendError, match=r"'templates/qwen3\.jinja' is not a file \(no such file: .*\), a bundled "):
        resolve_chat_template('templates/qwen3.jinja')
    (tmp_path / 'notes.txt').write_text('remember to set the template')
    with pytest.raises(BackendError, match=r'notes\.txt holds no Jinja .*: it is not a chat template'):
        resolve_chat_template(str(tmp_path / 'notes.txt'))
    with pytest.raises(BackendError, match='is a directory'):
        resolve_chat_template(str(tmp_path))
