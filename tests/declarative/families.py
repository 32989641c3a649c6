"""The model families of issue 46 as the tests meet them: each family's special tokens, a chat
template shaped after the family's own (how it frames the assistant turn, the tool result and the
generation prompt, which may open ``<think>``), and a two-turn conversation written the way its
model writes it: reasoning, a call of the calculator, then the answer after the result."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, List, Optional

from mtflow.declarative.parsers import get_parser
from tests.tiny_model import make_tokenizer

CALL = ('calculator', {'expression': '2 + 3 * 4'})


def _template(system: str, user: str, assistant: str, tool: str, generation: str, head: str = '') -> str:
    """A Jinja chat template: each role's frame around ``{c}`` (the content; ``{n}``: a tool message's name)."""
    def frame(text: str) -> str:
        return text.replace('{c}', "{{ m['content'] }}").replace('{n}', "{{ m.get('name', '') }}")

    return (head + "{% for m in messages %}"
            "{% if m['role'] == 'system' %}" + frame(system) +
            "{% elif m['role'] == 'user' %}" + frame(user) +
            "{% elif m['role'] == 'assistant' %}" + frame(assistant) +
            "{% else %}" + frame(tool) + "{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}" + generation + "{% endif %}")


@dataclass
class Family:
    parser: str
    specials: List[str]
    eos: str
    template: str
    #: the model's two replies (its EOS is appended by the scripted backend)
    call_turn: str
    answer_turn: str
    #: how the template shows the calculator's result (``14``) to the model
    tool_frame: str
    reasoning: str = ''
    answer_reasoning: str = ''
    extra: List[str] = field(default_factory=list)

    def tokenizer(self) -> Any:
        tok = copy.deepcopy(make_tokenizer())
        tok.add_tokens(self.specials, special_tokens=True)
        tok.eos_token = self.eos
        tok.chat_template = self.template
        return tok


def _calls(parser: str) -> str:
    return get_parser(parser).render_calls([CALL])


def families() -> List[Family]:
    """Every family (harmony's call text is written by openai-harmony: it needs the package)."""
    out = [
        Family('qwen3_coder', ['<tool_call>', '</tool_call>'], '<|im_end|>',
               _template('<|im_start|>system\n{c}<|im_end|>\n', '<|im_start|>user\n{c}<|im_end|>\n',
                         '<|im_start|>assistant\n{c}<|im_end|>\n',
                         '<|im_start|>user\n<tool_response>\n{c}\n</tool_response><|im_end|>\n', '<|im_start|>assistant\n'),
               "I'll compute it.\n" + _calls('qwen3_coder'), 'It is 14.',
               '<|im_start|>user\n<tool_response>\n14\n</tool_response><|im_end|>'),
        Family('glm45', ['[gMASK]', '<sop>', '<|system|>', '<|user|>', '<|assistant|>', '<|observation|>', '<arg_key>',
                         '</arg_key>', '<arg_value>', '</arg_value>'], '<|observation|>',
               _template('<|system|>\n{c}', '<|user|>\n{c}', '<|assistant|><think>{c}',
                         '<|observation|><tool_response>{c}</tool_response>', '<|assistant|><think>',
                         head='[gMASK]<sop>'),
               'The user wants 2 + 3 * 4.</think>\n' + _calls('glm45'), 'It worked.</think>\nIt is 14.',
               '<|observation|><tool_response>14</tool_response>', reasoning='The user wants 2 + 3 * 4.',
               answer_reasoning='It worked.'),
        Family('kimi_k2', ['<|im_system|>', '<|im_user|>', '<|im_assistant|>', '<|im_middle|>', '<|tool_calls_section_begin|>',
                           '<|tool_calls_section_end|>', '<|tool_call_begin|>', '<|tool_call_argument_begin|>',
                           '<|tool_call_end|>'], '<|im_end|>',
               _template('<|im_system|>system<|im_middle|>{c}<|im_end|>', '<|im_user|>user<|im_middle|>{c}<|im_end|>',
                         '<|im_assistant|>assistant<|im_middle|>{c}<|im_end|>',
                         '<|im_system|>tool<|im_middle|>## Return of {n}\n{c}<|im_end|>',
                         '<|im_assistant|>assistant<|im_middle|>'),
               '<think>Use the calculator.</think>' + _calls('kimi_k2'), '<think>Done.</think>It is 14.',
               '<|im_system|>tool<|im_middle|>## Return of calculator\n14<|im_end|>', reasoning='Use the calculator.',
               answer_reasoning='Done.'),
        Family('deepseek_v32', ['<｜begin▁of▁sentence｜>', '<｜end▁of▁sentence｜>', '<｜User｜>', '<｜Assistant｜>'],
               '<｜end▁of▁sentence｜>',
               _template('{c}', '<｜User｜>{c}', '<｜Assistant｜><think>{c}<｜end▁of▁sentence｜>',
                         '<｜User｜><function_results>\n<result>{c}</result>\n</function_results>',
                         '<｜Assistant｜><think>', head='<｜begin▁of▁sentence｜>'),
               'Use the calculator.</think>\n\n' + _calls('deepseek_v32'), 'Got 14.</think>It is 14.',
               '<｜User｜><function_results>\n<result>14</result>\n</function_results>', reasoning='Use the calculator.',
               answer_reasoning='Got 14.'),
        Family('minimax_m2', [']~!b[', ']~b]', '[e~[', '<minimax:tool_call>', '</minimax:tool_call>'], '[e~[',
               _template(']~b]system\n{c}[e~[\n', ']~b]user\n{c}[e~[\n', ']~b]ai\n<think>\n{c}[e~[\n',
                         ']~b]tool\n<response>{c}</response>[e~[\n', ']~b]ai\n<think>\n', head=']~!b['),
               'I should compute.\n</think>\n\n' + _calls('minimax_m2'), 'Done.\n</think>\n\nIt is 14.',
               ']~b]tool\n<response>14</response>[e~[', reasoning='I should compute.\n', answer_reasoning='Done.\n'),
    ]
    return out


def harmony_family() -> Optional[Family]:
    """gpt-oss, or None without openai-harmony (and its vocabulary)."""
    try:
        calls = _calls('harmony')
    except (ImportError, RuntimeError):
        return None
    call_text = calls[:-len('<|call|>')] if calls.endswith('<|call|>') else calls
    return Family('harmony', ['<|start|>', '<|end|>', '<|message|>', '<|channel|>', '<|constrain|>', '<|call|>',
                              '<|return|>'], '<|call|>',
                  _template('<|start|>system<|message|>{c}<|end|>', '<|start|>user<|message|>{c}<|end|>',
                            '<|start|>assistant{c}<|call|>',
                            '<|start|>functions.{n} to=assistant<|channel|>commentary<|message|>{c}<|end|>',
                            '<|start|>assistant'),
                  '<|channel|>analysis<|message|>Use the calculator.<|end|><|start|>assistant' + call_text,
                  '<|channel|>analysis<|message|>Got it.<|end|><|start|>assistant<|channel|>final<|message|>It is 14.',
                  '<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>14<|end|>',
                  reasoning='Use the calculator.', answer_reasoning='Got it.')
