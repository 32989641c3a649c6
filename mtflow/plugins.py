"""Plugins the ecosystem's way: tools, parsers and environments from installed packages.

A package declares them as entry points (``pyproject.toml``)::

    [project.entry-points."mtflow.tools"]
    weather = "my_pkg.tools:weather"          # a tool callable, used as ``builtin: weather``
    [project.entry-points."mtflow.parsers"]
    my_format = "my_pkg.parsing:MyParser"     # a ToolCallParser factory, ``parser: my_format``
    [project.entry-points."mtflow.envs"]
    maze = "my_pkg.envs:MazeEnv"              # an environment class, ``env: {impl: maze}``

An entry point whose value is a bare module (``"my_pkg.register"``) is imported for its
``register_tool`` / ``register_parser`` / ``register_env`` calls. Nothing is imported until a
config names the entry point: a broken plugin that no config uses costs nothing, and the names
are still listed in "unknown tool" messages. A YAML file's ``plugins: [module, ...]`` key imports
modules (next to the YAML too) before the rest of the file is checked, so the ``register_*``
decorators of a user's module work from the CLI.

The machinery is :class:`mtflow.core.registry.Registry`, one per group, each owned by the module
of its kind (:data:`TOOLS`, :data:`PARSERS`, :data:`ENVS`); this module is its public face.
"""
from __future__ import annotations

from mtflow.core.registry import (Registry, entry_point_names, import_plugins, load_entry_point, loaded_entry_points,
                                  refresh_entry_points)
from mtflow.declarative.gym import ENVS
from mtflow.declarative.parsers import PARSERS
from mtflow.tools.registry import TOOLS

__all__ = ['GROUPS', 'entry_point_names', 'load_entry_point', 'loaded_entry_points', 'import_plugins',
           'refresh_entry_points', 'Registry', 'TOOLS', 'PARSERS', 'ENVS']

#: the entry-point groups mtflow reads
GROUPS = (TOOLS.group, PARSERS.group, ENVS.group)
