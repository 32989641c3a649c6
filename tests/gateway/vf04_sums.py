"""A verifiers 0.4 taskset for ``test_verifiers04_gateway.py`` (run by verifiers' own ``vf-eval``,
with its ``SingleAgentEnv`` and ``null`` harness: a chat program per rollout): sums, each scored
by the task's own ``@vf.reward``, the reply's last number against the answer."""
import re

import verifiers.v1 as vf

SUMS = ((2, 3), (7, 8), (4, 4), (9, 6))


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        found = re.findall(r'-?\d+', trace.last_reply or '')
        return float(bool(found) and int(found[-1]) == self.data.answer)


class SumConfig(vf.TasksetConfig):
    pass


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        return [SumTask(SumData(prompt=f'What is {a} + {b}?', system_prompt='Answer with the number.', answer=a + b),
                        self.config.task) for a, b in SUMS]


__all__ = ['SumTaskset']
