"""``mtflow run`` of episode files (docs/multi-agent.md): the tau-bench-style episode (a user
simulator, a tool-using assistant and a judge, each its own backend), every problem of an episode
file or of a run config's ``policies:``/``roles:`` as one line with its file, line and field, and
``--resume`` of whole episodes."""
from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from mtflow.cli import main
from mtflow.run.token_check import check_run_tokens
from mtflow.run.trajectories import read_trajectories
from mtflow.viewer.episodes import episode_lines, episode_rows

ROOT = Path(__file__).resolve().parents[2]


def _error(argv, capsys) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err.strip()


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ('tau_retail.yaml', 'tau_assistant.yaml', 'tau_retail.py', 'textarena_tictactoe.yaml'):
        shutil.copy(ROOT / 'schedulers' / 'episodes' / name, tmp_path / name)
    shutil.copy(ROOT / 'configs' / 'tau_tasks.jsonl', tmp_path / 'tau_tasks.jsonl')
    (tmp_path / 'run.yaml').write_text(textwrap.dedent('''\
        scheduler: tau_retail.yaml
        backend: scripted
        backend_options: {respond: 'tau_retail:assistant', tokenizer: embedded}
        policies:
          user_sim: {backend: scripted, backend_options: {respond: 'tau_retail:customer'}}
          judge: {backend: scripted, backend_options: {respond: 'tau_retail:judge'}}
        dataset: tau_tasks.jsonl
        out: out
        max_turns: 12
        '''))
    return tmp_path


def test_a_tau_bench_style_episode_end_to_end(project, capsys):
    pytest.importorskip('transformers')
    assert main(['run', 'run.yaml', '-q']) == 0
    lines = read_trajectories(project / 'out' / 'trajectories.jsonl')
    assert sorted(lines) == sorted(f'refund-{n}/{r}' for n in (1042, 2077) for r in ('assistant', 'user', 'judge'))
    assistant, user, judge = (lines[f'refund-1042/{r}'].to_dict() for r in ('assistant', 'user', 'judge'))
    # the outcome (the right order refunded, through the assistant's own tools) plus the judge's 9/10
    assert assistant['reward'] == pytest.approx(1.9)
    assert [m['role'] for m in assistant['messages']].count('tool') == 2
    episode = assistant['rollout_infos']['episode']
    assert [r['role'] for r in episode['roles']] == ['assistant', 'user', 'judge']
    assert [s['acted'] for s in episode['steps']][:2] == [['user'], ['assistant']]
    assert episode['info']['judge'] == {'score': 0.9, 'judged': ['assistant']}
    # the simulator's own record: its persona, its turns, not trained
    assert user['messages'][0]['role'] == 'system' and 'customer' in user['messages'][0]['content']
    assert user['messages'][-1]['content'].endswith('###STOP###')
    assert user['rollout_infos']['episode']['train'] is False and judge['messages'][-1]['content'] == 'Score: 9'
    # the trained role's trajectory is exact; the untrained ones are not checked
    report = check_run_tokens(project / 'out' / 'trajectories.jsonl')
    assert report.ok and report.lines == 2 and report.untrained == 4
    summary = json.loads((project / 'out' / 'summary.json').read_text())
    assert summary['written'] == 6 and summary['finish_reasons'] == {'episode_done': 6}


def test_until_and_resume_write_whole_episodes(project, capsys):
    assert main(['run', 'run.yaml', '-q', '--until', 'groups=1']) == 0  # streamed: one prompt's episodes
    first = read_trajectories(project / 'out' / 'trajectories.jsonl')
    assert len(first) == 3 and len({u.split('/')[0] for u in first}) == 1
    assert main(['run', 'run.yaml', '-q', '--resume']) == 0
    lines = read_trajectories(project / 'out' / 'trajectories.jsonl')
    assert len(lines) == 6 and all(t.finish_reason == 'episode_done' for t in lines.values())


