"""The built-in ``calculator`` tool: arithmetic on an expression string, evaluated by walking its
AST. Never ``eval``: only numbers, arithmetic operators and a short list of math functions are
accepted, and exponents and results are bounded so a model cannot make the tool hang or allocate
gigabytes (``9**9**9``)."""
from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable, Dict, Union

Number = Union[int, float]

MAX_EXPRESSION_CHARS = 500
MAX_EXPONENT = 1000
MAX_ABS_RESULT = 10**100

_BINARY: Dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: Dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: Dict[str, Callable[..., Any]] = {
    'abs': abs, 'round': round, 'min': min, 'max': max, 'sqrt': math.sqrt, 'log': math.log,
    'log10': math.log10, 'log2': math.log2, 'exp': math.exp, 'sin': math.sin, 'cos': math.cos,
    'tan': math.tan, 'floor': math.floor, 'ceil': math.ceil, 'factorial': math.factorial,
}
_CONSTANTS: Dict[str, float] = {'pi': math.pi, 'e': math.e}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its value is out of bounds."""


def _check(value: Any) -> Number:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError(f'not a number: {value!r}')
    if isinstance(value, int) and abs(value) > MAX_ABS_RESULT:
        raise CalculatorError('result too large')
    return value


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        return _check(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f'exponent {right} is larger than {MAX_EXPONENT}')
        try:
            return _check(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError('division by zero') from None
        except OverflowError:
            raise CalculatorError('result too large') from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        args = [_eval(a) for a in node.args]
        if node.func.id == 'factorial' and args and args[0] > 500:
            raise CalculatorError('factorial argument larger than 500')
        try:
            return _check(_FUNCTIONS[node.func.id](*args))
        except (ValueError, TypeError, OverflowError) as exc:
            raise CalculatorError(f'{node.func.id}: {exc}') from None
    raise CalculatorError(f'unsupported syntax: {ast.unparse(node)[:80]}')


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression (``+ - * / // % **``, parentheses, ``pi``, ``e`` and
    ``sqrt``, ``log``, ``sin``, ... ). Raises :class:`CalculatorError` for anything else."""
    if not isinstance(expression, str):
        raise CalculatorError(f'expression must be a string, got {type(expression).__name__}')
    expression = expression.strip().replace('^', '**').replace('×', '*').replace('÷', '/')
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f'expression longer than {MAX_EXPRESSION_CHARS} characters')
    try:
        tree = ast.parse(expression, mode='eval')
    except SyntaxError as exc:
        raise CalculatorError(f'invalid expression: {exc.msg}') from None
    return _eval(tree)


def format_number(value: Number) -> str:
    """Integers as integers, floats without float noise (``0.1 + 0.2`` -> ``0.3``)."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e16:
            return str(int(value))
        return f'{value:.12g}'
    return str(value)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: the arithmetic expression, e.g. "(2 + 3) * 4 / 5" or "sqrt(2) ** 2".
    """
    return format_number(evaluate(expression))
