"""The ``gateway:`` and ``agent:`` sections of a run config (``docs/gateway.md``).

``gateway:`` says how ``mtflow gateway CONFIG`` (and ``mtflow run`` with ``agent:``) serves
external agents: where it listens, the tool-call format of the model, the sessions' idle timeout
and limits. ``agent:`` makes ``mtflow run`` start an agent command per prompt against its own
session and score it with a verifier. They are read here, with the run config (so a mistake names
the file, line and key); the gateway itself is ``mtflow.gateway``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import Field, ValidationInfo, field_validator

from mtflow.core.keys import StrictModel
from mtflow.declarative.parsers import PARSERS
from mtflow.declarative.reasoning import REASONING, family_mismatch

__all__ = ['GatewayConfig', 'AgentConfig', 'VerifierCommand', 'DEFAULT_MAX_BODY_BYTES']

#: the largest request body the gateway reads (a longer one is a 413)
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


class GatewayConfig(StrictModel):
    """The ``gateway:`` section."""
    host: str = Field('127.0.0.1', description='The address to listen on (127.0.0.1: this machine only).')
    port: int = Field(0, ge=0, le=65535, description='The port; 0: a free one (printed when it starts).')
    tool_parser: Optional[str] = Field('hermes', description="How the model writes tool calls (a parser of "
                                       "docs/declarative.md: hermes, llama3_json, json, ...); null: never parsed.")
    parser_options: Dict[str, Any] = Field(default_factory=dict, description="The parser's options.")
    tools_in_system: Literal['auto', 'always', 'never'] = Field(
        'auto', description="Write the client's tools into the system prompt in the parser's format: auto when the "
        "chat template does not render tools itself.")
    idle_timeout_s: float = Field(600.0, gt=0, description='A session with no call and no finish for this long '
                                  'finishes idle_timeout.')
    finish_grace_s: float = Field(60.0, ge=0, description="A session ended by a limit waits this long for its "
                                  "client's finish (and reward) before it is written without one.")
    open_on_call: bool = Field(True, description='A call to an unknown session opens it; false: sessions are opened '
                               'with POST /sessions first (else 404).')
    max_sessions: int = Field(4096, ge=1, description='Sessions in flight at once; the first call of one more waits.')
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1024, description='The largest request body (else 413).')
    client_sampling: bool = Field(False, description="Honour the client's temperature, top_p and seed (its "
                                  "max_tokens, capped by request_config's, and stop always are).")
    max_staleness: Optional[int] = Field(None, ge=0, description='A session whose oldest turn is more than this many '
                                         'policy versions old is dropped (docs/streaming.md).')
    rollout_timeout_s: Optional[float] = Field(None, gt=0, description='A model call running longer fails its '
                                               'session (timeout).')
    session_header: str = Field('X-Session-ID', pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$",
                                description="The header that names a call's session on the gateway's own /v1 "
                                "(verifiers' X-Session-ID by default; X-Mtflow-Session is read too).")
    reasoning: str = Field('auto', description="How a reply's thinking is split from its content (reasoning_content, "
                           "thinking blocks, reasoning items): a reasoning parser of docs/declarative.md (auto: by "
                           "the tool parser's family and the chat template; think, kimi, harmony, none, module:Class).")

    # checked with the config (its file and line, before the model loads), as a YAML scheduler's are
    @field_validator('tool_parser')
    def _known_parser(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and ':' not in value and value not in PARSERS.names():
            raise ValueError(f'unknown parser {value!r} (known: {", ".join(PARSERS.names())}, or module:Class)')
        return value

    @field_validator('reasoning')
    def _known_reasoning(cls, value: str, info: ValidationInfo) -> str:
        if value != 'auto' and ':' not in value and value not in REASONING.names():
            raise ValueError(f'unknown reasoning parser {value!r} (known: {", ".join(REASONING.names())}, auto, '
                             'or module:Class)')
        mismatch = family_mismatch(value, info.data.get('tool_parser') or '')
        if mismatch:
            raise ValueError(mismatch)
        return value


class VerifierCommand(StrictModel):
    """``verifier: {command: ...}``: a command that prints the reward."""
    command: Union[str, List[str]] = Field(description='Run with MTFLOW_TRANSCRIPT (a JSON file: messages, exit '
                                           'code, task, data) in its environment; its last line of output is the '
                                           'reward (a number, or JSON {"reward": R, "info": {...}}).')


class AgentConfig(StrictModel):
    """The ``agent:`` section."""
    command: Union[str, List[str]] = Field(description="The agent's command (a list, or a string split as a shell "
                                           "would); run once per prompt and generation. A first word 'python' is "
                                           "mtflow's own interpreter.")
    task: Literal['argument', 'stdin', 'file'] = Field('argument', description='How the task reaches it: the last '
                                                       'argument, its stdin, or a file named by MTFLOW_TASK_FILE.')
    task_template: str = Field('{prompt}', description="The task's text: {prompt} (the prompt's last user message), "
                               '{uuid} and data_dict keys.')
    concurrency: int = Field(4, ge=1, description='Episodes at once.')
    timeout_s: float = Field(600.0, gt=0, description="An episode's wall-clock limit: its whole process tree is "
                             'killed then (finish reason agent_timeout).')
    env: Dict[str, str] = Field(default_factory=dict, description='More environment variables for the agent.')
    cwd: Optional[str] = Field(None, description='Its working directory (default: the current one).')
    verifier: Union[str, VerifierCommand] = Field(description="The episode's reward: 'module:attr' called with the "
                                                  'episode (transcript, exit code, task, data), or {command: ...}.')
    verifier_timeout_s: float = Field(120.0, gt=0, description='How long the verifier may take.')

    @field_validator('command')
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if not value or (isinstance(value, list) and not all(isinstance(v, str) and v for v in value)):
            raise ValueError('must be a non-empty string or list of strings')
        return value
