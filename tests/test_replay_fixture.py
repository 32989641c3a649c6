"""The ``mtflow_replay`` pytest fixture on the run committed under ``tests/data/replay_example``
(the example of ``docs/replay.md``): the environment as it is replays identically (live and with
``--tools recorded``); a changed environment fails the test with the diff naming exactly the
requests whose observations changed."""
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent / 'data' / 'replay_example'
RUN, CONFIG = EXAMPLE / 'run', EXAMPLE / 'config.yaml'


# -- the regression test of docs/replay.md ------------------------------------------------------
def test_hot_cold_env_still_answers_as_recorded(mtflow_replay):
    totals = mtflow_replay(RUN, CONFIG)
    assert totals['identical'] == 6 and totals['different'] == 0


def test_the_committed_run_finds_its_config_wherever_the_tree_is(mtflow_replay, tmp_path):
    """run.json names the config relative to the run directory too (``config_file_from_run``):
    the example moved elsewhere replays against its own config with none given, although the
    absolute ``config_file`` it recorded is another machine's (here: made to be missing)."""
    import json
    import shutil
    moved = tmp_path / 'elsewhere' / 'replay_example'
    shutil.copytree(EXAMPLE, moved)
    info_path = moved / 'run' / 'run.json'
    info = json.loads(info_path.read_text())
    assert info['config_file_from_run'] == '../config.yaml'
    info['config_file'] = str(tmp_path / 'another-machine' / 'config.yaml')
    info_path.write_text(json.dumps(info))
    assert mtflow_replay(moved / 'run')['identical'] == 6
    assert mtflow_replay(moved / 'run', tools='recorded')['identical'] == 6


def test_the_recorded_tools_and_env_give_the_same_rewards(mtflow_replay):
    assert mtflow_replay(RUN, CONFIG, tools='recorded')['identical'] == 6


def _changed_config(tmp_path: Path, close_within: int) -> Path:
    (tmp_path / 'scheduler.yaml').write_text((EXAMPLE / 'scheduler.yaml').read_text().replace(
        'close_within: 3', f'close_within: {close_within}'))
    (tmp_path / 'hot_cold.py').write_text((EXAMPLE / 'hot_cold.py').read_text())
    cfg = (CONFIG.read_text().replace('model: script.jsonl', f'model: {EXAMPLE / "script.jsonl"}')
           .replace('dataset: prompts.jsonl', f'dataset: {EXAMPLE / "prompts.jsonl"}'))
    (tmp_path / 'config.yaml').write_text(cfg)
    return tmp_path / 'config.yaml'


def test_a_changed_environment_fails_with_the_diff(mtflow_replay, tmp_path):
    # "Very close." now only within 1: hc-1 (15 vs 12), hc-2 (37 vs 40) and hc-5 (20 vs 18, 17 vs
    # 18) hear another hint at turn 2; hc-3 (30 vs 31) and hc-4 (6 vs 7) are still "very close"
    with pytest.raises(AssertionError) as failed:
        mtflow_replay(RUN, _changed_config(tmp_path, 1))
    text = str(failed.value)
    assert 'identical 3, different 3' in text
    for uuid in ('hc-1', 'hc-2', 'hc-5'):
        assert f'{uuid}: turn 2: observation' in text
    for uuid in ('hc-0', 'hc-3', 'hc-4'):
        assert f'{uuid}:' not in text
    # the fields compared can be narrowed: the rewards are the same where the episodes still ran
    with pytest.raises(AssertionError, match='final_reward'):
        mtflow_replay(RUN, _changed_config(tmp_path, 1), fields=['final_reward'])


def test_a_broken_config_fails_with_the_error(mtflow_replay, tmp_path):
    with pytest.raises(AssertionError, match='config file not found'):
        mtflow_replay(RUN, tmp_path / 'missing.yaml')
