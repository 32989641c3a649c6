"""The scheduler of gateway sessions: the agent outside is the ``step``.

Each session is one request of the gateway's stream, driven by the engine's one loop
(``STATE_HANDLERS`` and the moves, as every request is):

* ``generating``: the model answers the session's current call (the run's ``rollout_fn``);
* ``on_turn_end``: the answer goes back to the waiting HTTP call (:meth:`SessionTable.reply`);
* ``tool_step``: the agent's own time; the step awaits the session's next event: a call (the
  next request, which either extends the conversation or starts a new exact segment, with its
  kind in the trace: :mod:`mtflow.gateway.history`), the client's finish (``done``: finish
  ``client_finished``, or the reason the caller gave, with the reward), or nothing for
  ``idle_timeout_s`` (``done``: finish ``idle_timeout``; the gateway sweeps the waiting steps); when the gateway stops, the request goes
  on unchanged into its next turn, where the stopping stream interrupts it;
* ``on_request_finished``: a limit, an error or an interrupt ended it: the call still waiting
  gets the error (:meth:`SessionTable.ended`).

The output's ``finish_reason`` never ends a session (``check_finished`` is false): a reply cut by
``max_tokens`` goes back as ``length`` and the agent decides.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from mtflow.accounting.token_record import record_of
from mtflow.core.machine import AGENT_TIMEOUT, CLIENT_FINISHED, IDLE_TIMEOUT
from mtflow.core.scheduler import Scheduler
from mtflow.gateway.history import transition
from mtflow.gateway.sessions import CLOSING, Finish, SessionTable
from mtflow.gateway.thinking import Thinking
from mtflow.gateway.wire import Reply, split_calls, structured_calls, unmet_tool_choice

__all__ = ['SessionScheduler']


class SessionScheduler(Scheduler):
    """See the module docstring. ``parser``: the tool-call parser (``None``: calls are never
    parsed); ``thinking``: how a reply's reasoning is split from its content."""
    finish_reasons = (CLIENT_FINISHED, IDLE_TIMEOUT, AGENT_TIMEOUT)

    def __init__(self, table: SessionTable, parser: Any, idle_timeout_s: Optional[float],
                 thinking: Optional[Thinking] = None) -> None:
        super().__init__()
        self.table = table
        self.parser = parser
        self.thinking = thinking or Thinking('none')
        self.idle_timeout_s = idle_timeout_s  # swept by the gateway's writer (SessionTable.idle)

    def check_finished(self, infer_request: Any, response_choice: Any, current_turn: int) -> bool:
        return False

    def on_turn_end(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        name = str(infer_request.uuid)
        message = response_choice.message
        text = message.content or ''
        thought = getattr(message, 'reasoning_content', None)  # the server split it (vLLM --reasoning-parser)
        reasoning, said = (thought, text) if isinstance(thought, str) else self.thinking.split(text)
        call = self.table.current_call(name)
        structured = getattr(message, 'tool_calls', None)  # the server parsed the calls (its tool-call parser)
        if structured:
            content, calls = said, structured_calls(structured, current_turn, name)
        else:
            parser = self.parser if call is None or call.tool_choice != 'none' else None
            content, calls = split_calls(said, parser, current_turn, name, infer_request.tools)
        record = record_of(infer_request)
        prompt = len(record.last_prompt) if record is not None else 0
        ids = response_choice.token_ids or []
        logprobs = response_choice.logprobs.get('content') if isinstance(response_choice.logprobs, dict) else None
        reply = Reply(text, content, calls, response_choice.finish_reason, prompt, len(ids), current_turn, reasoning,
                      logprobs)
        self.table.reply(name, reply, infer_request.messages, unmet_tool_choice(call, reply) if call else None)
        return {}

    async def step(self, infer_request: Any, response_choice: Any, current_turn: int) -> Dict[str, Any]:
        event = await self.table.next_event(str(infer_request.uuid))
        if event is None:
            return {'done': True, 'finish_reason': IDLE_TIMEOUT, 'trace_info': {'idle_timeout_s': self.idle_timeout_s}}
        if event is CLOSING:  # the gateway stops: the stream interrupts the request before its next turn
            return {'infer_request': infer_request, 'trace_info': {'gateway': 'closing'}}
        if isinstance(event, Finish):
            infos: Dict[str, Any] = {'gateway_finish': event.info}
            if event.reward is not None:
                infos['reward'] = event.reward
            return {'done': True, 'finish_reason': event.reason, 'rollout_infos': infos}
        change = transition(infer_request.messages, infer_request.tools, event.messages, event.tools,
                            infer_request.images, event.images)
        if change is None:
            infer_request.messages = event.messages
            infer_request.images = list(event.images)
            return {'infer_request': infer_request}
        nxt = infer_request.model_copy(update={'messages': event.messages, 'tools': event.tools,
                                               'images': list(event.images)})
        return {'infer_request': nxt, 'new_segment': change, 'trace_info': {'segment': change}}

    def on_request_finished(self, infer_request: Any, reason: str, turn: int) -> None:
        self.table.ended(str(infer_request.uuid), reason)
