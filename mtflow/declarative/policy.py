"""The finish-reason policy: what training sees of a trajectory, by how it ended.

RL users ask every framework for this: a reply cut by ``max_tokens`` should not be trained on
as if it were an answer, a request that hit ``max_turns`` may deserve reward 0, one that timed
out or failed is better dropped. In YAML::

    finish_policy:
      length: mask                  # every loss-mask value 0 (the tokens stay, nothing is trained)
      max_turns: {reward: 0.0}      # rollout_infos['reward'] = 0.0
      timeout: drop                 # rollout_infos['mtflow_drop'] = True (the trainer skips it)
      error: drop
      "stop_rule:*": keep           # any stop rule not named on its own
      "tool_error:timeout": {mask: true, reward: -1.0}   # a request that had a tool timeout
      default: keep                 # everything else (this is the default)

One rule applies per request, the first that matches in this order: its finish reason exactly,
``stop_rule:*`` for a stop rule, ``tool_error:<kind>`` for a kind of tool error the request had
(in file order), ``tool_error:*`` when it had any, ``default``. An action is ``keep``, ``mask``,
``drop``, or a mapping of ``mask``, ``drop`` and ``reward``.

:func:`apply_policy` is the one place it happens (the YAML scheduler calls it from the
executor's ``finalize_output`` hook, on every finish path); what it did is recorded in
``rollout_infos['mtflow_policy']`` (rule and action), which the trajectory file carries and
``mtflow run``'s summary counts.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple, Union

from pydantic import Field

from mtflow.core.keys import StrictModel
from mtflow.core.machine import FINISH_REASONS, STOP_RULE_PREFIX

#: kinds of tool error the YAML scheduler and its runner count (``rollout_infos['tool_error_kinds']``);
#: tools may add their own, so a policy may name any kind
TOOL_ERROR_KINDS = ('parse', 'too_many_calls', 'unknown_tool', 'bad_arguments', 'timeout', 'exception')
TOOL_ERROR_PREFIX = 'tool_error:'
DROP_KEY = 'mtflow_drop'
INFO_KEY = 'mtflow_policy'


class PolicyAction(StrictModel):
    """What to do with a trajectory: any of mask, drop and a reward."""
    mask: bool = Field(False, description='Set every loss-mask value to 0 (the tokens stay; nothing is trained).')
    drop: bool = Field(False, description="Set rollout_infos['mtflow_drop'] = True, for the trainer to skip it.")
    reward: Optional[float] = Field(None, description="Set rollout_infos['reward'] to this value.")

    @classmethod
    def named(cls, name: str) -> 'PolicyAction':
        return {'keep': cls(), 'mask': cls(mask=True), 'drop': cls(drop=True)}[name]

    def describe(self) -> str:
        parts = (['mask'] if self.mask else []) + (['drop'] if self.drop else []) + (
            [f'reward={self.reward:g}'] if self.reward is not None else [])
        return '+'.join(parts) or 'keep'


ActionSpec = Union[str, PolicyAction]


def check_key(key: str) -> Optional[str]:
    """The problem with a policy key, or None."""
    if key == 'default' or key in FINISH_REASONS or key == STOP_RULE_PREFIX + '*':
        return None
    if key.startswith(STOP_RULE_PREFIX) and len(key) > len(STOP_RULE_PREFIX):
        return None  # the loader checks the name against the file's stop rules
    if key.startswith(TOOL_ERROR_PREFIX):
        kind = key[len(TOOL_ERROR_PREFIX):]
        if kind == '*' or re.fullmatch(r'[A-Za-z_][\w.-]*', kind):
            return None  # tools may raise kinds of their own (the sandbox: memory, exit, killed, refused)
        return f'tool error kind {kind!r} is not a name (built-in kinds: {", ".join(TOOL_ERROR_KINDS)}, or *)'
    return (f'unknown finish reason {key!r} (known: {", ".join(FINISH_REASONS)}, stop_rule:<name>, stop_rule:*, '
            f'tool_error:<kind>, tool_error:*, default)')


class FinishPolicy:
    """``finish reason pattern -> action`` (the YAML's ``finish_policy``, validated by the schema)."""

    def __init__(self, rules: Dict[str, ActionSpec]) -> None:
        self.rules: Dict[str, PolicyAction] = {}
        for key, action in rules.items():
            problem = check_key(key)
            if problem:
                raise ValueError(f'finish_policy.{key}: {problem}')
            if isinstance(action, dict):
                action = PolicyAction(**action)
            self.rules[key] = PolicyAction.named(action) if isinstance(action, str) else action

    def rule_for(self, finish_reason: str, tool_error_kinds: Dict[str, int]) -> Tuple[str, PolicyAction]:
        """``(rule key, action)`` that applies (``('default', keep)`` when none is written)."""
        rules = self.rules
        if finish_reason in rules:
            return finish_reason, rules[finish_reason]
        star = STOP_RULE_PREFIX + '*'
        if finish_reason.startswith(STOP_RULE_PREFIX) and star in rules:
            return star, rules[star]
        had = {k for k, n in (tool_error_kinds or {}).items() if n}
        for key, action in rules.items():
            if key.startswith(TOOL_ERROR_PREFIX) and key[len(TOOL_ERROR_PREFIX):] in had:
                return key, action
        if had and TOOL_ERROR_PREFIX + '*' in rules:
            return TOOL_ERROR_PREFIX + '*', rules[TOOL_ERROR_PREFIX + '*']
        return 'default', rules.get('default', PolicyAction())


def apply_policy(policy: FinishPolicy, output: Any, finish_reason: str) -> Any:
    """Apply the policy to one finished request's output (a ``RolloutOutput``), in place, and
    return it. The record in ``rollout_infos['mtflow_policy']``: ``rule``, ``action`` and, when
    the reward was replaced, ``previous_reward``."""
    infos: Dict[str, Any] = output.rollout_infos if output.rollout_infos is not None else {}
    rule, action = policy.rule_for(finish_reason or '', infos.get('tool_error_kinds') or {})
    record: Dict[str, Any] = {'rule': rule, 'action': action.describe(), 'finish_reason': finish_reason}
    if action.mask:
        ids: List[List[int]] = output.response_token_ids or []
        mask = output.response_loss_mask or []
        output.response_loss_mask = [[0] * len(seg) for seg in (mask or ids)]
        # logprobs pair with trained (mask-1) tokens; with none left, none may remain
        output.rollout_logprobs = []
    if action.drop:
        infos[DROP_KEY] = True
    if action.reward is not None:
        if 'reward' in infos:
            record['previous_reward'] = infos['reward']
        infos['reward'] = float(action.reward)
    infos[INFO_KEY] = record
    output.rollout_infos = infos
    return output


class PolicyTally:
    """Counts what a finish policy did, one finished request at a time (constant memory, so a
    streaming run can keep it for the whole run)."""

    def __init__(self) -> None:
        self.counts: Dict[str, int] = {}
        self.dropped = 0

    def add(self, info: Optional[Dict[str, Any]]) -> None:
        record = (info or {}).get(INFO_KEY)
        if isinstance(record, dict):
            key = f"{record.get('rule')} -> {record.get('action')}"
            self.counts[key] = self.counts.get(key, 0) + 1
        self.dropped += bool((info or {}).get(DROP_KEY))

    def summary(self) -> Dict[str, Any]:
        """``{'rule -> action': count, ..., 'dropped': n}``; ``{}`` when no request went through a
        policy."""
        if not self.counts:
            return {}
        return {**dict(sorted(self.counts.items())), 'dropped': self.dropped}


def summarize_policy(infos: List[Dict[str, Any]]) -> Dict[str, Any]:
    """:meth:`PolicyTally.summary` over finished requests' ``rollout_infos`` (what ``mtflow run``
    writes to summary.json)."""
    tally = PolicyTally()
    for info in infos:
        tally.add(info)
    return tally.summary()


__all__ = ['FinishPolicy', 'PolicyTally', 'summarize_policy', 'PolicyAction', 'apply_policy', 'TOOL_ERROR_KINDS', 'DROP_KEY', 'INFO_KEY', 'check_key']
