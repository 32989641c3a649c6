"""The run config: one YAML file that says what ``mtflow run`` rolls out, with what, and where to.

::

    scheduler: schedulers/guess_number.yaml   # a scheduler YAML, or 'module:Class' / 'file.py:Class'
    scheduler_args: {}                        # keyword arguments for a Python scheduler class
    backend: hf                               # hf | openai | vllm | scripted | swift | 'module:Class'; or a
                                              # mapping {kind: openai, urls: [...]}: kind + backend_options
    model: embedded                           # backend's model ('embedded': SmolLM2-135M-Instruct)
    backend_options: {max_batch_size: 8}      # the backend's own keyword arguments
    dataset: null                             # JSONL prompts; null: the bundled guess-the-number set;
                                              # or {reasoning_gym: {name: leg_counting, size: 16, seed: 0}}
    num_generations: 1                        # copies of each prompt (a GRPO group)
    out: runs/default                         # trajectories.jsonl, trace.jsonl, summary.json go here
    max_turns: 6                              # null or 0: unlimited
    batch_size: 8                             # requests per Executor.run call
    seed: 0                                   # seeds Python's and torch's RNGs (and the backend)
    limit: null                               # only the first N prompts
    request_config: {max_tokens: 48, temperature: 0.7, logprobs: true}
    mode: lockstep                            # lockstep | async (each request on its own)
    max_concurrency: null                     # async: requests in flight at once; null: the batch
    context: null                             # context budgets and compaction (docs/context.md)
    gateway: null                             # mtflow gateway: host, port, tool_parser, ... (docs/gateway.md)
    agent: null                               # mtflow run of an external agent per prompt (docs/gateway.md)
    admission: null                           # {tool_calls: N, env_sessions: M} (docs/admission.md)
    max_failed_share: 0.5                     # exit 1 when more than this share of requests failed
    policies: {}                              # an episode file's policy ids -> {backend, model, backend_options}
                                              # (the run's own backend is the policy 'default'; docs/multi-agent.md)
    roles: {}                                 # an episode file's roles by name: {policy, sampling, train} to change

Relative paths in ``scheduler``, ``dataset``, ``model`` (when it names an existing file or
directory) and the ``backend_options`` key ``path`` are looked up next to the config file first,
then in the current directory (a scheduler also in the repository's ``schedulers/``); ``out``
is relative to the current directory. Errors name the file, the line and the field.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated, Any, Dict, List, Literal, Optional, Tuple, Union

import yaml
from pydantic import AfterValidator, Field, ValidationError, field_validator, model_validator

from mtflow.backends import BackendError, check_backend_name
from mtflow.backends.base import SamplingError, sampling_options
from mtflow.backends.chat_templates import BUNDLED, looks_like_jinja
from mtflow.core.errors import UserError
from mtflow.core.protocol import RequestConfig
from mtflow.core.stop import MAX_TURNS_BOUND
from mtflow.core.keys import StrictModel, unknown_key_message
from mtflow.core.safe_yaml import YamlLoadError, load_yaml, load_yaml_file  # the hostile-YAML reader scheduler files use too
from mtflow.data.sources import check_dataset_mapping
from mtflow.declarative.context import ContextConfig
from mtflow.declarative.schema import SchedulerConfig
from mtflow.engine.admission import Admission
from mtflow.roles.config import RoleOverride
from mtflow.roles.role import DEFAULT_POLICY
from mtflow.run.agent_config import AgentConfig, GatewayConfig

__all__ = ['RunConfig', 'RunConfigError', 'load_run_config', 'is_run_config', 'PATH_OPTIONS', 'parse_sets',
           'config_keys']

#: backend options that hold paths (resolved like ``dataset``)
PATH_OPTIONS = ('path', )


class AdmissionConfig(StrictModel):
    """The ``admission:`` block: the run's bounds (:class:`mtflow.Admission`)."""
    tool_calls: Optional[int] = Field(None, ge=1, description='Tool and sandbox calls in flight at once, across '
                                      "all tools (beside each tool's own max_concurrency); null: no bound.")
    env_sessions: Optional[int] = Field(None, ge=1, description='Environment sessions open at once (each request '
                                        'holds one from its reset to its close); null: no bound.')

    def make(self) -> Admission:
        return Admission(tool_calls=self.tool_calls, env_sessions=self.env_sessions)


