"""The YAML keys of the environments mtflow adapts from other libraries (``env: {gym: ...}``,
``env: {openenv: ...}``, ``env: {textarena: ...}``); ``schema.EnvConfig`` embeds these models.

They live here, apart from the core schema, so that each environment kind keeps its options in
one place; nothing here imports the libraries themselves (``mtflow validate`` must work without
them installed, and names the missing extra when a check needs one).
"""
from __future__ import annotations

import re
from urllib.parse import urlsplit
from typing import Any, ClassVar, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra='forbid')


class _WithId(_Strict):
    """A section whose ``id`` names something of another library: its form is checked here
    (``_ID``), before the library is asked."""
    _ID: ClassVar[str] = r'[\w.-]+'
    _WHAT: ClassVar[str] = 'an id'

    @field_validator('id', check_fields=False)
    @classmethod
    def _id(cls, v: str) -> str:
        if not re.fullmatch(cls._ID, v):
            raise ValueError(f'{v!r} is not {cls._WHAT}')
        return v


class OpenEnvConfig(_Strict):
    """An OpenEnv server (``openenv``): one WebSocket session per request."""
    url: Optional[Union[str, List[str]]] = Field(
        None, description="The server's base URL (http://, ws://), or a list of replicas: each new session goes "
        'to the least-loaded live one.')
    launch: Optional[Union[str, List[str]]] = Field(
        None, description="Start the server(s) on 127.0.0.1 instead: 'package.module:app' (an ASGI app, e.g. made "
        "with openenv's create_app, served by uvicorn) or a command as a list ('{port}' and '{python}' are "
        'replaced). Started at the first session, stopped when the scheduler closes.')
    replicas: int = Field(1, ge=1, description='With launch: how many servers to start (each on its own free port).')
    max_sessions: Optional[int] = Field(
        None, ge=1, description="At most this many open sessions per server from this scheduler (set it to the "
        "server's max_concurrent_envs); a request that finds every server full waits up to capacity_wait_s.")
    action: Literal['text', 'json'] = Field(
        'text', description="How a completion becomes the step action: 'text': {action_field: completion}; "
        "'json': the completion's JSON object (a ```json fence is allowed), else as 'text'.")
    action_field: str = Field('message', description="The action's field that receives the text.")
    observation_field: Optional[str] = Field(
        None, description='The observation field shown to the model; default: the only field, else the '
        'observation as JSON (image_fields left out).')
    image_fields: List[str] = Field(
        default_factory=list, description="Observation fields that hold an image, shown to the model beside the "
        "text (docs/multimodal.md): a data:image/ URL, base64 of PNG/JPEG bytes, nested lists of pixels (HxW or "
        "HxWx3, as a numpy array serialises), or a flat list with a '<field>_shape' field beside it; null: no "
        'image this step.')
    reset_kwargs: Dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for reset() (merged with data_dict['reset_kwargs']); "
        'seed and episode_id (the request uuid) are added unless given.')
    connect_timeout_s: float = Field(10.0, gt=0, description='Opening one WebSocket session.')
    message_timeout_s: float = Field(60.0, gt=0, description='One reset or step reply; past it the request fails.')
    retries: int = Field(3, ge=0, description='Further attempts to open a session (connection refused, reset '
                         'failed), each on the next live server. A step is never retried: the session state is lost.')
    retry_backoff_s: float = Field(0.5, ge=0, description='Wait before retry k: retry_backoff_s * k.')
    capacity_wait_s: float = Field(30.0, ge=0, description="How long a request waits for a free session "
                                   "(client-side max_sessions, or the server's CAPACITY_REACHED) before it fails.")
    startup_timeout_s: float = Field(60.0, gt=0, description='With launch: how long a server may take to answer '
                                     '/health.')

    @model_validator(mode='after')
    def _one_source(self) -> 'OpenEnvConfig':
        if (self.url is None) == (self.launch is None):
            raise ValueError('give either url or launch')
        if self.url is not None:
            urls = [self.url] if isinstance(self.url, str) else self.url
            if not urls:
                raise ValueError('url: give at least one URL')
            for u in urls:
                if not re.match(r'^(https?|wss?)://[^/\s]+', u):
                    raise ValueError(f'url {u!r} must start with http://, https://, ws:// or wss://')
                if u != u.strip() or re.search(r'\s', u):
                    raise ValueError(f'url {u!r} contains whitespace')
                try:
                    port = urlsplit(u).port
                except ValueError:
                    port = 0
                if port == 0:
                    raise ValueError(f'url {u!r}: the port must be 1..65535')
        if isinstance(self.launch, str) and not re.fullmatch(r'[\w.]+:[\w.]+', self.launch):
            raise ValueError(f"launch {self.launch!r} must be 'package.module:app' or a command list")
        if isinstance(self.launch, list) and not self.launch:
            raise ValueError('launch: the command list is empty')
        if self.replicas > 1 and self.launch is None:
            raise ValueError('replicas applies to launch only (list several urls instead)')
        return self


