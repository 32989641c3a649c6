"""Multi-agent episodes: several roles and policies in one episode, each role's trajectory exact,
each role its own credit (``docs/multi-agent.md``).

- :class:`Role`, :func:`self_play`: the roles of an episode (policy id, sampling, train flag,
  own scheduler, persona);
- :class:`EpisodeEnv`, :class:`EpisodeStep`, :class:`EpisodeInfo`: the episode environment's
  interface (reset, who acts, step with each role's output, per-role rewards), checked at load;
- :class:`EpisodeScheduler`: the scheduler that runs every role of every episode as a request of
  the one engine (a role waiting for the others rests in ``tool_step``);
- :func:`episode_requests`: one request per role of each episode of each prompt;
- :class:`PolicyRouter`: the ``rollout_fn`` that sends each role's turns to its policy.
"""
from mtflow.roles.env import Action, EpisodeEnv, EpisodeEnvError, EpisodeInfo, EpisodeStep, check_episode_env
from mtflow.roles.requests import episode_requests, iter_episode_requests
from mtflow.roles.role import Role, RoleError, Seat, seat_of, self_play
from mtflow.roles.router import PolicyRouter
from mtflow.roles.scheduler import EpisodeScheduler

__all__ = ['Action', 'EpisodeEnv', 'EpisodeEnvError', 'EpisodeInfo', 'EpisodeScheduler', 'EpisodeStep', 'PolicyRouter', 'Role',
           'RoleError', 'Seat', 'check_episode_env', 'episode_requests', 'iter_episode_requests', 'seat_of',
           'self_play']
