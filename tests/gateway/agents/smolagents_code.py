"""A smolagents ``CodeAgent`` with ``OpenAIServerModel``, unchanged, pointed at the server in
``OPENAI_BASE_URL``: the model writes Python, smolagents runs it. Prints the final answer."""
import os
import sys

from smolagents import CodeAgent, OpenAIServerModel

model = OpenAIServerModel(model_id='any-model', api_base=os.environ['OPENAI_BASE_URL'],
                          api_key=os.environ['OPENAI_API_KEY'])
agent = CodeAgent(tools=[], model=model, max_steps=4, verbosity_level=0)
print(agent.run(sys.argv[1] if len(sys.argv) > 1 else 'What is 2 + 3?'))
