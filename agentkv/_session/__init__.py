"""The Session and what it is made of (private: import ``Session`` and ``Observation`` from ``agentkv``).

- :mod:`.driver`: :class:`Session`, the sync and async drivers, on top of :mod:`.external` (requests its caller
  sends: observe, prepare, recover, answered, route, count), :mod:`.reactive` (overflow recovery, failover) and
  :mod:`.core` (state, gathering inputs, planning, warm-ahead, the answer);
- :mod:`.prediction`: the ledger's cached-token prediction per request;
- :mod:`.attempts`: one try at sending (:class:`Attempt`), :class:`Observation`, the request builders;
- :mod:`.responses`: cached tokens from responses and streams;
- :mod:`.record`: stats, ledger and the role of the last answered request;
- :mod:`.decide`: the one decision of what a turn does next; :mod:`.drive`: the loop every entry point runs it in;
- :mod:`.warm_prefix`: the warm-prefix check at the move to slow (the KV handoff is :class:`agentkv.Handoff`).
"""

from agentkv._session.attempts import Attempt
from agentkv._session.drive import TurnEnd
from agentkv._session.driver import Session
from agentkv.protocols import Observation

__all__ = ["Attempt", "Observation", "Session", "TurnEnd"]
