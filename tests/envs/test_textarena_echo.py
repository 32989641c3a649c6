"""textarena games do not echo the player's own move back to it, whatever sender the game tags
the move with: TowerOfHanoi sends it as the game (``-1``), so filtering by sender alone showed
"I move [A C]" at the top of the next user message. One test per single-player game that runs
offline."""
from __future__ import annotations

import pytest

pytest.importorskip('textarena', reason="needs the 'textarena' extra")

from mtflow import Executor
from mtflow.declarative import load_scheduler
from tests.helpers import out, req

GAMES = ['TowerOfHanoi-v0-raw', 'Mastermind-v0-raw', 'GuessTheNumber-v0-raw', '2048-v0-raw', 'FifteenPuzzle-v0-raw',
         'FrozenLake-v0-raw', 'LightsOut-v0-raw', 'Minesweeper-v0-raw', 'Sokoban-v0-raw', 'Bandit-v0-raw',
         'Blackjack-v0-raw', 'PegJump-v0-raw', 'RushHour-v0-raw', 'Secretary-v0-raw', 'Sudoku-v0-raw']
MOVE = 'I move [A C] zq7'


@pytest.mark.parametrize('game', GAMES)
def test_the_players_move_is_not_echoed_in_the_next_message(game):
    sched = load_scheduler({'name': 'ta', 'max_turns': 2, 'env': {'textarena': {'id': game}}})
    try:
        reqs = [req('p', {'role': 'system', 'content': 'Play.'}, data_dict={'seed': 1})]
        result = Executor(sched, lambda rs, cfg: [out(MOVE) for _ in rs], max_turns=2, on_error='return').run(reqs)
    finally:
        sched.close()
    assert result.failures == []
    users = [m['content'] for m in reqs[0].messages if m['role'] == 'user']
    assert len(users) >= 2, f'{game}: no observation after the move'
    assert MOVE not in users[-1] and 'zq7' not in users[-1], f'{game} echoed the move: {users[-1][:200]!r}'
