"""An external agent for ``mtflow run configs/agent.yaml`` (docs/gateway.md): any program that
takes its task and talks to ``OPENAI_BASE_URL`` works; this one uses the ``openai`` client and one
tool. ``score`` is the run's verifier: the reward of an episode from its transcript."""
import json
import re
import sys


def score(episode):
    """1.0 when the agent exited cleanly and the model's last answer is the dataset's answer."""
    said = [m['content'] for m in episode.messages if m['role'] == 'assistant']
    found = re.findall(r'-?\d+', said[-1]) if said else []
    ok = episode.exit_code == 0 and bool(found) and int(found[-1]) == episode.data['answer']
    return {'reward': 1.0 if ok else 0.0, 'info': {'turns': episode.turns}}


def main(task):
    from openai import OpenAI  # the client reads OPENAI_BASE_URL and OPENAI_API_KEY: its own session

    client = OpenAI()
    tools = [{'type': 'function', 'function': {'name': 'add', 'parameters': {
        'type': 'object', 'properties': {'a': {'type': 'integer'}, 'b': {'type': 'integer'}}}}}]
    messages = [{'role': 'user', 'content': task}]
    for _ in range(4):
        reply = client.chat.completions.create(model='any', messages=messages, tools=tools).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            print(reply.content)
            return
        for call in reply.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({'role': 'tool', 'tool_call_id': call.id, 'content': str(args['a'] + args['b'])})


if __name__ == '__main__':
    main(sys.argv[1])
