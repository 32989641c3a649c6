"""``mtflow replay`` and ``mtflow diff`` end to end on the scripted guess-the-number run: the record
each line carries (``turns``), a replay against the unchanged config that ``diff`` calls
identical, a changed environment that diverges exactly the requests whose observations changed
(at the turn after the change), ``--continue-with`` going on live, and ``diff``'s exit codes,
``--json`` and ``--fields``."""
import json
from pathlib import Path

import pytest

from mtflow.cli import main
from mtflow.run.turn_log import expand_turns

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / 'configs' / 'scripted_guesses.jsonl'
PROMPTS = ROOT / 'mtflow' / 'data' / 'prompts.jsonl'


def _config(tmp: Path, name: str, dataset: Path) -> Path:
    path = tmp / f'{name}.yaml'
    path.write_text(f'scheduler: {ROOT / "schedulers" / "guess_number.yaml"}\nbackend: scripted\nmodel: {SCRIPT}\n'
                    f'backend_options: {{cycle: true}}\nmax_turns: 6\nbatch_size: 5\ndataset: {dataset}\n'
                    f'request_config: {{logprobs: true}}\n')
    return path


def _lines(run: Path):
    return [json.loads(line) for line in (run / 'trajectories.jsonl').read_text().splitlines()]


@pytest.fixture(scope='module')
def recorded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('replay')
    cfg = _config(tmp, 'orig', PROMPTS)
    assert main(['run', str(cfg), '-q', '--out', str(tmp / 'orig')]) == 0
    return tmp, cfg, tmp / 'orig'


def test_every_line_records_each_model_call_without_a_second_copy(recorded):
    _, cfg, run = recorded
    info = json.loads((run / 'run.json').read_text())
    assert info['replay_format'] == 1 and info['config_file'] == str(cfg.resolve())
    assert (run / info['config_file_from_run']).resolve() == cfg.resolve()
    script = [json.loads(line) for line in SCRIPT.read_text().splitlines()]
    by_text = {s['content']: s for s in script}
    for line in _lines(run):
        turns = line['turns']
        assert len(turns) == line['num_turns']
        # the line already holds text, ids and logprobs: the entries point at them
        assert all('msg' in t and 'at' in t and 'text' not in t and 'token_ids' not in t for t in turns)
        for t in expand_turns(line):
            s = by_text[t['text']]
            assert (t['token_ids'], t['logprobs'], t['finish_reason']) == (s['token_ids'], s['logprobs'], 'stop')
            assert len(t['prompt']) == 16
        assert len({t['prompt'] for t in turns}) == len(turns)  # every turn answered a longer prompt


def test_replay_against_the_unchanged_config_is_identical(recorded, capsys):
    tmp, _, run = recorded
    assert main(['replay', str(run), '--out', str(tmp / 'same'), '-q']) == 0
    capsys.readouterr()
    assert main(['diff', str(run), str(tmp / 'same')]) == 0
    assert 'identical 16, different 0, only in A 0, only in B 0' in capsys.readouterr().out
    summary = json.loads((tmp / 'same' / 'run.json').read_text())['attempts'][-1]
    assert summary['replayed_outputs'] == sum(len(l['turns']) for l in _lines(run)) and summary['diverged'] == 0


def test_each_prompt_digest_is_computed_once_per_model_call(recorded, capsys, monkeypatch):
    """The replay backend compares the prompt's digest; the turn log notes the same digest
    (``ReplayBackend.known_digest``) instead of computing it a second time."""
    import mtflow.run.replay as replay_module
    import mtflow.run.turn_log as turn_log_module
    calls = []
    real = turn_log_module.prompt_digest

    def counted(messages):
        calls.append(1)
        return real(messages)

    monkeypatch.setattr(replay_module, 'prompt_digest', counted)
    monkeypatch.setattr(turn_log_module, 'prompt_digest', counted)
    tmp, _, run = recorded
    assert main(['replay', str(run), '--out', str(tmp / 'once'), '-q']) == 0
    capsys.readouterr()
    assert main(['diff', str(run), str(tmp / 'once')]) == 0
    assert len(calls) == sum(len(l['turns']) for l in _lines(run))


def _changed_targets(tmp: Path, changes: dict) -> Path:
    lines = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    for line in lines:
        if line['uuid'] in changes:
            line['data_dict']['target'] = changes[line['uuid']]
    path = tmp / 'changed.jsonl'
    path.write_text(''.join(json.dumps(line) + '\n' for line in lines))
    return path


