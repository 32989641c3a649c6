"""A plain verifiers 0.4 taskset (no Env of its own: verifiers runs it with ``SingleAgentEnv``) for
``test_verifiers04.py``: sums, each scored by the task's own ``@vf.reward`` (the reply's last
number against the answer)."""
import re

import verifiers.v1 as vf


class ArithData(vf.TaskData):
    answer: int


class ArithTask(vf.Task[ArithData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        found = re.findall(r'-?\d+', trace.last_reply or '')
        return float(bool(found) and int(found[-1]) == self.data.answer)


class ArithConfig(vf.TasksetConfig):
    pass


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self):
        return [ArithTask(ArithData(prompt=f'What is {a} + {b}?', system_prompt='Answer with the number.',
                                    answer=a + b), self.config.task) for a, b in ((2, 3), (7, 8), (4, 4), (9, 6))]


__all__ = ['ArithTaskset']
