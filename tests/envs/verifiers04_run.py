"""Run in the verifiers 0.4 venv (``.extras/verifiers04-venv``) by ``test_verifiers04.py``: two OpenEnv
environments (the tests' guess-a-digit app and ``schedulers/openenv_guess_server.py``) through
verifiers' own OpenEnv taskset, once with verifiers' own evaluation (``vf-eval``: its ``null``
harness, a chat program per rollout, calling a reference chat server that answers with
``verifiers04_model.reply_text``) and once in-process under ``mtflow run`` (``env: {verifiers: ...}``,
the scripted backend answering with the same function). Prints one JSON line:
``{env: {'vf': {task: [reward, turns]}, 'mtflow': {...}}}``. Usage: ``verifiers04_run.py OUT_DIR``."""
import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

from aiohttp import web

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from verifiers04_model import reply_text  # noqa: E402

APPS = {'digit': 'tests.envs.openenv_app:app', 'number': 'schedulers.openenv_guess_server:app'}  # and vf_arith
RESETS = [{'seed': s} for s in (1, 4, 7, 12)]


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def serve_openenv(app):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENENV_TEST_MAX_SESSIONS='64')
    proc = subprocess.Popen([sys.executable, '-m', 'uvicorn', app, '--host', '127.0.0.1', '--port', str(port),
                             '--log-level', 'warning'], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=1)
            return proc, f'http://127.0.0.1:{port}'
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f'{app} did not start')


def reference_model():
    """A chat-completions server (streamed, as verifiers' interception asks) in a thread."""
    async def chat(request):
        body = await request.json()
        text = reply_text(body['messages'])
        base = {'id': 'x', 'object': 'chat.completion.chunk', 'created': 0, 'model': 'm'}
        if not body.get('stream'):
            return web.json_response({**base, 'object': 'chat.completion', 'choices': [
                {'index': 0, 'message': {'role': 'assistant', 'content': text}, 'finish_reason': 'stop'}]})
        resp = web.StreamResponse(headers={'Content-Type': 'text/event-stream'})
        await resp.prepare(request)
        for chunk in ({**base, 'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': text}}]},
                      {**base, 'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]},
                      {**base, 'choices': [], 'usage': {'prompt_tokens': 1, 'completion_tokens': 1,
                                                         'total_tokens': 2}}):
            await resp.write(f'data: {json.dumps(chunk)}\n\n'.encode())
        await resp.write(b'data: [DONE]\n\n')
        return resp

    port = free_port()
    loop = asyncio.new_event_loop()

    async def start():
        app = web.Application()
        app.router.add_post('/v1/chat/completions', chat)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, '127.0.0.1', port).start()
    loop.run_until_complete(start())
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return f'http://127.0.0.1:{port}/v1'


def verifiers_own(out, name, url, model_url):
    run_dir = out / f'vf-{name}'
    resets = '[' + ', '.join(f'{{seed = {r["seed"]}}}' for r in RESETS) + ']'
    taskset = 'id = "vf_arith"' if url is None else f'id = "openenv"\nbase_url = "{url}"\nresets = {resets}'
    seat = 'agent' if url is None else 'player'  # SingleAgentEnv's seat, OpenEnvEnv's
    (out / f'{name}.toml').write_text(textwrap.dedent(f'''\
        model = "m"
        push = false
        output_dir = "{run_dir}"
        [client]
        base_url = "{model_url}"
        [env.{seat}.harness]
        id = "null"
        [env.{seat}.runtime]
        type = "subprocess"
        ''') + f'[env.taskset]\n{taskset}\n')
    vf_eval = Path(sys.executable).with_name('vf-eval')
    env = dict(os.environ, PRIME_API_KEY='unused', PATH=f'{vf_eval.parent}:{os.environ.get("PATH", "")}')
    done = subprocess.run([str(vf_eval), '@', str(out / f'{name}.toml')], capture_output=True, text=True, env=env,
                          timeout=600)
    traces = next(run_dir.glob('*/traces.jsonl'), None)
    if done.returncode != 0 or traces is None:
        raise RuntimeError(f'vf-eval failed: {done.stdout[-2000:]} {done.stderr[-2000:]}')
    rows = {}
    for line in traces.read_text().splitlines():
        episode = json.loads(line)
        trace = episode['traces'][0]
        reward = sum(r['score'] * r.get('weight', 1.0) for r in (trace.get('rewards') or {}).values() if r)
        turns = sum(1 for node in trace['nodes'] if node['message']['role'] == 'assistant')
        rows[episode['task']['data']['idx']] = [reward, turns]
    return rows


def under_mtflow(out, name, url):
    from mtflow.cli import main
    section = ('taskset: vf_arith' if url is None else
               f"taskset: openenv\n    config: {{base_url: '{url}', resets: {json.dumps(RESETS)}}}")
    (out / f'{name}.yaml').write_text(textwrap.dedent(f'''\
        name: vf_{name}
        max_turns: 10
        env:
          verifiers:
            SECTION
        stop: {{on_length: false}}
        ''').replace('SECTION', section))
    (out / f'{name}.jsonl').write_text(''.join(json.dumps({'uuid': f't{i}', 'prompt': '(the task opens it)', 'task': i})
                                               + '\n' for i in range(len(RESETS))))
    (out / f'{name}_run.yaml').write_text(f'scheduler: {name}.yaml\nbackend: verifiers04_model:Player\n'
                                          f'dataset: {name}.jsonl\nout: {name}_out\nbatch_size: 4\n')
    code = main(['run', str(out / f'{name}_run.yaml'), '--no-progress'])
    lines = [json.loads(l) for l in (out / f'{name}_out' / 'trajectories.jsonl').read_text().splitlines()]
    return code, {int(t['uuid'][1:]): [t['reward'], t['num_turns']] for t in lines}, lines


def main(out):
    model_url = reference_model()
    report = {}
    for name, app in [*APPS.items(), ('arith', None)]:
        proc, url = serve_openenv(app) if app else (None, None)
        try:
            own = verifiers_own(out, name, url, model_url)
            code, mine, lines = under_mtflow(out, name, url)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(10)
        report[name] = {'vf': own, 'mtflow': mine, 'exit_code': code,
                        'infos': {t['uuid']: t['rollout_infos']['env_info'].get('verifiers_rewards') for t in lines}}
    print(json.dumps(report))


if __name__ == '__main__':
    main(Path(sys.argv[1]))