def _first_changed_observation(line: dict, target: int) -> int:
    """The turn whose observation a new target changes (guess-the-number's rule), 0 if none."""
    guesses = [int(m['content'].rstrip('.').split()[-1]) for m in line['messages'] if m['role'] == 'assistant']
    for k, guess in enumerate(guesses[:-1], 1):
        old = line['messages'][2 * k + 1]['content'].split('.')[0]  # '25 is too high'
        new = 'high' if guess > target else 'low' if guess < target else 'correct'
        if new not in old:
            return k
    return 0


def test_a_changed_environment_diverges_exactly_the_changed_requests(recorded, capsys):
    tmp, _, run = recorded
    changes = {'guess-01': 7, 'guess-05': 99, 'guess-09': 1000}
    original = {l['uuid']: l for l in _lines(run)}
    expected = {u: _first_changed_observation(original[u], t) for u, t in changes.items()}
    expected = {u: k for u, k in expected.items() if k}
    assert len(expected) >= 2
    cfg = _config(tmp, 'changed', _changed_targets(tmp, changes))
    assert main(['replay', str(run), str(cfg), '--out', str(tmp / 'changed'), '-q']) == 0
    replayed = {l['uuid']: l for l in _lines(tmp / 'changed')}
    diverged = {u: l['num_turns'] for u, l in replayed.items() if l['finish_reason'] == 'replay_diverged'}
    assert diverged == {u: k + 1 for u, k in expected.items()}  # at the turn whose prompt changed
    events = [json.loads(e) for e in (tmp / 'changed' / 'trace.jsonl').read_text().splitlines()]
    ends = {e['uuid']: e['turn'] for e in events if e['reason'] == 'replay_diverged'}
    assert ends == diverged
    capsys.readouterr()
    assert main(['diff', str(run), str(tmp / 'changed'), '--json']) == 1
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    totals = out[-1]['totals']
    # a new target is another reference: those requests are counted apart, their first differing turn beside it
    assert totals['different_input'] == len(changes) and totals['different'] == 0
    assert totals['identical'] == 16 - len(changes)
    named = {d['uuid']: d for d in out[:-1]}
    assert set(named) == set(changes) and all(d['fields'] == ['reference'] for d in named.values())
    assert {u: d['then']['turn'] for u, d in named.items() if 'then' in d} == expected
    assert all(named[u]['then']['fields'] == ['observation'] for u in expected)


def test_continue_with_goes_on_live_from_the_diverged_turn(recorded):
    tmp, _, run = recorded
    line = next(l for l in _lines(run) if l['uuid'] == 'guess-01')
    first_guess = int(line['messages'][2]['content'].rstrip('.').split()[-1])
    flipped = first_guess + 1 if 'high' in line['messages'][3]['content'].split('.')[0] else first_guess - 1
    cfg = _config(tmp, 'live', _changed_targets(tmp, {'guess-01': flipped}))  # turn 1's observation flips
    assert main(['replay', str(run), str(cfg), '--out', str(tmp / 'live'), '-q', '--continue-with', 'scripted',
                 '--model', str(SCRIPT), '-o', 'cycle=true']) == 0
    lines = {l['uuid']: l for l in _lines(tmp / 'live')}
    assert not any(l['finish_reason'] == 'replay_diverged' for l in lines.values())
    info = json.loads((tmp / 'live' / 'run.json').read_text())['attempts'][-1]
    live = lines['guess-01']
    assert info['diverged'] == 1 and info['live_outputs'] == live['num_turns'] - 1  # turns 2.. came live
    assert live['messages'][:4] != line['messages'][:4] and live['messages'][:3] == line['messages'][:3]


