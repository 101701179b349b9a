"""Tools: the :class:`Tool` API (``base``), tool-call parsing (``parsing``) and built-ins:
``calculator``, ``search`` (+ ``search_server``), ``python_sandbox`` (+ ``sandbox/``).
See docs/tools.md.
"""

from agentrl.tools.base import FunctionTool, Tool, ToolBox, ToolCall, ToolResult, tool

__all__ = ["FunctionTool", "Tool", "ToolBox", "ToolCall", "ToolResult", "tool"]
