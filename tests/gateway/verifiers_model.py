"""The "model" of the verifiers tests: its reply as a pure function of the conversation (plain
dicts), so that two servers (the gateway, and a reference server for verifiers' own evaluation)
sample the same outputs for the same prompts. Standard library only: the verifiers venv imports it
too. Tool calls are written in the Hermes format (``<tool_call>{...}</tool_call>``)."""
import json
import re

CALL = re.compile(r'<tool_call>\s*(\{.*?\})\s*</tool_call>', re.DOTALL)


def _text(message):
    content = message.get('content') or ''
    if isinstance(content, list):
        content = ''.join(p.get('text', '') for p in content if isinstance(p, dict))
    return content


def reply_text(messages):
    """The model's text for ``messages``: a number-guessing player, or a calculator that calls ``add``."""
    task = next(_text(m) for m in messages if m.get('role') == 'user')
    said = [_text(m) for m in messages if m.get('role') == 'assistant']
    if 'Guess' in task:
        guess = 5
        for m in messages:
            hint = _text(m)
            if m.get('role') == 'user' and hint in ('higher', 'lower'):
                guess += 3 if hint == 'higher' else -3
        return f'My guess: {guess}'
    a, b = map(int, re.findall(r'-?\d+', task)[:2])
    results = [_text(m) for m in messages if m.get('role') == 'tool']
    if not results:
        return 'Let me add.\n<tool_call>\n' + json.dumps({'name': 'add', 'arguments': {'a': a, 'b': b}}) + \
            '\n</tool_call>'
    total = int(results[-1]) + (1 if a >= 5 else 0)  # it slips on big numbers: a reward of 0 there
    del said
    return f'The answer is {total}'


def split_calls(text):
    """``(content, [(name, arguments)])`` of the model's text (what the reference server returns)."""
    calls = [json.loads(m.group(1)) for m in CALL.finditer(text)]
    content = CALL.sub('', text).strip()
    return content, [(c['name'], c['arguments']) for c in calls]
