"""An agent on the OpenAI Agents SDK (``openai-agents``), unchanged: a function tool, the SDK's own
loop, its OpenAI client configured from the environment (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``),
as any deployment would point it at a server. The SDK's default API is the Responses API;
``--chat`` switches it to chat completions. Prints the final output."""
import sys

from agents import Agent, Runner, function_tool, set_default_openai_api, set_tracing_disabled

args = [a for a in sys.argv[1:] if a != '--chat']
if '--chat' in sys.argv:
    set_default_openai_api('chat_completions')
set_tracing_disabled(True)  # no trace upload (no network here)


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


agent = Agent(name='adder', instructions='You add numbers with the add tool.', tools=[add], model='any-model')
result = Runner.run_sync(agent, args[0] if args else 'What is 2 + 3?')
print(result.final_output)
