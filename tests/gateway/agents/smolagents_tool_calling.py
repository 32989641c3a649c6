"""A smolagents ``ToolCallingAgent`` with ``OpenAIServerModel``, unchanged, pointed at the server in
``OPENAI_BASE_URL``. Prints the final answer."""
import os
import sys

from smolagents import OpenAIServerModel, ToolCallingAgent, tool


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a + b


model = OpenAIServerModel(model_id='any-model', api_base=os.environ['OPENAI_BASE_URL'],
                          api_key=os.environ['OPENAI_API_KEY'])
agent = ToolCallingAgent(tools=[add], model=model, max_steps=4, verbosity_level=0)
print(agent.run(sys.argv[1] if len(sys.argv) > 1 else 'What is 2 + 3?'))
