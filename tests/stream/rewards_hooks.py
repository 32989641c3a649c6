"""A ``turn_reward`` hook for the tests: longer replies earn more, a reply saying 'skip' is not scored."""


def by_length(infer_request, completion, infos, turn):
    if 'skip' in completion:
        return None
    return len(completion) / 10.0


def not_a_number(infer_request, completion, infos, turn):
    return 'high'
