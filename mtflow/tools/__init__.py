"""Tools for the YAML scheduler: the registry, the built-ins (``calculator``, ``python``) and the
concurrent runner. Importing this package is light; the sandbox starts processes only when used."""
from mtflow.tools.registry import (Tool, builtin_names, make_builtin, register_tool, resolve_ref, schema_from_callable,
                       tool_from_callable)
from mtflow.tools.runner import ToolError, ToolResult, ToolRunner, check_arguments, truncate

__all__ = [
    'Tool', 'ToolError', 'ToolResult', 'ToolRunner', 'builtin_names', 'check_arguments', 'make_builtin',
    'register_tool',
    'resolve_ref', 'schema_from_callable', 'tool_from_callable', 'truncate'
]