def _known_backend(value: str) -> str:
    """A backend name (registered, an alias, or ``'module:Class'``), as a schema error otherwise."""
    try:
        return check_backend_name(value)
    except BackendError as exc:
        raise ValueError(str(exc)) from None


#: a config's backend name, checked by :func:`_known_backend`
BackendName = Annotated[str, AfterValidator(_known_backend)]


class PolicyConfig(StrictModel):
    """One ``policies:`` entry: the backend that serves a policy id of an episode file."""
    backend: BackendName = Field('hf', description='As the run config\'s backend: hf, openai, vllm, scripted, swift, '
                                 "'module:Class'.")
    model: Optional[str] = Field(None, description="Its model (next to the config file when it is a path).")
    backend_options: Dict[str, Any] = Field(default_factory=dict, description="The backend's keyword arguments.")


class RunConfigError(UserError):
    """A run config that cannot be used; the message names file, line and field."""


class RunConfig(StrictModel):
    """A validated run config. See the module docstring for every key. Types are strict, as in
    scheduler files: ``batch_size: true`` is an error, not 1."""

    scheduler: Optional[str] = Field(None, description="A scheduler YAML file, or a Python scheduler as 'module:Class' "
                                     "or 'path/file.py:Class'; required by mtflow run unless the config has an "
                                     'agent: section.')
    scheduler_args: Dict[str, Any] = Field(default_factory=dict,
                                           description='Keyword arguments for a Python scheduler class.')
    backend: BackendName = Field('hf', description="hf, openai, vllm, scripted or swift; a name given to "
                         "mtflow.backends.register_backend; or your own class as 'module:Class' (the module "
                         'found next to the config file too).')
    model: Optional[str] = Field(None, description="The backend's model; for hf: 'embedded' (default), a local "
                                 'directory, a .gguf file or a cached hub id.')
    backend_options: Dict[str, Any] = Field(default_factory=dict,
                                            description="The backend's keyword arguments (see docs/backends.md).")
    dataset: Optional[Union[str, Dict[str, Any]]] = Field(
        None, description='A JSONL prompt file; {reasoning_gym: {name, size, seed, config}}: generated tasks '
        '(mtflow/data/reasoning_gym.py); null: the bundled dataset.')
    num_generations: int = Field(1, ge=1, description='Copies of each prompt (a GRPO group; uuids <uuid>#<k>); the '
                                 "summary shows each group's reward spread.")
    out: str = Field('runs/latest', description='Output directory (relative to the current directory).')
    max_turns: Optional[int] = Field(None, ge=0, le=MAX_TURNS_BOUND, description='Stop every request at this turn '
                                     f'(at most {MAX_TURNS_BOUND}); null or 0: unlimited.')
    batch_size: int = Field(8, ge=1, description='Requests per executor batch.')
    seed: Optional[int] = Field(0, description="Seeds Python's and torch's random generators.")
    limit: Optional[int] = Field(None, ge=1, description='Roll out only the first N prompts.')
    request_config: Dict[str, Any] = Field(default_factory=dict,
                                           description='Sampling parameters (mtflow.RequestConfig fields).')
    mode: Literal['lockstep', 'async'] = Field('lockstep', description="The executor's driver: 'lockstep' (every "
                                               "request a turn at a time) or 'async' (each on its own).")
    max_concurrency: Optional[int] = Field(None, ge=1, description='Async mode: requests in flight at once; null: '
                                           'the whole batch.')
    max_failed_share: float = Field(0.5, ge=0, le=1, description='Exit with status 1 when more than this share of '
                                    'the written requests failed (finish reason error or timeout), or all of them.')
    admission: Optional[AdmissionConfig] = Field(None, description='Admission control (docs/admission.md): '
                                                 'tool_calls (tool and sandbox calls in flight across all tools), '
                                                 'env_sessions (environment sessions open); what exceeds a bound '
                                                 'waits.')
    context: Optional[ContextConfig] = Field(None, description='Context budgets and the compaction policy '
                                             '(docs/context.md): context_length, max_tokens, total_response_tokens, '
                                             'prompt_budget, policy, ...')
    gateway: Optional[GatewayConfig] = Field(None, description='How mtflow gateway (and agent: runs) serve external '
                                             'agents (docs/gateway.md): host, port, tool_parser, idle_timeout_s, ...')
    agent: Optional[AgentConfig] = Field(None, description='mtflow run starts this agent command per prompt against '
                                         'its own gateway session (docs/gateway.md): command, task, concurrency, '
                                         'timeout_s, verifier, ...')
    policies: Dict[str, PolicyConfig] = Field(default_factory=dict, description='An episode file\'s policy ids '
                                              '(docs/multi-agent.md) -> the backend serving each: {backend, model, '
                                              "backend_options}; the run's own backend is the policy 'default'.")
    roles: Dict[str, RoleOverride] = Field(default_factory=dict, description='An episode file\'s roles by name: '
                                           'the policy, sampling or train flag to change for this run.')

    #: the directory of the config file (for relative paths); not a YAML key
    base_dir: Optional[Path] = Field(None, exclude=True)
    #: the config file, for messages
    source: Optional[str] = Field(None, exclude=True)
    #: the line of each top-level key in the file (for messages that name a field)
    lines: Dict[str, int] = Field(default_factory=dict, exclude=True)
    #: the keys the command line set (their messages name the option, not the file's line)
    overridden: List[str] = Field(default_factory=list, exclude=True)
    #: nested keys the command line set, and the flag that set each (``request_config.temperature``
    #: -> ``--temperature -1``, ``backend_options.seed`` -> ``-o seed=3``)
    flags: Dict[str, str] = Field(default_factory=dict, exclude=True)

    def where(self, key: str) -> str:
        """``file:line: key`` of a key (top-level, or one level down: ``request_config.top_p``,
        ``backend_options.max_batch_size``), for a message that names it (the option when the
        command line set it; ``file: key`` when the file does not have it)."""
        source = self.source or '<run config>'
        if key in self.flags:
            return f'command line: {self.flags[key]}: {key}'
        if key in self.overridden:
            return f"command line: --{key.replace('_', '-')}"
        line = self.lines.get(key)
        return f'{source}:{line}: {key}' if line else f'{source}: {key}'

    @model_validator(mode='before')
    @classmethod
    def _backend_mapping(cls, data: Any) -> Any:
        """``backend: {kind: openai, urls: [...], ...}``: the kind is the backend, the other keys
        join ``backend_options`` (a key in both is an error)."""
        if not isinstance(data, dict) or not isinstance(data.get('backend'), dict):
            return data
        data = dict(data)
        options = dict(data['backend'])
        kind = options.pop('kind', None)
        if not isinstance(kind, str):
            raise ValueError("backend: a mapping needs kind: <backend name> (kind: openai, urls: [...])")
        given = data.get('backend_options') or {}
        both = sorted(set(options) & set(given)) if isinstance(given, dict) else []
        if both:
            raise ValueError(f'backend: {", ".join(both)} given both under backend and in backend_options')
        data['backend'] = kind
        data['backend_options'] = {**given, **options} if isinstance(given, dict) else given
        return data

    @field_validator('policies')
    @classmethod
    def _not_default(cls, value: Dict[str, Any]) -> Dict[str, Any]:
        if DEFAULT_POLICY in value:
            raise ValueError(f"{DEFAULT_POLICY!r} is the run's own backend (backend:, model:); give the other "
                             'policies other ids')
        return value

    @field_validator('request_config')
    @classmethod
    def _known_sampling_keys(cls, value: Dict[str, Any]) -> Dict[str, Any]:
        unknown = sorted(set(value) - set(RequestConfig.model_fields))
        if unknown:
            raise ValueError('; '.join(unknown_key_message(k, RequestConfig.model_fields) for k in unknown))
        config = RequestConfig(**value)  # types
        try:  # the engines' bounds: the rule every backend applies to each call
            sampling_options(config, default_max_tokens=1)
        except SamplingError as exc:
            raise ValueError(f'{exc.field}: {exc.why}') from None
        return value

    @field_validator('dataset')
    @classmethod
    def _dataset_kind(cls, value: Any) -> Any:
        if isinstance(value, dict):
            check_dataset_mapping(value)
        return value

    # ---- derived values ----------------------------------------------------------------------
    def make_request_config(self) -> RequestConfig:
        return RequestConfig(**self.request_config)

    def context_budget(self, backend: Any) -> Any:
        """The ``context:`` block as a :class:`mtflow.ContextBudget` for ``backend`` (which counts the
        prompt tokens and knows its context length), or ``None`` without one."""
        if self.context is None:
            return None
        return self.context.budget(backend, str(self.base_dir) if self.base_dir else None, self.where('context'))

    def resolve(self, value: str) -> Path:
        """A relative path: next to the config file if it exists there, else in the current
        directory (returned as given when it exists nowhere, so the error shows it)."""
        path = Path(value).expanduser()
        if path.is_absolute():
            return path
        candidates = ([self.base_dir / path] if self.base_dir is not None else []) + [Path.cwd() / path]
        for c in candidates:
            if c.exists():
                return c
        return path

    def scheduler_is_yaml(self) -> bool:
        return self.scheduler is not None and self.scheduler.endswith(('.yaml', '.yml'))

    def require_scheduler(self) -> None:
        """``mtflow run`` rolls out a scheduler, or an ``agent:`` (the gateway's sessions): one of them."""
        if self.scheduler is None and self.agent is None:
            raise RunConfigError(f'{self.source or "<run config>"}: scheduler: required (a scheduler file or '
                                 "'module:Class'), or an agent: section (docs/gateway.md)")
        if self.scheduler is not None and self.agent is not None:
            raise RunConfigError(f'{self.where("agent")}: an agent: run has no scheduler (the agent is the scheduler); '
                                 'remove one of scheduler: and agent:')

    def scheduler_path(self) -> Path:
        """The scheduler YAML file; also looked up in the repository's (installed) ``schedulers/``."""
        path = self.resolve(self.scheduler)
        if path.exists() or path.is_absolute():
            return path
        spec = importlib.util.find_spec('schedulers')
        for loc in (spec.submodule_search_locations or []) if spec is not None else []:
            for cand in (Path(loc) / Path(self.scheduler).name, Path(loc).parent / self.scheduler):
                if cand.is_file():
                    return cand
        return path

    def dataset_path(self) -> Optional[Path]:
        """The JSONL file; ``None`` for the bundled set and for a generated dataset (a mapping)."""
        return None if not isinstance(self.dataset, str) else self.resolve(self.dataset)

    def resolved_model(self) -> Optional[str]:
        """``model`` as a path when it names an existing file or directory (next to the config
        file or in the current directory), else unchanged (``'embedded'``, a hub id, a server
        model name)."""
        if not self.model:
            return self.model
        path = self.resolve(self.model)
        return str(path) if path.exists() else self.model

    def policy_ids(self) -> List[str]:
        """The policy ids this run serves: ``default`` (its own backend) and every ``policies:`` key."""
        return [DEFAULT_POLICY] + list(self.policies)

    def for_policy(self, policy: str) -> 'RunConfig':
        """This config with the backend of ``policy`` in place of its own (``default``: itself)."""
        if policy == DEFAULT_POLICY:
            return self
        spec = self.policies[policy]
        return self.model_copy(update={'backend': spec.backend, 'model': spec.model,
                                       'backend_options': dict(spec.backend_options)})

    def resolved_backend_options(self) -> Dict[str, Any]:
        opts = dict(self.backend_options)
        for key in PATH_OPTIONS:
            if isinstance(opts.get(key), str):
                opts[key] = str(self.resolve(opts[key]))
        template = opts.get('chat_template')
        if isinstance(template, str) and not looks_like_jinja(template) and template not in BUNDLED:
            opts['chat_template'] = str(self.resolve(template))  # a file: next to the config, else here
        return opts