def test_an_unknown_policy_id_is_refused_at_load(project, capsys):
    config = (project / 'run.yaml').read_text()
    (project / 'bad.yaml').write_text(config + 'roles:\n  user: {policy: nobody}\n')
    err = _error(['run', 'bad.yaml'], capsys)
    assert "bad.yaml:11: roles.user.policy: unknown policy id 'nobody'" in err
    (project / 'bad.yaml').write_text(config.replace('  judge: {backend', '  judges: {backend'))
    err = _error(['run', 'bad.yaml'], capsys)
    assert "tau_retail.yaml:15: roles[2].policy: unknown policy id 'judge'" in err
    assert not (project / 'out').exists()


def test_run_config_roles_and_policies_are_checked(project, capsys):
    config = (project / 'run.yaml').read_text()
    (project / 'bad.yaml').write_text(config + 'roles:\n  customer: {train: true}\n')
    assert "bad.yaml:11: roles.customer: " in _error(['run', 'bad.yaml'], capsys)
    (project / 'bad.yaml').write_text(config.replace('policies:', 'policies:\n  default: {backend: scripted}'))
    assert "policies: 'default' is the run's own backend" in _error(['run', 'bad.yaml'], capsys)


def test_a_policy_no_role_plays_is_refused(project, capsys):
    """A ``policies:`` entry no role plays was never built: the run went on with every role on its
    other policies (a two-policy game without its ``roles:`` played by one policy), exit 0."""
    config = (project / 'run.yaml').read_text()
    (project / 'bad.yaml').write_text(config.replace('policies:', 'policies:\n  b: {backend: scripted}'))
    err = _error(['run', 'bad.yaml'], capsys)
    assert "bad.yaml:5: policies.b: no role plays policy 'b' (the roles play: assistant: default, user: user_sim, " in err
    assert not (project / 'out').exists()
    (project / 'bad.yaml').write_text(config.replace('policies:', 'policies:\n  b: {backend: scripted}')
                                      + 'roles:\n  judge: {policy: b}\n')
    assert "policies.judge: no role plays policy 'judge'" in _error(['run', 'bad.yaml'], capsys)


def test_a_task_without_the_field_its_reward_reads_fails_by_name(project, capsys):
    """The example's reward read ``order_id`` with ``.get``: a task row without it scored every
    assistant 0 for its outcome (the refund never matched ``#None``), complete, exit 0."""
    rows = [json.loads(line) for line in (project / 'tau_tasks.jsonl').read_text().splitlines()]
    (project / 'tau_tasks.jsonl').write_text(''.join(json.dumps({k: v for k, v in row.items() if k != 'order_id'}) + '\n'
                                                     for row in rows))
    assert main(['run', 'run.yaml', '-q']) == 1
    failures = [line['rollout_infos']['mtflow_error'] for line in map(json.loads, open(project / 'out' / 'trajectories.jsonl'))]
    assert len(failures) == 6 and {(f['type'], f['message']) for f in failures} == {('KeyError', "'order_id'")}


def test_a_judge_judging_itself_is_refused_naming_the_roles_it_can_score(project, capsys):
    """The refusal listed the judge among the roles it could score."""
    path = project / 'tau_retail.yaml'
    path.write_text(path.read_text().replace('judges: [assistant]', 'judges: [judge]'))
    assert main(['validate', 'tau_retail.yaml']) == 1
    assert "judge.judges: ['judge'] are not roles the judge can score (the roles but the judge itself: assistant, " \
           "user)" in capsys.readouterr().out


def test_a_run_configs_role_sampling_mistake_is_named_at_its_own_line(project, capsys):
    """It was reported at the episode file's role (tau_retail.yaml:9), which has no sampling."""
    config = (project / 'run.yaml').read_text()
    (project / 'bad.yaml').write_text(config + 'roles:\n  user: {sampling: {temprature: 1.0}}\n')
    err = _error(['run', 'bad.yaml'], capsys)
    assert "bad.yaml:11: roles.user: role 'user': sampling: unknown key 'temprature'; did you mean 'temperature'?" in err
    assert 'tau_retail.yaml' not in err


