"""The "model" of the verifiers 0.4 tests: its reply a pure function of the conversation, so that
verifiers' own evaluation (its harness program calling a reference chat server started here) and
mtflow (the scripted backend, ``Player``) sample the same replies. It plays the guessing games of
``tests/envs/openenv_app.py`` (a digit, 1-9) and ``schedulers/openenv_guess_server.py`` (1-100) as
OpenEnv JSON actions, searching a fifth of the way into the range it has left (so it runs out of
tries on some games: the rewards differ), and answers ``vf_arith``'s sums (wrong on some)."""
import json
import re

from tests.gateway.verifiers_model import _text  # stdlib only: the verifiers venvs import it too


def reply_text(messages):
    users = [_text(m) for m in messages if m.get('role') == 'user']
    if users[0].startswith('What is'):  # vf_arith's sums: right, but one off when the first number is odd
        a, b = map(int, re.findall(r'\d+', users[0])[:2])
        return f'The answer is {a + b + a % 2}.'
    low, high = (1, 9) if 'digit' in users[0] else (1, 100)
    guess = None
    for m in messages:
        if m.get('role') == 'assistant':
            found = re.findall(r'\d+', _text(m))
            guess = int(found[-1]) if found else guess
        elif m.get('role') == 'user' and guess is not None:
            said = _text(m).lower()
            if 'higher' in said:
                low = guess + 1
            elif 'lower' in said:
                high = guess - 1
    return json.dumps({"message": str(low + (high - low) // 5)})


class Player:
    """The scripted backend answering with :func:`reply_text` (``backend: verifiers04_model:Player``)."""

    def __new__(cls, **options):
        from mtflow.backends.scripted import ScriptedBackend
        return ScriptedBackend(respond=lambda request: reply_text(request.messages), **options)
