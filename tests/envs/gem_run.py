"""Run in the GEM venv (``.extras/gem-venv``, gem-llm 0.1.0) by ``test_gem.py``: two GEM games through
``mtflow run`` with the scripted model, and the same replies stepped through GEM's own environments;
prints both as one JSON line. Usage: ``gem_run.py OUT_DIR``."""
import json
import sys
import textwrap
from pathlib import Path

import gem

from mtflow.cli import main

GAMES = {
    # id, kwargs, the replies of each request (by seed), the last one chosen from the secret
    'game:GuessTheNumber-v0-easy': {},
    'game:Mastermind-v0-easy': {'max_turns': 3},
}
SEEDS = [0, 1, 2, 3, 4]


def replies(game_id, kwargs, seed):
    """Fixed guesses, except that seeds 0 and 3 find the secret on their second reply, and seed 4
    answers in the wrong format."""
    env = gem.make(game_id, **kwargs)
    env.reset(seed=seed)
    if seed == 4:
        return ['I am not sure.'] * 4
    if game_id.startswith('game:GuessTheNumber'):
        secret = f'\\boxed{{{env.game_number}}}'
        fixed = ['\\boxed{5}', '\\boxed{3}', '\\boxed{8}', '\\boxed{1}']
    else:
        secret = '\\boxed{' + ' '.join(map(str, env.game_code)) + '}'
        fixed = ['\\boxed{1 2}', '\\boxed{3 4}', '\\boxed{5 6}']
    return [fixed[0], secret] + fixed[2:] if seed in (0, 3) else fixed


def gem_own(game_id, kwargs, seed, texts):
    """GEM's own loop: reset with the seed, step each reply until the episode ends."""
    env = gem.make(game_id, **kwargs)
    env.reset(seed=seed)
    rewards = []
    for text in texts:
        _, reward, terminated, truncated, _ = env.step(text)
        rewards.append(float(reward))
        if terminated or truncated:
            return rewards, 'stop_rule:env_done' if terminated else 'stop_rule:env_truncated'
    return rewards, 'max_turns'


def run_mtflow(out, game_id, kwargs, scripts):
    name = game_id.split(':')[1].split('-')[0]
    (out / f'{name}.yaml').write_text(textwrap.dedent(f'''\
        name: gem_{name}
        max_turns: 6
        env:
          gem: {{id: '{game_id}', kwargs: {json.dumps(kwargs)}}}
        stop: {{on_length: false}}
        '''))
    (out / f'{name}.jsonl').write_text(''.join(json.dumps({'uuid': f's{s}', 'seed': s, 'messages': [
        {'role': 'system', 'content': 'Play the game.'}]}) + '\n' for s in SEEDS))
    (out / f'{name}_model.jsonl').write_text(''.join(json.dumps({'uuid': f's{s}', 'turn': k + 1, 'content': t}) + '\n'
                                                     for s in SEEDS for k, t in enumerate(scripts[s])))
    (out / f'{name}_run.yaml').write_text(textwrap.dedent(f'''\
        scheduler: {name}.yaml
        backend: scripted
        model: {name}_model.jsonl
        dataset: {name}.jsonl
        out: {name}_out
        batch_size: 5
        '''))
    code = main(['run', str(out / f'{name}_run.yaml'), '--no-progress'])
    lines = [json.loads(l) for l in (out / f'{name}_out' / 'trajectories.jsonl').read_text().splitlines()]
    return code, {t['uuid']: t for t in lines}


def main_(out):
    report = {}
    for game_id, kwargs in GAMES.items():
        scripts = {s: replies(game_id, kwargs, s) for s in SEEDS}
        code, runs = run_mtflow(out, game_id, kwargs, scripts)
        own = {f's{s}': gem_own(game_id, kwargs, s, scripts[s]) for s in SEEDS}
        report[game_id] = {
            'exit_code': code,
            'mtflow': {u: [t['rollout_infos'].get('rewards'), t['finish_reason']] for u, t in runs.items()},
            'gem': {u: [r, why] for u, (r, why) in own.items()},
            'opening': runs['s1']['messages'][1]['content'],
        }
    print(json.dumps(report))


if __name__ == '__main__':
    main_(Path(sys.argv[1]))
