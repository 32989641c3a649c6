"""The YAML scheduler's schema (pydantic). Every key is documented here; ``mtflow schema`` prints
it as JSON Schema for editors, and ``mtflow validate`` reports every violation with its line.

Checks that need the outside world (an importable ``module:function``, a known parser or
built-in tool, a regex that compiles) are field validators too, so that one validation pass
reports every problem at once. They read the YAML file's directory from the validation context
(``{'base_dir': ...}``) to resolve references to Python files next to the YAML.
"""
from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import (AfterValidator, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator,
                      model_validator)
from typing_extensions import Annotated

from mtflow.core.images import ImageError, to_image_url
from mtflow.core.keys import StrictModel
from mtflow.core.registry import resolve_reference
from mtflow.core.signatures import call_problem
from mtflow.core.stop import MAX_TURNS_BOUND
from mtflow.declarative.envs.config import (ENV_KINDS, GemConfig, NemoGymConfig, OpenEnvConfig, SkyRLGymConfig,
                                            TextArenaConfig, VerifiersConfig)
from mtflow.engine.branching import Branching
from mtflow.declarative.gym import ENVS
from mtflow.declarative.parsers import PARSERS
from mtflow.declarative.policy import PolicyAction, check_key
from mtflow.declarative.reasoning import REASONING
from mtflow.declarative.templates import FIELDS, check_template
from mtflow.tools.bounds import DEFAULT_MAX_OBSERVATION
from mtflow.tools.registry import TOOLS


def _resolved(value: Optional[str], info: ValidationInfo) -> Any:
    """The object ``module:attribute`` names (it must import and be callable), when the context
    allows resolving; else ``None``."""
    if value is None:
        return None
    ctx = info.context or {}
    if not ctx.get('resolve', True):
        if ':' not in value:
            raise ValueError(f"{value!r} must look like 'module:attribute'")
        return None
    try:
        obj = resolve_reference(value, ctx.get('base_dir'))
    except (ImportError, AttributeError) as exc:
        raise ValueError(f'cannot resolve {value!r}: {exc}') from None
    except Exception as exc:  # the module itself failed while importing
        raise ValueError(f'importing {value!r} failed: {type(exc).__name__}: {exc}') from None
    if not callable(obj):
        raise ValueError(f'{value!r} is not callable')
    return obj


def _check_ref(value: Optional[str], info: ValidationInfo) -> Optional[str]:
    """``module:attribute`` must import (when the context allows resolving)."""
    _resolved(value, info)
    return value


def _named(registry: Any, value: str, info: ValidationInfo, also: tuple = ()) -> str:
    """A name ``registry`` knows (or one of ``also``), else a ``module:attribute`` that imports."""
    if value in also or value in registry.names():
        return value
    if ':' not in value:
        raise ValueError(registry.unknown(value))
    return _check_ref(value, info)


def _hook(what: str, *args: str) -> Any:
    """A ``module:function`` field mtflow calls as ``what(*args)``: it must import and take those
    arguments (:func:`mtflow.core.signatures.call_problem`), found when the file is validated,
    not on every request once the model has loaded."""
    def check(value: Optional[str], info: ValidationInfo) -> Optional[str]:
        obj = _resolved(value, info)
        problem = call_problem(obj, args, what) if obj is not None else None
        if problem:
            raise ValueError(problem)
        return value

    return Annotated[str, AfterValidator(check)]


def check_image_ref(ref: str, base_dir: Optional[str]) -> Optional[str]:
    """What is wrong with an image the YAML names (a data URL, or a path relative to the YAML
    file's directory), or ``None``; the image is read and decoded, so a broken one is found now."""
    try:
        to_image_url(ref if ref.startswith('data:') else image_path(ref, base_dir))
    except ImageError as exc:
        return str(exc)
    return None


def image_path(ref: str, base_dir: Optional[str]) -> str:
    """A path the YAML names, resolved against the YAML file's directory (when it is relative)."""
    return ref if os.path.isabs(ref) or not base_dir else os.path.join(base_dir, ref)


def _check_regex(value: Optional[str]) -> Optional[str]:
    if value is None:
        return value
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f'regex {value!r} does not compile: {exc}') from None
    return value


