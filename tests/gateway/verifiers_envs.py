"""A verifiers ``MultiTurnEnv`` (a number-guessing game: ``env_response`` answers higher or lower, a
stop condition ends it) and a ``ToolEnv`` (an ``add`` tool), each with its ``Rubric``: the
environments of ``test_verifiers.py``, loaded in the verifiers venv (``verifiers`` 0.3.1, the
newest release with the ``MultiTurnEnv``/``ToolEnv``/``Rubric`` API; 0.4.0 has only its v1 stack)."""
import re

import verifiers as vf
from datasets import Dataset


def _guess(text):
    found = re.findall(r'-?\d+', text or '')
    return int(found[-1]) if found else None


def _last_assistant(messages):
    for m in reversed(messages or []):
        if m.get('role') == 'assistant':
            return m.get('content') or ''
    return ''


class GuessEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        guess, target = _guess(_last_assistant(messages)), int(state['answer'])
        return [{'role': 'user', 'content': 'higher' if guess is None or guess < target else 'lower'}]

    @vf.stop
    async def guessed_right(self, state, **kwargs):
        trajectory = state['trajectory']
        if not trajectory:
            return False
        return _guess(_last_assistant(trajectory[-1]['completion'])) == int(state['answer'])


def correct(completion, answer, **kwargs):
    return 1.0 if _guess(_last_assistant(completion)) == int(answer) else 0.0


def quick(completion, **kwargs):
    turns = sum(1 for m in completion if m.get('role') == 'assistant')
    return 1.0 / turns if turns else 0.0


def load_guess():
    data = Dataset.from_list([{'question': f'Guess my number (1 to 9). [{k}]', 'answer': str(t)}
                              for k, t in enumerate([5, 8, 2, 7, 6])])
    return GuessEnv(dataset=data, eval_dataset=data, max_turns=3, system_prompt='You play a guessing game.',
                    rubric=vf.Rubric(funcs=[correct, quick], weights=[1.0, 0.5]))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a + b


def load_add():
    data = Dataset.from_list([{'question': f'What is {a} + {b}?', 'answer': str(a + b)}
                              for a, b in [(2, 3), (7, 1), (4, 4), (9, 9)]])
    return vf.ToolEnv(tools=[add], dataset=data, eval_dataset=data, max_turns=4,
                      system_prompt='Use the add tool, then say the answer.', rubric=vf.Rubric(funcs=[correct]))
