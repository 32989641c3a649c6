"""Every leaf of a branched run on a real model (a tiny random Qwen2 and a BPE tokenizer) is an
exact-id trajectory: each passes the token checks of ``mtflow check-tokens``, and each equals,
field for field and sample for sample, an unbranched run of that leaf alone served the same
sampled tokens. ``mtflow run`` writes a branched run that ``mtflow replay`` repeats exactly."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

pytest.importorskip('transformers')

from mtflow import Executor, RequestConfig  # noqa: E402
from mtflow.backends.base import build_output  # noqa: E402
from mtflow.backends.conformance import check_tokens  # noqa: E402
from mtflow.backends.tokens import TokenPrompter, commit_outputs  # noqa: E402
from mtflow.cli import main  # noqa: E402
from mtflow.declarative import load_scheduler  # noqa: E402
from mtflow.run.turn_log import TurnLog  # noqa: E402
from mtflow.train import samples_from_output  # noqa: E402
from tests.helpers import dump, req  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GAME = {'max_turns': 4, 'env': {'impl': 'guess_number', 'kwargs': {'low': 1, 'high': 100, 'max_guesses': 6}},
        'system_prompt': 'Guess my number between 1 and 100.', 'stop': {'on_length': False}}
BRANCH = {'at': {'turn': 2}, 'copies': 3, 'leaves': 4}
CONFIG = RequestConfig(max_tokens=6, temperature=1.0, seed=3, logprobs=True)


@pytest.fixture(scope='module')
def tiny():
    from tests.tiny_model import make_model, make_tokenizer

    tok = make_tokenizer()
    return make_model(tok, seed=1), tok


def prompts(n: int = 3) -> List[Any]:
    return [req(f'g{i}', {'role': 'user', 'content': f'game {i}: your guess?'}) for i in range(n)]


def trajectory(output: Any) -> Dict[str, Any]:
    [d] = dump([output])
    d.pop('response')
    return d


class Served:
    """The recorded outputs of each uuid, served in order through an exact-id prompter (what the
    model would give for these sampled tokens)."""

    def __init__(self, turns: Dict[str, List[Dict[str, Any]]], tokenizer: Any) -> None:
        self.turns = turns
        self.prompter = TokenPrompter(tokenizer)
        self.calls: Dict[str, int] = {}

    def __call__(self, requests: List[Any], request_config: Any = None) -> List[Any]:
        outputs = []
        for request in requests:
            n = self.calls[request.uuid] = self.calls.get(request.uuid, 0) + 1
            turn = self.turns[request.uuid][n - 1]
            plan = self.prompter.plan(request)
            output = build_output(turn['text'], turn['token_ids'], turn['finish_reason'], logprobs=turn['logprobs'],
                                  prompt_tokens=len(plan.ids), prompt_token_ids=list(plan.ids))
            commit_outputs(self.prompter, [request], [plan], [output])
            outputs.append(output)
        return outputs


def test_every_leaf_equals_an_unbranched_run_of_it_alone(tiny):
    from mtflow.backends.hf import HFBackend

    model, tok = tiny
    log = TurnLog()
    requests = prompts()
    originals = {r.uuid: copy.deepcopy(r) for r in requests}
    branched = Executor(load_scheduler({**GAME, 'branch': BRANCH}, tokenizer=tok), log.wrap(HFBackend(model, tok)),
                        CONFIG).run(requests)
    assert branched.ok and len(requests) == 12 and all(len(t['leaves']) == 4 for t in branched.trees)
    turns = {uuid: list(notes) for uuid, notes in log._notes.items()}
    for request, output in zip(requests, branched.outputs):
        leaf = request.uuid
        alone_request = copy.deepcopy(originals[leaf.split('~')[0]])
        alone_request.uuid = leaf
        alone = Executor(load_scheduler(GAME, tokenizer=tok), Served(turns, tok), CONFIG).run([alone_request])
        assert alone.ok
        # every field of the trajectory (the last call's raw response, usage and token strings, is the
        # serving backend's, not the trajectory's)
        assert trajectory(alone.outputs[0]) == trajectory(output), leaf
        mine, theirs = samples_from_output(output, leaf), samples_from_output(alone.outputs[0], leaf)
        assert mine == theirs and mine[0].group == leaf.split('~')[0], leaf
        assert len(mine[0].completion_ids) > 0 and mine[0].logprobs is not None


def test_every_leaf_passes_the_token_checks(tiny):
    from mtflow.backends.hf import HFBackend

    model, tok = tiny
    report = check_tokens(HFBackend(model, tok), scheduler=load_scheduler({**GAME, 'branch': BRANCH}, tokenizer=tok),
                          requests=prompts(2), max_turns=4)
    assert report.ok, report.problems
    # 2 trees of 4 leaves; each leaf's every turn after its first was checked (3 transitions), or, for a
    # top-up copy of a prompt that ended early, as many as it had
    assert report.transitions >= 8 * 2 and report.passed['prefix'] == report.transitions


def test_a_branched_run_is_written_and_replayed_exactly(tiny, tmp_path, capsys):
    model, tok = tiny
    model.save_pretrained(tmp_path / 'model')
    tok.save_pretrained(tmp_path / 'model')
    scheduler = tmp_path / 'game.yaml'
    scheduler.write_text(json.dumps({**GAME, 'branch': BRANCH}))
    data = tmp_path / 'data.jsonl'
    data.write_text(''.join(json.dumps({'uuid': f'g{i}', 'messages': [{'role': 'user', 'content': f'game {i}'}]}) +
                            '\n' for i in range(3)))
    cfg = tmp_path / 'run.yaml'
    cfg.write_text(f'scheduler: {scheduler}\nbackend: hf\nmodel: {tmp_path / "model"}\ndataset: {data}\nmax_turns: 4\n'
                   'batch_size: 3\nseed: 0\nrequest_config: {max_tokens: 6, temperature: 1.0, logprobs: true}\n')
    assert main(['run', str(cfg), '-q', '--out', str(tmp_path / 'orig')]) == 0
    lines = [json.loads(line) for line in (tmp_path / 'orig' / 'trajectories.jsonl').read_text().splitlines()]
    trees = [json.loads(line) for line in (tmp_path / 'orig' / 'trees.jsonl').read_text().splitlines()]
    assert len(lines) == 12 and len(trees) == 3
    assert {line['uuid'] for line in lines} == {leaf for tree in trees for leaf in tree['leaves']}
    child = next(line for line in lines if line['uuid'] == 'g0~1')
    assert child['parent'] == 'g0' and child['group'] == 'g0' and child['turns'][0]['turn'] == 1
    assert main(['replay', str(tmp_path / 'orig'), '--out', str(tmp_path / 'again'), '-q']) == 0
    capsys.readouterr()
    assert main(['diff', str(tmp_path / 'orig'), str(tmp_path / 'again')]) == 0, capsys.readouterr().out
    again = json.loads((tmp_path / 'again' / 'run.json').read_text())['attempts'][-1]
    assert again['diverged'] == 0
    assert main(['check-tokens', '--model', str(tmp_path / 'model'), '--scheduler', str(scheduler), '--dataset',
                 str(data), '--limit', '2']) == 0
