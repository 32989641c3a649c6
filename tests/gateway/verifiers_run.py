"""Run in the verifiers venv: verifiers' own ``Environment.evaluate`` of one environment
(``guess`` or ``add``), its client pointed at ``URL``; ``--reference`` serves the test model from a
plain OpenAI-compatible server started here instead. Against the gateway each rollout is its own
session (the client's ``extra_headers_from_state`` names it by the rollout's ``trajectory_id``) and
is finished with the rubric's reward. Prints one JSON line: ``[{example_id, session, reward}]``."""
import asyncio
import json
import sys
import uuid

import httpx
from aiohttp import web

from verifiers.types import ClientConfig

from verifiers_envs import load_add, load_guess
from verifiers_model import reply_text, split_calls


async def reference_server():
    async def chat(request):
        body = await request.json()
        content, calls = split_calls(reply_text(body['messages']))
        message = {'role': 'assistant', 'content': content or None}
        if calls:
            message['tool_calls'] = [{'id': f'call_{uuid.uuid4().hex[:8]}', 'type': 'function',
                                      'function': {'name': n, 'arguments': json.dumps(a)}} for n, a in calls]
        return web.json_response({'id': 'x', 'object': 'chat.completion', 'created': 0, 'model': 'm', 'choices': [
            {'index': 0, 'message': message, 'finish_reason': 'tool_calls' if calls else 'stop'}],
            'usage': {'prompt_tokens': 1, 'completion_tokens': 1, 'total_tokens': 2}})

    app = web.Application()
    app.router.add_post('/v1/chat/completions', chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, '127.0.0.1', 0)
    await site.start()
    return runner, f'http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1'


async def main(env_name, url):
    env = load_guess() if env_name == 'guess' else load_add()
    runner = None
    if url == '--reference':
        runner, url = await reference_server()
    config = ClientConfig(api_base_url=url, api_key_var='MTFLOW_UNUSED_KEY', max_retries=0, timeout=60,
                          extra_headers_from_state={'X-Mtflow-Session': 'trajectory_id'})
    results = await env.evaluate(client=config, model='m', sampling_args={'max_tokens': 64},
                                 state_columns=['trajectory_id'], max_concurrent=4)
    rows = [{'example_id': o['example_id'], 'session': o['trajectory_id'], 'reward': o['reward'],
             'error': str(o.get('error')) if o.get('error') else None} for o in results['outputs']]
    if runner is not None:
        await runner.cleanup()
    else:  # the gateway: each session finished with the rubric's reward
        gateway = url.rsplit('/v1', 1)[0]
        async with httpx.AsyncClient(timeout=60) as client:
            for row in rows:
                done = await client.post(f'{gateway}/s/{row["session"]}/finish',
                                         json={'reward': row['reward'], 'info': {'example_id': row['example_id']}})
                done.raise_for_status()
    print(json.dumps(sorted(rows, key=lambda r: r['example_id'])))


if __name__ == '__main__':
    import os
    os.environ.setdefault('MTFLOW_UNUSED_KEY', 'unused')
    asyncio.run(main(sys.argv[1], sys.argv[2]))
