"""What TRL's own tool loop cannot run of an mtflow scheduler, found before training starts.

In TRL 1.16's loop (``GRPOTrainer(environment_factory=...)`` without ``rollout_func``) the trainer
generates, parses the calls with the chat template's response parser, calls the environment's
methods, appends each result as a ``tool`` message and generates again, until a reply calls no
tool, ``max_tool_calling_iterations`` rounds ran or ``max_completion_length`` is reached; then
``get_reward()`` scores the rollout. An environment sees its ``reset(**row)`` and its tool calls,
never the model's text, and cannot end, continue or fork an episode. So every scheduler feature
that needs one of those is named here, with why, and :func:`problems` lists them all: a
scheduler refused is never run with a feature silently dropped.
"""
from __future__ import annotations

import string
from typing import Any, List, Optional

from mtflow.core.scheduler import HOOK_ARGS
from mtflow.declarative.scheduler import YamlScheduler
from mtflow.declarative.schema import ObservationConfig, SchedulerConfig, StopConfig

__all__ = ['problems', 'turn_bound', 'TRL_METHODS']

#: the environment's own methods in TRL's loop (never tools), and what a tool cannot be named
TRL_METHODS = ('reset', 'get_reward')
#: a YamlScheduler method that, overridden, would act where TRL's loop never calls it
_PER_TURN = tuple(HOOK_ARGS) + ('prepare', )
_NO_TEXT = 'TRL hands an environment its tool calls, never the reply'
_ENDS = 'a TRL environment cannot end an episode'


def problems(scheduler: Any, args: Any = None) -> List[str]:
    """Every feature of ``scheduler`` that TRL's own tool loop cannot run (with ``args``, the
    trainer's ``GRPOConfig``: :func:`turn_bound`), one phrase each; empty: it can be a TRL
    environment."""
    if not isinstance(scheduler, YamlScheduler):
        name = type(scheduler).__name__
        return [f'{name}.step: a Python scheduler acts on every reply, and TRL\'s loop calls an environment only '
                'through its tools (a YamlScheduler, or a subclass that keeps its per-turn hooks, can be one)']
    found = [f'{type(scheduler).__name__}.{hook}: overrides a per-turn hook, which TRL\'s loop never calls'
             for hook in _PER_TURN if _overridden(scheduler, hook)]
    bound = turn_bound(scheduler.max_turns, args)
    return found + _config_problems(scheduler.config, scheduler) + ([bound] if bound else [])


def turn_bound(max_turns: Optional[int], args: Any) -> Optional[str]:
    """What is wrong between the scheduler's ``max_turns`` and the trainer's config ``args`` (a
    ``GRPOConfig``), or ``None``: in TRL's loop the trainer ends an episode after
    ``max_tool_calling_iterations`` rounds of tool calls, so ``max_turns`` turns are
    ``max_turns - 1`` rounds (a config without a bound takes this one)."""
    if max_turns is None:
        return None
    rounds = max_turns - 1
    if args is None:
        return (f'max_turns ({max_turns}): {_ENDS}, TRL\'s trainer does: pass its GRPOConfig '
                f'(trl_tool_environment(scheduler, args)) to bound it by max_tool_calling_iterations={rounds}')
    if not hasattr(args, 'max_tool_calling_iterations'):
        return f'max_turns ({max_turns}): args must be TRL\'s GRPOConfig, and a {type(args).__name__} has no ' \
               'max_tool_calling_iterations'
    have = args.max_tool_calling_iterations
    if have is not None and have != rounds:
        return (f'max_turns ({max_turns}) is {rounds} rounds of tool calls, but the GRPOConfig has '
                f'max_tool_calling_iterations={have}')
    return None


def _overridden(scheduler: Any, name: str) -> bool:
    return getattr(type(scheduler), name, None) is not getattr(YamlScheduler, name, None)


def _config_problems(c: SchedulerConfig, scheduler: Any) -> List[str]:
    found: List[str] = []
    if not scheduler.tools:
        found.append('tools: none, and TRL\'s loop calls an environment only through its tools')
    if c.env is not None:
        found.append('env: the environment reads every reply (it speaks without a tool call), and TRL\'s loop calls '
                     'an environment only through its tools')
    found += _stop_problems(c.stop)
    if c.answer is not None:
        found.append(f'answer: reads the final reply, and {_NO_TEXT}')
    if c.tips:
        found.append('tips: a hint after a reply, and TRL\'s loop adds nothing but tool messages')
    found += _observation_problems(c.observation)
    if c.system_prompt is not None:
        found.append('system_prompt: TRL renders the prompt and the tools with the chat template; put the system '
                     'message in the dataset\'s prompt')
    if c.tool_errors == 'finish':
        found.append(f'tool_errors: finish ends the episode on a failed call, and {_ENDS}')
    if c.max_tool_calls_per_turn != SchedulerConfig.model_fields['max_tool_calls_per_turn'].default:
        found.append('max_tool_calls_per_turn: a TRL environment cannot tell one turn\'s calls from the next\'s')
    if c.turn_reward is not None:
        found.append('turn_reward: a per-turn reward, and TRL\'s GRPO takes one reward per rollout')
    found += [f'tools[{i}].reward ({t.name}): a per-turn reward, and TRL\'s GRPO takes one reward per rollout'
              for i, t in enumerate(c.tools) if t.reward is not None]
    found += [f'tools[{i}].name ({t.name!r}): TRL takes it for the environment\'s own method'
              for i, t in enumerate(c.tools) if t.name in TRL_METHODS or t.name.startswith('_')]
    if c.finish_policy:
        found.append('finish_policy: decides by finish reason, and TRL tells an environment none')
    if c.branch is not None:
        found.append('branch: forks an episode, which TRL\'s loop cannot')
    return found


def _stop_problems(stop: StopConfig) -> List[str]:
    found = [f'stop.{key}{_named(getattr(stop, key))}: a stop rule that ends an episode on the reply, and {_ENDS}'
             for key in ('stop_tools', 'regex', 'correct_answer', 'predicate') if getattr(stop, key)]
    if not stop.on_length:
        found.append('stop.on_length: false continues a reply cut at the token limit, and TRL\'s loop has no '
                     'continuation')
    return found


def _named(value: Any) -> str:
    """`` (a, b)``: the rules or tools a stop key names (nothing for a flag or a hook)."""
    return f' ({", ".join(map(str, value))})' if isinstance(value, (list, dict)) else ''


def _observation_problems(obs: ObservationConfig) -> List[str]:
    found: List[str] = []
    if obs.mode == 'inline':
        found.append('observation.mode: inline continues the assistant message, and TRL\'s loop writes tool messages')
    if obs.role != 'tool':
        found.append(f'observation.role: {obs.role}, and TRL\'s loop writes each result as a tool message')
    if not obs.one_message_per_call:
        found.append('observation.one_message_per_call: false, and TRL\'s loop writes one tool message per call')
    if obs.images_from is not None:
        found.append('observation.images_from: images in tool messages are not handed to TRL')
    for key in ('template', 'error_template'):
        if 'index' in {field for _, field, _, _ in string.Formatter().parse(getattr(obs, key))}:
            found.append(f'observation.{key}: {{index}} is the call\'s place in its turn, which a TRL environment '
                         'cannot tell')
    return found