#: a ``module:attribute`` field: it must import (:func:`_check_ref`), one rule for every such field
Ref = Annotated[str, AfterValidator(_check_ref)]
def _matches_something(value: Optional[str]) -> Optional[str]:
    """A stop regex that matches the empty string (``''``, ``'a*'``) matches every completion:
    every request would stop at turn 1, silently."""
    if value is not None and re.search(value, '') is not None:
        raise ValueError(f'regex {value!r} matches the empty string, so it matches every completion and would '
                         'stop every request at turn 1')
    return value


#: a regex field: it must compile (:func:`_check_regex`)
Regex = Annotated[str, AfterValidator(_check_regex)]
#: a stop rule's regex: it must compile and match something (:func:`_matches_something`)
StopRegex = Annotated[str, AfterValidator(_check_regex), AfterValidator(_matches_something)]
#: the hooks a scheduler file names, each with the arguments mtflow passes
#: the arguments a ``reward`` is called with (the scheduler, ``mtflow rescore``)
REWARD_ARGS = ('infer_request', 'rollout_infos')
RewardHook = _hook('reward', *REWARD_ARGS)
TurnRewardHook = _hook('turn_reward', 'infer_request', 'completion', 'rollout_infos', 'turn')
PredicateHook = _hook('predicate', 'infer_request', 'response_choice', 'turn')
ImagesHook = _hook('images_impl', 'infer_request', 'response_choice', 'turn')
ResultImagesHook = _hook('images_from.impl', 'name', 'result', 'index')
#: ``answer.compare``'s arguments
COMPARE_ARGS = ('answer', 'reference')
BranchHook = _hook('branch.at.hook', 'infer_request', 'state', 'turn')


class ToolReward(StrictModel):
    """A per-turn reward for this tool's calls (``rollout_infos['turn_rewards']``, source ``tools``)."""
    ok: float = Field(0.0, description='Added for each call of the tool that succeeded.')
    error: float = Field(0.0, description='Added for each call that failed (bad arguments, exception, timeout).')