# ---- loading --------------------------------------------------------------------------------------
def _line_of(node: Any, loc: tuple, exact: bool = False) -> Optional[int]:
    """The 1-based line of field ``loc`` in a composed YAML node tree (the deepest one found;
    ``exact``: ``None`` unless the whole of ``loc`` is there)."""
    line = None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if getattr(k, 'value', None) == str(key):
                    line, node = k.start_mark.line + 1, v
                    break
            else:
                return None if exact else line
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            return None if exact else line
    return line


#: RunConfig fields that are not YAML keys
_INTERNAL = ('base_dir', 'source', 'lines', 'overridden', 'flags')


def config_keys() -> List[str]:
    """The keys a run config may have (what an unknown-key message lists)."""
    return [k for k in RunConfig.model_fields if k not in _INTERNAL]


def _scalar(text: str) -> Any:
    """A ``--set`` value read as YAML with the config files' scalar rules (``3``, ``true``,
    ``null``, ``[a, b]``, ``{k: v}``), else the text as given."""
    try:
        return load_yaml(text)[0]
    except YamlLoadError:
        return text


def parse_sets(items: List[str]) -> List[Tuple[Tuple[str, ...], Any, str]]:
    """``--set KEY=VALUE`` flags as ``(dotted key path, value, the flag as given)``; the first
    key must be a run config key (``max_turns``, ``request_config.max_tokens``,
    ``backend_options.max_batch_size``). A problem raises :class:`RunConfigError` naming the flag."""
    out = []
    for item in items:
        flag = f'--set {item}'
        key, sep, value = item.partition('=')
        path = tuple(p.strip() for p in key.split('.'))
        if not sep or not key.strip() or not all(path):
            raise RunConfigError(f"{flag}: expected KEY=VALUE (dotted keys: request_config.max_tokens=32)")
        if path[0] not in config_keys():
            raise RunConfigError(f'{flag}: {unknown_key_message(path[0], config_keys())}')
        out.append((path, _scalar(value), flag))
    return out


