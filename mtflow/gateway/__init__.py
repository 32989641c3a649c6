"""The gateway: train any agent, unchanged, by recording its model calls as exact-token trajectories.

An OpenAI- and Anthropic-compatible HTTP endpoint in front of any mtflow backend whose sessions
are request machines of the engine's one loop (``docs/gateway.md``): :class:`Gateway` in Python,
``mtflow gateway CONFIG`` on the command line, and ``mtflow run`` with an ``agent:`` section
(:func:`run_agents`) to start an agent command per prompt against its own session.
"""
from mtflow.gateway.gateway import SESSIONS_FILE, Gateway, sessions_opened
from mtflow.gateway.history import KINDS, transition
from mtflow.gateway.sessions import Finish, Session, SessionTable
from mtflow.gateway.wire import WireError

__all__ = ['Gateway', 'SESSIONS_FILE', 'sessions_opened', 'KINDS', 'transition', 'Finish', 'Session', 'SessionTable',
           'WireError']