class ToolConfig(StrictModel):
    """One tool the model may call."""
    name: str = Field(description='The name the model uses to call the tool.', min_length=1)
    builtin: Optional[str] = Field(
        None, description="A built-in tool: 'calculator' or 'python' (or one added with register_tool). "
        'Defaults to `name` when neither builtin nor impl is given.')
    impl: Optional[Ref] = Field(
        None, description="A Python callable 'package.module:function' (sync or async); a module next to the "
        'YAML file may be named too. Its signature and docstring give the default parameters and description.')
    description: Optional[str] = Field(None, description='What the tool does, shown to the model.')
    parameters: Optional[Dict[str, Any]] = Field(
        None, description='JSON Schema of the arguments (an object schema). Default: derived from the callable.')
    options: Dict[str, Any] = Field(
        default_factory=dict,
        description="Options for a built-in (python: isolation, timeout_s, memory_mb, cpu_s, max_processes, "
        "max_output_chars, max_file_mb, tmp_mb, shm_mb, warm_pool, site_packages; see docs/sandbox.md).")
    timeout_s: Optional[float] = Field(None, gt=0, description='Per-call timeout in seconds; a timeout is a tool error.')
    max_concurrency: Optional[int] = Field(
        None, ge=1, description='At most this many calls of this tool run at once, across all requests.')
    max_observation: int = Field(
        DEFAULT_MAX_OBSERVATION, ge=1, description='Longest observation of one call: tokens when the scheduler has a '
        f'tokenizer, else characters (default {DEFAULT_MAX_OBSERVATION}); a longer result is cut, with a marker the '
        'model reads ([... N tokens truncated]), and counted in the summary.')
    truncate_side: Literal['right', 'left'] = Field(
        'right', description="Which end of a long observation is cut: 'right' keeps the beginning, 'left' the end.")
    reward: Optional[ToolReward] = Field(
        None, description="A per-turn reward for the turn's calls of this tool: {ok: 0.1, error: -0.1}; recorded "
        "in rollout_infos['turn_rewards'] with the turn's token span (docs/streaming.md).")

    @field_validator('parameters')
    @classmethod
    def _object_schema(cls, v: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        if v is not None and v.get('type', 'object') != 'object':
            raise ValueError("parameters must be a JSON Schema of type 'object'")
        if v is not None and not isinstance(v.get('properties', {}), dict):
            raise ValueError('parameters.properties must be a mapping')
        return v

    @model_validator(mode='after')
    def _one_source(self) -> 'ToolConfig':
        if self.builtin and self.impl:
            raise ValueError('give either builtin or impl, not both')
        if not self.impl:
            name = self.builtin or self.name
            if name not in TOOLS.names():
                raise ValueError(f"{TOOLS.unknown(name)}; set impl: 'module:function' for your own tool")
            self.builtin = name
        elif self.options:
            raise ValueError('options apply to built-in tools only')
        return self


class ImagesConfig(StrictModel):
    """Limits on the images tools and environments hand back (docs/multimodal.md)."""
    max_per_request: Optional[int] = Field(None, ge=1, description='At most this many images in one request; one '
                                           'more fails that request (error naming the uuid and turn).')
    max_pixels: Optional[int] = Field(None, ge=1, description='At most this many pixels (width x height) in one '
                                      'image; a bigger one fails its request.')


class ResultImagesConfig(StrictModel):
    """Images a tool names in its text result, read into the observation (docs/multimodal.md):
    a tool that prints a markdown image or a data URL, or any result a function can turn into
    images."""
    pattern: Optional[Regex] = Field(
        None, description="Regex searched in each successful result's text; each match names one image (its group "
        "1, else the whole match): a data:image/ URL, or a file path inside `dir`. The match is replaced by an "
        "<image> placeholder. E.g. markdown images: '!\\[[^\\]]*\\]\\(([^)\\s]+)\\)'.")
    impl: Optional[ResultImagesHook] = Field(
        None, description="'module:function'(name, result, index) called for each successful result: None (no "
        'image), an image, a list mixing text and images, or an Observation (whose text then replaces the result).')
    dir: Optional[str] = Field(
        None, description="The directory a path the pattern matches must lie in (relative: to the YAML file's "
        'directory); a path outside it fails the request. Without dir, only data URLs are read.')

    @model_validator(mode='after')
    def _one(self) -> 'ResultImagesConfig':
        if (self.pattern is None) == (self.impl is None):
            raise ValueError('give either pattern or impl')
        if self.dir is not None and self.pattern is None:
            raise ValueError('dir applies to pattern only')
        return self


class ObservationConfig(StrictModel):
    """How tool results reach the model."""
    mode: Literal['message', 'inline'] = Field(
        'message', description="'message': a new message (next turn generates a new assistant message); "
        "'inline': appended to the assistant message (next turn continues it; observation tokens get loss mask 0).")
    role: Literal['tool', 'user'] = Field('tool', description="Role of observation messages in 'message' mode.")
    template: str = Field('{result}', description='Text of one result; placeholders {name}, {result}, {index} '
                          '(1-based); another {placeholder} is an error; {{ and }} write literal braces.')
    error_template: str = Field('Error: {error}', description='Text of one failed call; placeholders {name}, '
                                '{error}, {index}; {{ and }} write literal braces.')
    separator: str = Field('\n', description='Joins several results into one text (inline mode, or role user).')
    prefix: str = Field('', description="Text before the joined results (e.g. '\\nObservation: ').")
    suffix: str = Field('', description="Text after the joined results (e.g. '\\nThought:').")
    one_message_per_call: bool = Field(True, description="With role 'tool': one message per call (else one joined).")
    images_from: Optional[ResultImagesConfig] = Field(
        None, description="Read images a tool names in its text result ({pattern, dir} or {impl}); mode message only.")

    @field_validator('template')
    @classmethod
    def _template(cls, v: str) -> str:
        return check_template(v, FIELDS['observation.template'])

    @field_validator('error_template')
    @classmethod
    def _error_template(cls, v: str) -> str:
        return check_template(v, FIELDS['observation.error_template'])

    @model_validator(mode='after')
    def _images_need_messages(self) -> 'ObservationConfig':
        if self.images_from is not None and self.mode == 'inline':
            raise ValueError('images_from needs mode message (inline text is plain tokens, where no processor '
                             'expands an image)')
        return self


class StopConfig(StrictModel):
    """When a request stops. The first rule that matches names the finish reason
    (``stop_rule:<name>``), checked in this order: env_done, correct_answer, regex rules,
    stop_tools, length, predicate. A turn that nothing continues (no tool call, no tip, no environment)
    stops with 'stop_rule:no_tool_call' ('tips_exhausted' or 'no_action' without tools); a nudge
    instead is a tip with ``when: no_tool_call``. ``max_turns`` (top level) ends with ``max_turns``."""
    stop_tools: List[str] = Field(default_factory=list,
                                  description="Stop ('stop_rule:stop_tool') when one of these tools is called; the "
                                  'call is not run.')
    regex: Dict[str, StopRegex] = Field(default_factory=dict,
                                      description="name -> regex searched in the turn's completion; a match stops with "
                                      "'stop_rule:<name>' (e.g. final_answer: 'Final Answer:'); one that matches the "
                                      'empty string is an error.')
    on_length: bool = Field(True, description="Stop with 'length' when the output hit the token limit.")
    include_reasoning: bool = Field(False, description="The regex rules search the whole reply, reasoning included; "
                                    "by default they search the content only (see `reasoning`).")
    correct_answer: bool = Field(False, description="Stop ('stop_rule:correct_answer') when the answer (see `answer`) "
                                 'matches the data_dict field.')
    predicate: Optional[PredicateHook] = Field(
        None, description="'module:function'(infer_request, response_choice, turn) -> bool or a rule name; truthy "
        "stops with 'stop_rule:predicate' (or 'stop_rule:<returned name>').")

    @field_validator('regex')
    @classmethod
    def _regexes(cls, v: Dict[str, str]) -> Dict[str, str]:
        bad = [name for name in v if not re.fullmatch(r'[A-Za-z_][\w.-]*', name)]
        if bad:
            raise ValueError(f'rule names must be identifiers: {", ".join(map(repr, bad))}')
        return v


class AnswerConfig(StrictModel):
    """How to read the model's final answer and check it against the request's ``data_dict``."""
    pattern: Regex = Field(r'\\boxed\{([^{}]*)\}|<answer>(.*?)</answer>',
                         description='Regex; the first non-empty group of the LAST match is the answer.')
    field: str = Field('solution', description='data_dict key holding the reference answer.')
    compare: str = Field('numeric', description="'exact' (after stripping), 'numeric' (as numbers when both parse, "
                         "else exact) or 'module:function'(answer, reference) -> bool.")
    include_reasoning: bool = Field(False, description='Read the answer from the whole reply, reasoning included; by '
                                    'default from the content only (see `reasoning`).')

    @field_validator('compare')
    @classmethod
    def _compare(cls, v: str, info: ValidationInfo) -> str:
        if v in ('exact', 'numeric'):
            return v
        if ':' not in v:
            raise ValueError(f"compare must be 'exact', 'numeric' or 'module:function', not {v!r}")
        obj = _resolved(v, info)
        problem = call_problem(obj, COMPARE_ARGS, 'compare') if obj is not None else None
        if problem:
            raise ValueError(problem)
        return v


class ReasoningConfig(StrictModel):
    """How a reply's reasoning is split from its content (mtflow.declarative.reasoning): stop rules,
    answers, tips, rewards, environments and tool calls see the content; the trajectory keeps both
    (the assistant message's reasoning_content); the token ids are never changed."""
    parser: str = Field('auto', description="'auto' (by the tool-call parser's family: harmony for gpt-oss, kimi "
                        "for Kimi, think otherwise), 'think' (<think>...</think>), 'kimi', 'harmony' (gpt-oss's "
                        "analysis channel), 'none', a registered name or 'module:Class'.")
    opened_in_prompt: Optional[bool] = Field(
        None, description="The chat template's generation prompt opens <think> (so a reply has only </think>, and "
        'one with neither tag is all reasoning); default: asked of the tokenizer\'s template when there is one.')

    @field_validator('parser')
    @classmethod
    def _parser(cls, v: str, info: ValidationInfo) -> str:
        return _named(REASONING, v, info, also=('auto', ))


def _reasoning_shorthand(value: Any) -> Any:
    """``reasoning: think`` is ``reasoning: {parser: think}``."""
    return {'parser': value} if isinstance(value, str) else value


class TipConfig(StrictModel):
    """A hint injected when a condition holds (the "tip and re-check" pattern); the request continues."""
    name: str = Field('tip', description='Recorded in rollout_infos (tips_given).')
    when: Literal['wrong_answer', 'no_answer', 'no_tool_call', 'regex', 'predicate', 'always'] = Field(
        'wrong_answer', description="Condition: the answer is missing or wrong ('wrong_answer'), missing "
        "('no_answer'), the turn called no tool, `regex` matched, `predicate` returned true, or 'always'.")
    regex: Optional[Regex] = Field(None, description="Regex for when: regex.")
    predicate: Optional[PredicateHook] = Field(None, description="'module:function'(infer_request, response_choice, "
                                               "turn) -> bool.")
    text: str = Field(description='The tip text.')
    placement: Literal['inline', 'user'] = Field(
        'inline', description="'inline': appended to the assistant message (loss mask 0; next turn continues it); "
        "'user': a new user message.")
    max_times: int = Field(1, ge=1, description='How often this tip may be given to one request.')
    truncate_before: List[str] = Field(
        default_factory=list, description="Inline only: cut the completion at the first of these markers (e.g. "
        "'<answer>', '</think>') before appending the tip, tokens and logprobs included.")
    images: List[str] = Field(
        default_factory=list, description="Images shown with the tip (placement user): file paths (relative: to the "
        'YAML file\'s directory) or data:image/ URLs; each is read and checked when the file is validated.')
    images_impl: Optional[ImagesHook] = Field(
        None, description="'module:function'(infer_request, response_choice, turn) -> the images shown with the tip "
        '(None, an image, or a list of images), after `images` (placement user).')

    @field_validator('images')
    @classmethod
    def _images(cls, v: List[str], info: ValidationInfo) -> List[str]:
        for k, ref in enumerate(v):
            why = check_image_ref(ref, (info.context or {}).get('base_dir'))
            if why:
                raise ValueError(f'images[{k}]: {why}')
        return v

    @model_validator(mode='after')
    def _needs(self) -> 'TipConfig':
        if self.when == 'regex' and not self.regex:
            raise ValueError('when: regex needs a regex')
        if self.when == 'predicate' and not self.predicate:
            raise ValueError('when: predicate needs a predicate')
        if (self.images or self.images_impl) and self.placement == 'inline':
            raise ValueError('images need placement user (an inline tip is plain tokens in the assistant message, '
                             'where no processor expands an image)')
        return self


class EnvConfig(StrictModel):
    """An environment per request, of one kind: ``impl`` (mtflow's own protocol: ``reset``,
    ``step -> observation, reward, done, info``, ``close``), ``gym`` (a Gymnasium-style object:
    ``step -> observation, reward, terminated, truncated, info``), ``openenv`` (an OpenEnv server),
    ``textarena`` (a textarena game), ``skyrl_gym`` (a SkyRL text environment), ``gem`` (a GEM
    environment), ``nemo_gym`` (a NeMo Gym resources server) or ``verifiers`` (a verifiers 0.4
    environment in-process). See docs/environments.md."""
    impl: Optional[str] = Field(None, description="A built-in environment ('guess_number') or 'module:Class'.")
    gym: Optional[str] = Field(None, description="A Gymnasium-style text environment: 'module:Class' (or a "
                               'factory), made with kwargs; terminated stops with stop_rule:env_done, truncated with '
                               'stop_rule:env_truncated.')
    openenv: Optional[OpenEnvConfig] = Field(None, description='An OpenEnv server (openenv client).')
    textarena: Optional[TextArenaConfig] = Field(None, description='A single-player textarena game.')
    skyrl_gym: Optional[SkyRLGymConfig] = Field(None, description='A SkyRL text environment (skyrl-gym), made per '
                                                "request from its dataset row (reward_spec, extra_info).")
    gem: Optional[GemConfig] = Field(None, description='A GEM environment (gem-llm): its games and graders.')
    nemo_gym: Optional[NemoGymConfig] = Field(None, description="A NeMo Gym resources server: its tools run the "
                                              "model's tool calls, its /verify gives the reward.")
    verifiers: Optional[VerifiersConfig] = Field(None, description="A verifiers 0.4 environment run in-process: its "
                                                 "taskset's tasks, its Env.run and its rewards, mtflow as the agent.")
    kwargs: Dict[str, Any] = Field(default_factory=dict, description='Keyword arguments for the environment '
                                   '(impl and gym).')
    observation_role: Literal['user', 'tool'] = Field('user', description='Role of the observation message.')

    @field_validator('impl')
    @classmethod
    def _impl(cls, v: Optional[str], info: ValidationInfo) -> Optional[str]:
        if v is None or v in ENVS.names():
            return v
        if ':' not in v:
            raise ValueError(ENVS.unknown(v))
        return _check_ref(v, info)

    @field_validator('gym')
    @classmethod
    def _gym(cls, v: Optional[str], info: ValidationInfo) -> Optional[str]:
        if v is not None and ':' not in v:
            raise ValueError(f"gym: {v!r} must look like 'module:Class'")
        return _check_ref(v, info)

    @model_validator(mode='after')
    def _one_kind(self) -> 'EnvConfig':
        given = [k for k in ENV_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f'give exactly one of {", ".join(ENV_KINDS)}' + (f' (got {", ".join(given)})' if given else ''))
        return self

    @field_validator('kwargs')
    @classmethod
    def _kwargs_kind(cls, v: Dict[str, Any], info: ValidationInfo) -> Dict[str, Any]:
        for kind in ('openenv', 'textarena', 'skyrl_gym', 'gem', 'nemo_gym', 'verifiers'):
            if v and info.data.get(kind) is not None:
                raise ValueError(f'kwargs applies to impl and gym; put {kind} options under {kind}:')
        return v


class EntropyConfig(StrictModel):
    """Fork after a turn whose sampled tokens were uncertain (ARPO-style): their mean surprisal
    (``-logprob``, an estimate of the per-token entropy from the sampled tokens' logprobs; the
    run must ask for logprobs)."""
    above: Optional[float] = Field(None, ge=0, description='Fork when the turn just generated had at least this '
                                   'mean surprisal (nats per token).')
    rise: Optional[float] = Field(None, description="Fork when it was at least this much above the request's first "
                                  'turn (ARPO: entropy rising over the initial turn).')

    @model_validator(mode='after')
    def _one(self) -> 'EntropyConfig':
        if self.above is None and self.rise is None:
            raise ValueError('give above:, rise: or both')
        return self


class BranchAtConfig(StrictModel):
    """Where to fork; every key given must hold (e.g. tool calls with high entropy)."""
    turn: Optional[int] = Field(None, ge=1, description='Before the model generates this turn (with state: '
                                'tool_step, after its output was applied, before the step).')
    state: Literal['generating', 'tool_step'] = Field(
        'generating', description='generating: before a model turn (the branches sample it apart); tool_step: '
        'after a turn was generated, before the step (the branches share it and run their own step).')
    tool_calls: bool = Field(False, description='Right after a step that ran tool calls, before the turn that '
                             'reads their results.')
    entropy: Optional[EntropyConfig] = Field(None, description='After a turn whose sampled tokens were uncertain.')
    hook: Optional[BranchHook] = Field(
        None, description="'module:function'(infer_request, state, turn) -> the number of branches (an int; true: "
        'copies; 0, 1, false or null: no fork), asked at every point the other keys allow.')

    @model_validator(mode='after')
    def _something(self) -> 'BranchAtConfig':
        if self.turn is None and not self.tool_calls and self.entropy is None and self.hook is None:
            raise ValueError('say where to fork: turn, tool_calls, entropy or hook')
        if self.tool_calls and self.state != 'generating':
            raise ValueError('tool_calls forks before the turn that reads the tool results: state must be generating')
        return self


class BranchConfig(StrictModel):
    """Branching rollouts (docs/branching.md): each request's machine forks into branches that share
    its history exactly; its leaves are ordinary trajectories and its tree is written beside them."""
    at: BranchAtConfig = Field(
        description="Where to fork: a mapping of turn, state, tool_calls, entropy, hook ('tool_calls' alone is "
        'short for {tool_calls: true}).')
    copies: int = Field(2, ge=2, description='Branches at each fork (the request itself is the first).')
    leaves: Optional[int] = Field(None, ge=1, description='The leaf budget of each prompt\'s tree: forks split it, '
                                  'and a tree whose forks never came is topped up with copies of the prompt, so every '
                                  'group has exactly this many leaves.')

    @field_validator('at', mode='before')
    @classmethod
    def _short_form(cls, v: Any) -> Any:
        return {'tool_calls': True} if v == 'tool_calls' else v

    def branching(self, base_dir: Optional[str] = None) -> Branching:
        """The :class:`mtflow.Branching` this section says (its hook resolved)."""
        at = {k: v for k, v in self.at.model_dump(exclude_none=True).items() if v is not False}
        if self.at.hook is not None:
            at['hook'] = resolve_reference(self.at.hook, base_dir)
        return Branching(at=at, copies=self.copies, leaves=self.leaves)


class SchedulerConfig(StrictModel):
    """A scheduler defined in YAML: tools, how calls are parsed, how results are shown, when to stop."""
    model_config = ConfigDict(title='mtflow scheduler')  # and StrictModel's: unknown keys, strict types
    plugins: List[str] = Field(
        default_factory=list, description='Python modules imported before the rest of the file is checked (a '
        'module next to the YAML works too), so that their register_tool / register_parser / register_env calls '
        'make names available; listed by `mtflow validate` with the other code the file imports.')
    name: str = Field('yaml_scheduler', description='Shown in traces and graphs.')
    description: str = Field('', description='Free text.')
    max_turns: Optional[int] = Field(None, ge=1, le=MAX_TURNS_BOUND,
                                     description=f"Stop with 'max_turns' at this turn (at most {MAX_TURNS_BOUND}).")
    parser: str = Field('hermes', description="Tool-call format: 'hermes' (aliases 'qwen', 'qwen3'), 'llama3_json' "
                        "('llama3'), 'pythonic', 'mistral', 'deepseek', 'react', 'json', 'qwen3_coder', 'glm45', "
                        "'kimi_k2', 'deepseek_v32', 'minimax_m2', 'harmony', a registered name or entry point, or "
                        "'module:Class'.")
    parser_options: Dict[str, Any] = Field(default_factory=dict, description='Keyword arguments for the parser.')
    reasoning: Annotated[ReasoningConfig, BeforeValidator(_reasoning_shorthand)] = Field(
        default_factory=ReasoningConfig, description="How the reply's reasoning is split from its content: a name "
        "('auto', 'think', 'kimi', 'harmony', 'none') or {parser, opened_in_prompt}; see ReasoningConfig.")
    tools: List[ToolConfig] = Field(default_factory=list, description='The tools.')
    tool_errors: Literal['feed_back', 'finish'] = Field(
        'feed_back', description="A malformed call, unknown tool, bad arguments, exception or timeout: 'feed_back' "
        "(an error observation) or 'finish' (the request ends with reason 'error').")
    max_tool_calls_per_turn: int = Field(8, ge=1, description='Calls beyond this in one turn get an error observation.')
    max_threads: int = Field(64, ge=1, description='Thread pool size for sync tools (shared by all requests).')
    observation: ObservationConfig = Field(default_factory=ObservationConfig, description='How results are shown.')
    images: ImagesConfig = Field(default_factory=ImagesConfig, description='Limits on the images in observations.')
    stop: StopConfig = Field(default_factory=StopConfig, description='Stop rules.')
    answer: Optional[AnswerConfig] = Field(None, description='Answer extraction and checking.')
    tips: List[TipConfig] = Field(default_factory=list, description='Tips, tried in order; at most one per turn.')
    env: Optional[EnvConfig] = Field(None, description='A gym environment driven by every completion.')
    system_prompt: Optional[str] = Field(
        None, description='System prompt added before the first turn; {tools} renders the tool list in the '
        "parser's format; another {placeholder} is an error; {{ and }} write literal braces.")
    system_prompt_mode: Literal['if_missing', 'prepend', 'replace'] = Field(
        'if_missing', description='When the request already has a system message: keep it (if_missing), put ours '
        'before it (prepend), or replace it.')
    reward: Optional[RewardHook] = Field(
        None, description="'module:function'(infer_request, rollout_infos) -> float, called when the request "
        "stops; stored as rollout_infos['reward'] (anything but a finite number fails the request, field reward).")
    turn_reward: Optional[TurnRewardHook] = Field(
        None, description="'module:function'(infer_request, completion, rollout_infos, turn) -> float or None, "
        "called at every turn's end; recorded in rollout_infos['turn_rewards'] with the turn's token span.")
    finish_policy: Dict[str, Union[Literal['keep', 'mask', 'drop'], PolicyAction]] = Field(
        default_factory=dict, description="What training sees, by finish reason: keys are finish reasons "
        "(length, max_turns, timeout, error, interrupted, stop_rule:<name>), 'stop_rule:*', 'tool_error:<kind>' "
        "(the request had such a tool error), 'tool_error:*' or 'default'; values keep, mask (loss mask all 0), "
        "drop (rollout_infos['mtflow_drop']) or {mask, drop, reward}. See docs/declarative.md.")
    scheduler_class: Optional[Ref] = Field(
        None, description="'module:Class', a subclass of mtflow.declarative.YamlScheduler to use instead (drop to "
        'Python for what YAML cannot say).')
    branch: Optional[BranchConfig] = Field(
        None, description='Fork each request where this says into branches that share its history exactly (a tree '
        'per prompt; docs/branching.md). The environment must copy (fork()) or replay (replayable: true).')

    @field_validator('parser')
    @classmethod
    def _parser(cls, v: str, info: ValidationInfo) -> str:
        return _named(PARSERS, v, info)

    @field_validator('system_prompt')
    @classmethod
    def _system_prompt(cls, v: Optional[str]) -> Optional[str]:
        return None if v is None else check_template(v, FIELDS['system_prompt'])

    @model_validator(mode='after')
    def _cross(self, info: ValidationInfo) -> 'SchedulerConfig':
        if (info.context or {}).get('cross_check', True):
            problems = cross_problems(self.model_dump())
            if problems:
                raise ValueError('; '.join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in problems))
        return self