class TextArenaConfig(_WithId):
    """A single-player textarena game (``textarena.make(id)``)."""
    _WHAT: ClassVar[str] = 'a textarena game id'
    id: str = Field(description="A textarena game id, e.g. 'GuessTheNumber-v0'.")
    kwargs: Dict[str, Any] = Field(default_factory=dict, description='Keyword arguments for textarena.make.')
    invalid_move_reward: Optional[float] = Field(
        None, description="Reward of a game lost by an invalid move (textarena's own reward when null).")


class SkyRLGymConfig(_WithId):
    """A SkyRL text environment (``skyrl_gym.make(id, env_config=..., extras=...)``), made per
    request with that request's row as its ``extras`` (``reward_spec``, ``extra_info``, ...)."""
    _ID: ClassVar[str] = r'[\w.-]+(:[\w.]+)?'
    _WHAT: ClassVar[str] = "a skyrl-gym environment id or 'module:Class'"
    id: str = Field(description="A skyrl-gym environment id ('gsm8k', 'gsm8k_multi_turn', 'aime', ...) or "
                    "'module:Class' (a BaseTextEnv subclass).")
    env_config: Dict[str, Any] = Field(default_factory=dict, description="The environment's env_config.")
    extras: Dict[str, Any] = Field(
        default_factory=dict, description="Extras every request gets; the request's data_dict (the dataset row's "
        'other keys: reward_spec, extra_info, max_turns) is merged over them.')


class GemConfig(_WithId):
    """A GEM environment (``gem.make(id, **kwargs)``): Gymnasium's reset/step, GEM's own rewards."""
    _ID: ClassVar[str] = r'[\w.:-]+'
    _WHAT: ClassVar[str] = 'a GEM environment id'
    id: str = Field(description="A GEM environment id, e.g. 'game:GuessTheNumber-v0-easy', 'rg:leg_counting'.")
    kwargs: Dict[str, Any] = Field(default_factory=dict, description='Keyword arguments for gem.make.')


class NemoGymConfig(_Strict):
    """A NeMo Gym resources server: its tools called with the model's tool calls, its ``/verify``
    the reward (NeMo Gym's simple agent loop, with mtflow holding the model and its tokens)."""
    url: Optional[str] = Field(None, description="A running resources server's base URL (http://).")
    launch: Optional[str] = Field(
        None, description="Start the server on 127.0.0.1 instead: 'package.module:ServerClass' (a NeMo Gym "
        "SimpleResourcesServer subclass, e.g. 'resources_servers.example_single_tool_call.app:"
        "SimpleWeatherResourcesServer'). Started at the first session, stopped when the scheduler closes.")
    python: Optional[str] = Field(
        None, description='With launch: the Python that has nemo-gym (it needs Python 3.13: usually a venv of its '
        "own); relative to this file's directory. Default: the Python running mtflow.")
    parser: str = Field('hermes', description="How the model's tool calls are read (a parser name, as the "
                        "scheduler's parser:).")
    parser_options: Dict[str, Any] = Field(default_factory=dict, description="The parser's options.")
    request_timeout_s: float = Field(60.0, gt=0, description='One call to the server (a tool, seed_session, verify).')
    startup_timeout_s: float = Field(120.0, gt=0, description='With launch: how long the server may take to answer '
                                     '/health.')

    @model_validator(mode='after')
    def _one_source(self) -> 'NemoGymConfig':
        if (self.url is None) == (self.launch is None):
            raise ValueError('give either url or launch')
        if self.url is not None and not re.match(r'^https?://[^/\s]+$', self.url.rstrip('/')):
            raise ValueError(f'url {self.url!r} must look like http://host:port')
        if self.launch is not None and not re.fullmatch(r'[\w.]+:[\w.]+', self.launch):
            raise ValueError(f"launch {self.launch!r} must be 'package.module:ServerClass'")
        if self.python is not None and self.launch is None:
            raise ValueError('python applies to launch only')
        return self


class VerifiersConfig(_Strict):
    """A verifiers 0.4 environment run in-process: its taskset's tasks, its ``Env.run`` and its
    tasks' rewards in mtflow's process, with mtflow as the agent (no agent program)."""
    taskset: str = Field(description="A verifiers taskset id, as vf-eval takes it (e.g. 'openenv', or an "
                         'installed environment package).')
    config: Dict[str, Any] = Field(default_factory=dict, description="The taskset's own config (e.g. base_url, "
                                   "resets for verifiers' openenv taskset).")
    env: Optional[str] = Field(None, description="The verifiers Env id; default: the taskset's own, else "
                               'SingleAgentEnv (as vf-eval resolves it).')
    turn_timeout_s: float = Field(300.0, gt=0, description="How long the environment may take between the model's "
                                  'reply and its next message (or its end).')

    @field_validator('taskset')
    @classmethod
    def _taskset(cls, v: str) -> str:
        if not re.fullmatch(r'[\w.:-]+', v):
            raise ValueError(f'{v!r} is not a verifiers taskset id')
        return v


ENV_KINDS = ('impl', 'gym', 'openenv', 'textarena', 'skyrl_gym', 'gem', 'nemo_gym', 'verifiers')


def env_kind(env: Any) -> str:
    """Which of :data:`ENV_KINDS` an ``EnvConfig`` uses."""
    for kind in ENV_KINDS:
        if getattr(env, kind, None) is not None:
            return kind
    raise ValueError('env: give one of ' + ', '.join(ENV_KINDS))
