"""The environment of the replay regression example (``docs/replay.md``): find a hidden number
between 1 and 50 with "warmer" / "colder" hints (how far the guess is from the target, compared
with the previous one); solving it in fewer replies earns more."""
import re


class HotColdEnv:
    def __init__(self, max_replies: int = 5, close_within: int = 3) -> None:
        self.max_replies, self.close_within = max_replies, close_within

    def reset(self, infer_request):
        self.target = int(infer_request.data_dict['target'])
        self.previous = None
        self.replies = 0
        return None

    def step(self, action):
        self.replies += 1
        numbers = re.findall(r'\d+', action or '')
        last = self.replies >= self.max_replies
        if not numbers:
            return 'Say a number.', 0.0, last, {}
        distance = abs(int(numbers[-1]) - self.target)
        if distance == 0:
            return 'Found it!', round(1.0 - 0.2 * (self.replies - 1), 2), True, {'replies': self.replies}
        if distance <= self.close_within:
            hint = 'Very close.'
        elif self.previous is None:
            hint = 'Not it.'
        else:
            hint = 'Warmer.' if distance < self.previous else 'Colder.'
        self.previous = distance
        return hint, 0.0, last, {}

    def close(self):
        pass