def cross_problems(data: Any) -> List[tuple]:
    """Problems between sections, as ``(loc, message)``; works on the raw YAML mapping too, so
    ``mtflow validate`` reports them (at their own line) even when other keys are invalid."""
    if not isinstance(data, dict):
        return []
    problems: List[tuple] = []
    tools = data.get('tools') if isinstance(data.get('tools'), list) else []
    names = [t.get('name') for t in tools if isinstance(t, dict)]
    seen = set()
    for i, t in enumerate(tools):
        name = t.get('name') if isinstance(t, dict) else None
        if isinstance(name, str) and name in seen:
            problems.append((('tools', i, 'name'), f'duplicate tool name {name!r}'))
        seen.add(name)
    stop = data.get('stop') if isinstance(data.get('stop'), dict) else {}
    stop_tools = stop.get('stop_tools') if isinstance(stop.get('stop_tools'), list) else []
    for i, n in enumerate(stop_tools):
        if n not in names:
            problems.append((('stop', 'stop_tools', i), f'unknown tool {n!r} (tools: {", ".join(map(str, names)) or "none"})'))
    tips = data.get('tips') if isinstance(data.get('tips'), list) else []
    if data.get('answer') is None:
        if stop.get('correct_answer'):
            problems.append((('stop', 'correct_answer'), 'needs an `answer` section (how to read and check the answer)'))
        for i, tip in enumerate(tips):
            if isinstance(tip, dict) and tip.get('when', 'wrong_answer') in ('wrong_answer', 'no_answer'):
                problems.append((('tips', i, 'when'), f"when: {tip.get('when', 'wrong_answer')} needs an `answer` section"))
    if tools and data.get('env') is not None:
        problems.append((('env', ), 'use either tools or env, not both'))
    branch = data.get('branch') if isinstance(data.get('branch'), dict) else {}
    at = branch.get('at')
    if (at == 'tool_calls' or (isinstance(at, dict) and at.get('tool_calls') is True)) and not tools:
        problems.append((('branch', 'at'), 'tool_calls: this scheduler has no tools, so no step runs tool calls and no '
                                           'request would ever fork'))
    policy = data.get('finish_policy') if isinstance(data.get('finish_policy'), dict) else {}
    rules = _stop_rule_names(data, stop, names)
    for key in policy:
        msg = check_key(str(key))
        if msg is None and rules is not None and str(key).startswith('stop_rule:') and key != 'stop_rule:*' and \
                str(key)[len('stop_rule:'):] not in rules:
            msg = f'this scheduler has no stop rule {str(key)[len("stop_rule:"):]!r} (its rules: {", ".join(sorted(rules))})'
        if msg:
            problems.append((('finish_policy', key), msg))
    return problems


def _stop_rule_names(data: Dict[str, Any], stop: Dict[str, Any], tools: List[Any]) -> Optional[set]:
    """The ``stop_rule:<name>`` names this file can finish with (None when a predicate may name any)."""
    if stop.get('predicate') or data.get('env') is not None:
        return None  # a predicate, or an environment, may name rules of its own
    rules = set(stop.get('regex') or {}) if isinstance(stop.get('regex'), dict) else set()
    rules |= {'correct_answer'} if stop.get('correct_answer') else set()
    rules |= {'stop_tool'} if stop.get('stop_tools') else set()
    rules |= {'no_tool_call' if tools else 'tips_exhausted' if data.get('tips') else 'no_action'}
    return rules