def test_diff_fields_and_only_in(recorded, tmp_path, capsys):
    _, _, run = recorded
    lines = _lines(run)
    lines[2]['response_token_ids'][1][2] = 7
    lines[3]['rollout_infos']['reward'] = lines[3]['reward'] = 1.0
    (tmp_path / 'trajectories.jsonl').write_text(''.join(json.dumps(l) + '\n' for l in lines[:-1]))
    assert main(['diff', str(run), str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f'{lines[2]["uuid"]}: turn 2: token_ids differ at position 2' in out
    assert f'{lines[3]["uuid"]}: turn {lines[3]["num_turns"]}: final_reward: 0.0 vs 1.0' in out
    assert f'{lines[-1]["uuid"]}: only in A' in out
    assert 'identical 13, different 2, only in A 1, only in B 0' in out
    assert f'group {lines[3]["uuid"]}: mean reward 0 -> 1 (+1)' in out and 'group guess-15' not in out
    assert main(['diff', str(run), str(tmp_path), '--fields', 'text', 'observation']) == 1  # still one only in A
    assert 'identical 15, different 0, only in A 1' in capsys.readouterr().out
    assert main(['diff', str(run), str(tmp_path), '--fields', 'nonsense']) == 2
    assert 'unknown field' in capsys.readouterr().err


def test_logprobs_that_differ_in_their_last_digits_are_the_same(recorded, tmp_path, capsys):
    """The same model in a batch of another shape rounds its logprobs otherwise (~1e-6 on CPU: the
    default job at --batch-size 4 against 16); ids, masks and larger logprob changes still differ."""
    _, _, run = recorded
    lines = _lines(run)
    for line in lines[:3]:
        line['rollout_logprobs'] = [[p + 5e-6 for p in turn] for turn in line['rollout_logprobs']]
    lines[3]['rollout_logprobs'][0][0] += 0.01
    (tmp_path / 'trajectories.jsonl').write_text(''.join(json.dumps(l) + '\n' for l in lines))
    assert main(['diff', str(run), str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f'{lines[3]["uuid"]}: turn {lines[3]["num_turns"]}: trained:' in out
    assert 'identical 15, different 1, only in A 0, only in B 0' in out
    assert main(['diff', str(run), str(tmp_path), '--logprob-tol', '0']) == 1
    assert 'identical 12, different 4' in capsys.readouterr().out


def test_config_after_out_as_the_synopsis_writes_it(recorded, capsys):
    """``mtflow replay RUN_DIR --out NEW_DIR [CONFIG]`` (docs/cli.md, docs/replay.md) and the same for
    rescore: argparse's ``parse_args`` refused the CONFIG after ``--out`` (``unrecognized
    arguments``); the commands read their arguments intermixed."""
    tmp, cfg, run = recorded
    assert main(['replay', str(run), '--out', str(tmp / 'after'), str(cfg), '-q']) == 0
    assert main(['replay', str(run), str(cfg), '--out', str(tmp / 'before'), '-q']) == 0
    assert main(['rescore', str(run), '--out', str(tmp / 'rescored'), str(cfg), '-q']) == 0
    capsys.readouterr()
    assert main(['diff', str(tmp / 'after'), str(tmp / 'before')]) == 0
    assert json.loads((tmp / 'rescored' / 'run.json').read_text())['rescore']['config'] == str(cfg)
    with pytest.raises(SystemExit):
        main(['replay', str(run), '--out', str(tmp / 'x'), str(cfg), 'extra'])
    assert 'mtflow replay: error: unrecognized arguments: extra' in capsys.readouterr().err


def test_an_out_that_is_holds_or_is_inside_the_recorded_run_is_refused_before_anything_moves(recorded, capsys):
    """``mtflow replay RUN --out RUN --overwrite`` moved the record aside before reading it, and
    every request "diverged" (issue 47, item 4); the same --out through a symlink, the directory
    that holds the run, or a directory inside it, are refused too, before anything is opened."""
    tmp, _, run = recorded
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    link = tmp / 'link-to-orig'
    link.symlink_to(run)
    capsys.readouterr()
    for out, how in ((run, 'is the run it reads'), (link, 'is the run it reads'),
                     (tmp, f'holds the run it reads ({run})'), (run / 'again', f'is inside the run it reads ({run})')):
        for command in ('replay', 'rescore'):
            overwrite = ['--overwrite'] if command == 'replay' else []  # rescore has none
            assert main([command, str(run), '--out', str(out), '-q', *overwrite]) == 2
            err = capsys.readouterr().err.strip()
            moves = ', and --overwrite would move the record away before reading it' if overwrite else ''
            assert err == (f'mtflow: --out {out} {how}: {command} writes a new run directory apart from the recorded '
                           f'one{moves}; choose an --out outside {run}'), err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    assert not (run / 'again').exists() and not list(tmp.glob('orig.old-*')) and not list(tmp.glob('*.old-*'))