def _apply_sets(data: Dict[str, Any], sets: List[Tuple[Tuple[str, ...], Any, str]]) -> Dict[str, str]:
    """Set each dotted key in ``data`` (creating mappings on the way); return which flag set
    each top-level key (for the messages)."""
    origin: Dict[str, str] = {}
    for path, value, flag in sets:
        node = data
        for depth, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise RunConfigError(f'{flag}: {".".join(path[:depth + 1])} is not a mapping, cannot set '
                                     f'{".".join(path)}')
            node = child
        node[path[-1]] = value
        origin[path[0]] = flag
    return origin


#: pydantic's error types for a number outside its bounds (their messages say the bound, not the value)
_BOUND_ERRORS = ('greater_than', 'greater_than_equal', 'less_than', 'less_than_equal')


def _keys_at(loc: tuple) -> List[str]:
    """The keys the mapping holding ``loc``'s last key may have: the run config's, or an entry's of
    ``policies:`` / ``roles:`` (``roles.<name>.<key>``)."""
    nested = {'policies': PolicyConfig, 'roles': RoleOverride}
    if len(loc) == 3 and loc[0] in nested:
        return list(nested[str(loc[0])].model_fields)
    return config_keys()


def _format_errors(exc: ValidationError, source: str, root: Any, origin: Optional[Dict[str, str]] = None) -> str:
    problems: List[str] = []
    for err in exc.errors():
        loc = tuple(err.get('loc', ()))
        field = '.'.join(str(p) for p in loc) or '<top level>'
        line = _line_of(root, loc) if root is not None else None
        where = f'{source}:{line}' if line else source
        if origin and loc and str(loc[0]) in origin:  # the value came from the command line
            where = origin[str(loc[0])]
        msg = err.get('msg', 'invalid')
        if msg.startswith('Value error, '):
            msg = msg[len('Value error, '):]
        if err.get('type') == 'extra_forbidden':
            msg = unknown_key_message(str(loc[-1]), _keys_at(loc))
        if err.get('type') in _BOUND_ERRORS and 'input' in err and where.startswith(source):  # a flag shows it
            msg += f' (got {err["input"]!r})'
        problems += _at_sub_keys(msg, loc, root, source, origin) or [f'{where}: {field}: {msg}']
    return '; '.join(problems)


