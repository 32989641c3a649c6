"""Tools for the YAML scheduler: what a tool is (:mod:`.tool`), the names YAML can use
(:mod:`.registry`: the built-ins ``calculator`` and ``python``, :func:`register_tool`, entry
points), the concurrent runner (:mod:`.runner`) and the ``python`` tool's sandbox
(:mod:`.sandbox`, :mod:`.isolation`). Importing this package starts nothing: a sandbox process
starts only when the ``python`` tool runs."""
from mtflow.core.registry import resolve_reference as resolve_ref
from mtflow.tools.registry import builtin_names, make_builtin, register_tool
from mtflow.tools.runner import ToolError, ToolResult, ToolRunner, check_arguments, truncate
from mtflow.tools.tool import Tool, schema_from_callable, tool_from_callable

__all__ = [
    'Tool', 'ToolError', 'ToolResult', 'ToolRunner', 'builtin_names', 'check_arguments', 'make_builtin',
    'register_tool',
    'resolve_ref', 'schema_from_callable', 'tool_from_callable', 'truncate'
]