def test_episode_file_problems_name_file_line_and_field(project, capsys):
    (project / 'game.yaml').write_text(textwrap.dedent('''\
        roles:
          - {name: player, seats: 2, seat: 0}
          - {name: judge, polcy: j}
        env:
          textarena: {id: TicTacToe-v0-raw}
          impl: my:Game
        max_step: 3
        '''))
    assert main(['validate', 'game.yaml']) == 1
    out = capsys.readouterr().out
    assert 'game.yaml:2: roles[0]: give seat (one seat) or seats' in out
    assert "game.yaml:3: roles[1].polcy: unknown key 'polcy'; did you mean 'policy'?" in out
    assert 'game.yaml:4: env: give exactly one of textarena, conversation, impl (got textarena, impl)' in out
    assert "game.yaml:7: max_step: unknown key 'max_step'; did you mean 'max_steps'?" in out
    (project / 'game.yaml').write_text('roles:\n  - {name: player, seats: 2}\nenv:\n  textarena: {id: NoSuchGame-v0}\n')
    assert main(['validate', 'game.yaml']) == 1
    assert "game.yaml:3: env: EpisodeEnvError: textarena: cannot make 'NoSuchGame-v0'" in capsys.readouterr().out
    (project / 'game.yaml').write_text('roles:\n  - {name: a}\nenv:\n  conversation: {}\njudge: {role: judge}\n')
    assert main(['validate', 'game.yaml']) == 1
    assert "game.yaml:5: judge: judge.role: 'judge' is not one of the roles (a)" in capsys.readouterr().out


def test_replay_diff_and_the_viewer_per_episode(project, capsys):
    pytest.importorskip('transformers')
    assert main(['run', 'run.yaml', '-q']) == 0
    assert main(['replay', 'out', '--out', 'again', '-q']) == 0  # each policy's recorded outputs served again
    capsys.readouterr()
    assert main(['diff', 'out', 'again']) == 0
    assert 'episodes: identical 2, different 0' in capsys.readouterr().out
    lines = [json.loads(line) for line in (project / 'again' / 'trajectories.jsonl').read_text().splitlines()]
    for line in lines:  # a changed assistant reply: its episode differs, by that role
        if line['uuid'] == 'refund-2077/assistant':
            line['messages'][-1]['content'] = 'Sorry, no refunds today.'
    (project / 'again' / 'trajectories.jsonl').write_text(''.join(json.dumps(line) + '\n' for line in lines))
    assert main(['diff', 'out', 'again']) == 1
    out = capsys.readouterr().out
    assert 'episodes: identical 1, different 1' in out and 'episode refund-2077: roles assistant differ' in out
    assert main(['trace', 'show', 'out/trace.jsonl', '--trajectories', 'out/trajectories.jsonl', '--episode',
                 'refund-1042', '--width', '160']) == 0
    shown = capsys.readouterr().out
    assert 'episode refund-1042: assistant (default): episode_done, reward 1.9' in shown and 'Score: 9' in shown
    rows = episode_rows(episode_lines(read_trajectories(project / 'out' / 'trajectories.jsonl'), 'refund-1042'))
    assert [(r.step, r.role, r.turn) for r in rows] == [  # the roles' turns interleaved as the episode went
        (1, 'user', 1), (2, 'assistant', 1), (3, 'user', 2), (None, 'assistant', 2), (None, 'assistant', 3),
        (4, 'assistant', 4), (5, 'user', 3), (6, 'judge', 1)]
    assert rows[3].text.startswith('<tool_call>') and rows[3].observation == ['Order #1042: blue kettle, $30, delivered.']
    assert "no episode 'x'" in _error(['trace', 'show', 'out/trace.jsonl', '--trajectories', 'out/trajectories.jsonl',
                                        '--episode', 'x'], capsys)