def _at_sub_keys(msg: str, loc: tuple, root: Any, source: str, origin: Optional[Dict[str, str]]) -> List[str]:
    """A mapping's problems whose messages each start with one of its keys (``temperature: must
    be >= 0; top_p: ...``), each named at that key's own line as ``request_config.temperature``;
    ``[]`` when the message is not of that form (or the value came from the command line)."""
    if root is None or len(loc) != 1 or (origin and str(loc[0]) in origin):
        return []
    for parts in (msg.split('; '), [msg]):  # one problem per key, else one problem (its text may hold '; ')
        out = []
        for part in parts:
            sub, sep, rest = part.partition(': ')
            line = _line_of(root, loc + (sub, ), exact=True) if sep else None
            if line is None:
                break
            out.append((line, f'{source}:{line}: {loc[0]}.{sub}: {rest}'))
        else:
            return [text for _, text in sorted(out, key=lambda item: item[0])]
    return []


def load_run_config(path: Union[str, Path], overrides: Optional[Dict[str, Any]] = None,
                    sets: Optional[List[str]] = None, sampling: Optional[Dict[str, Any]] = None) -> RunConfig:
    """Read and validate a run config; ``sets`` (``--set KEY=VALUE``, dotted keys, values typed
    by the schema), ``sampling`` (``--temperature``, ``--max-tokens``: ``request_config`` keys)
    then ``overrides`` (the other flags) replace keys, as editing the file would.

    Raises :class:`RunConfigError` (one line, every problem) or ``FileNotFoundError``."""
    path = Path(path)
    if not path.exists():
        raise RunConfigError(f'config file not found: {path}')
    if path.is_dir():
        raise RunConfigError(f'config path is a directory, not a YAML file: {path}')
    try:
        data, root, duplicates = load_yaml_file(str(path))
    except YamlLoadError as exc:
        raise RunConfigError('; '.join(f'{path}:{p.line}: {p.message}' if p.line else f'{path}: {p.message}'
                                       for p in exc.problems)) from None
    except OSError as exc:
        raise RunConfigError(f'cannot read {path}: {exc.strerror or exc}') from None
    if duplicates:
        raise RunConfigError('; '.join(f'{path}:{p.line}: {".".join(map(str, p.path))}: {p.message}'
                                       for p in duplicates))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RunConfigError(f'{path}: a run config must be a mapping of keys, not {type(data).__name__}')
    misplaced = scheduler_file_problem(path, data)
    if misplaced:
        raise RunConfigError(misplaced)
    for key in _INTERNAL:
        if key in data:
            raise RunConfigError(f'{path}:{_line_of(root, (key,))}: {key}: unknown key')
    given_sampling = {k: v for k, v in (sampling or {}).items() if v is not None}
    flags = {f'request_config.{k}': f'--{k.replace("_", "-")} {v}' for k, v in given_sampling.items()}
    parsed_sets = parse_sets(sets or [])
    for keys, _, flag in parsed_sets:  # a nested key --set gave is blamed on the flag (cfg.where), not the file
        flags.update({'.'.join(keys[:depth]): flag for depth in range(2, len(keys) + 1)})
    origin = _apply_sets(data, parsed_sets + [(('request_config', k), v, flags[f'request_config.{k}'])
                                              for k, v in given_sampling.items()])
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    data.update(given)
    origin.update({k: f'--{k.replace("_", "-")} {v}' for k, v in given.items()})
    overridden = list(given)
    lines = _key_lines(root, data)
    try:
        cfg = RunConfig(**data, base_dir=path.resolve().parent, source=str(path), lines=lines, overridden=overridden,
                        flags=flags)
    except ValidationError as exc:
        raise RunConfigError(_format_errors(exc, str(path), root, origin)) from None
    return cfg


