"""A tau-bench-style customer-service episode (``schedulers/episodes/tau_retail.yaml``, docs/multi-agent.md):
the shop's tools, a scripted assistant and a scripted customer (stand-ins for models, so that the
example and its tests need none), the judge's scripted verdict, and the task's reward.

The task (a line of ``configs/tau_tasks.jsonl``): the customer wants a refund for an order; the
assistant must look the order up and refund it (its tools, ``schedulers/episodes/tau_assistant.yaml``).
The reward, as tau-bench gives it, is the outcome: 1.0 when the assistant's tool calls refunded
exactly the task's order, else 0.0; the judge adds its score of the conversation.
"""
from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Tuple

#: the shop's orders (the tools read them; a refund never changes them: each episode starts alike)
ORDERS: Dict[str, Dict[str, Any]] = {
    '1042': {'item': 'blue kettle', 'price': 30, 'status': 'delivered'},
    '2077': {'item': 'desk lamp', 'price': 45, 'status': 'delivered'},
    '3100': {'item': 'garden hose', 'price': 18, 'status': 'shipped'},
}


def lookup_order(order_id: str) -> str:
    """Look an order up by its number.

    Args:
        order_id: the order number, e.g. "1042".
    """
    order = ORDERS.get(str(order_id).lstrip('#'))
    if order is None:
        return f'No order #{order_id}.'
    return f'Order #{order_id}: {order["item"]}, ${order["price"]}, {order["status"]}.'


def refund(order_id: str) -> str:
    """Refund a delivered order.

    Args:
        order_id: the order number, e.g. "1042".
    """
    order = ORDERS.get(str(order_id).lstrip('#'))
    if order is None:
        return f'Refund refused: no order #{order_id}.'
    if order['status'] != 'delivered':
        return f'Refund refused: order #{order_id} is {order["status"]}, not delivered.'
    return f'Refunded order #{order_id}: ${order["price"]}.'


def _call(name: str, **arguments: Any) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def assistant(request: Any) -> str:
    """A scripted assistant: asks for the order number, looks the order up, refunds it, says so."""
    last = request.messages[-1]
    text = str(last.get('content') or '')
    if last['role'] == 'tool':
        if text.startswith('Refunded'):
            return f'Done: {text} Is there anything else?'
        number = re.search(r'#(\d+)', text)
        if text.startswith('Order') and number:
            return _call('refund', order_id=number.group(1))
        return f'I am sorry: {text}'
    number = re.search(r'\b(\d{4})\b', text)
    return _call('lookup_order', order_id=number.group(1)) if number else 'Could you tell me your order number?'


def customer(request: Any) -> str:
    """A scripted customer: states its goal (from its opening observation), gives the order number
    when asked, thanks and stops once the refund is done."""
    goal = re.search(r'order #?(\d+)', str(request.messages[1]['content']) if len(request.messages) > 1 else '')
    order = goal.group(1) if goal else '0000'
    said = [m for m in request.messages if m['role'] == 'assistant']
    heard = str(request.messages[-1].get('content') or '')
    if not said:
        return 'Hi, my kettle arrived broken and I would like my money back.'
    if 'Refunded' in heard or 'Done' in heard:
        return 'Thank you, that is all. ###STOP###'
    return f'It is order {order}.'


def judge(request: Any) -> str:
    """The judge's scripted verdict: a high score when the transcript shows a refund."""
    return 'Score: 9' if 'Refunded order' in str(request.messages[-1]['content']) else 'Score: 2'


def reward(episode: Any, transcript: List[Tuple[Any, Any]]) -> Dict[str, float]:
    """1.0 for the assistant when one of its tool results refunded exactly the task's order."""
    wanted = f'Refunded order #{episode.data["order_id"]}'
    done = any(wanted in str(m.get('content')) for seat, action in transcript if seat == 'assistant'
               for m in getattr(action, 'messages', []) if m.get('role') == 'tool')
    return {'assistant': 1.0 if done else 0.0}