#: the mappings whose keys get lines of their own (messages about one sampling or backend option, scheduler
#: argument, agent or gateway setting, policy or role)
_NESTED = ('request_config', 'backend_options', 'scheduler_args', 'agent', 'gateway', 'policies', 'roles')


def _key_lines(root: Any, data: Dict[str, Any]) -> Dict[str, int]:
    """The line of each top-level key and of each key of :data:`_NESTED` (``request_config.top_p``;
    a ``backend: {kind, ...}`` mapping's keys are ``backend_options.<key>``)."""
    if root is None:
        return {}
    lines = {str(k): line for k in data if (line := _line_of(root, (k, ))) is not None}
    for top in _NESTED + ('backend', ):
        value = data.get(top)
        if not isinstance(value, dict):
            continue
        name = 'backend_options' if top == 'backend' else top
        for sub in value:
            line = _line_of(root, (top, sub), exact=True)
            if line is not None:
                lines[f'{name}.{sub}'] = line
    return lines


#: at most this many YAML files are read looking for the run config that names a scheduler file
_MAX_CONFIGS_SEARCHED = 200


def scheduler_file_problem(path: Path, data: Dict[str, Any]) -> Optional[str]:
    """The one line for a scheduler YAML given where a run config belongs (``mtflow run
    schedulers/x.yaml``): it has no ``scheduler``, and its other keys are a scheduler file's, not a
    run config's; the line names a run config that uses it (looked for in the ``configs/`` beside
    its directory, the current directory's ``configs/`` and the current directory), or says what
    to write. ``None`` for anything else (a run config's own mistakes are reported key by key)."""
    foreign = set(map(str, data)) - set(RunConfig.model_fields)
    if not foreign or 'scheduler' in data or 'agent' in data or not foreign <= set(SchedulerConfig.model_fields):
        return None
    keys = ', '.join(k for k in map(str, data) if k in foreign)
    users = _configs_naming(path)
    said = f'{path} is a scheduler file, not a run config (its keys {keys} are a scheduler\'s): give a run config ' \
        'that names it'
    if users:
        return f'{said}, as {users[0]} does (mtflow run {users[0]})'
    return (f'{said} (scheduler: {path}, with backend, model and dataset: docs/cli.md; no run config in configs/ '
            f'names it); mtflow validate {path} checks the scheduler file alone')


def _configs_naming(scheduler: Path) -> List[str]:
    """The run configs (as a path a message shows) whose ``scheduler`` is ``scheduler``."""
    target = scheduler.resolve()
    here = Path.cwd()
    found: List[str] = []
    dirs = dict.fromkeys([target.parent.parent / 'configs', here / 'configs', here])
    files = [f for d in dirs if d.is_dir() for f in sorted(d.iterdir()) if f.suffix in ('.yaml', '.yml')]
    for file in files[:_MAX_CONFIGS_SEARCHED]:
        try:
            data = load_yaml_file(str(file))[0]
        except (OSError, YamlLoadError):
            continue
        named = data.get('scheduler') if isinstance(data, dict) else None
        if not isinstance(named, str) or not named.endswith(('.yaml', '.yml')):
            continue
        cfg = RunConfig.model_construct(scheduler=named, base_dir=file.resolve().parent)
        try:
            same = cfg.scheduler_path().resolve() == target
        except OSError:
            same = False
        if same:
            found.append(str(file.relative_to(here)) if file.is_relative_to(here) else str(file))
    return found


def is_run_config(path: Union[str, Path]) -> bool:
    """Whether a YAML file is a run config (it names a ``scheduler``) rather than a scheduler file.
    Unreadable or invalid YAML counts as not a run config (the scheduler loader reports it)."""
    try:
        data, _, _ = load_yaml_file(str(path))
    except (OSError, YamlLoadError):
        return False
    return isinstance(data, dict) and any(key in data for key in ('scheduler', 'agent', 'gateway'))
