"""The Session and what it is made of (private: import ``Session`` and ``Observation`` from ``agentkv``).

- :mod:`.driver`: :class:`Session`, the sync and async drivers, on top of :mod:`.external` (requests its caller
  sends: observe, prepare, recover, answered, route, count), :mod:`.reactive` (overflow recovery, failover) and
  :mod:`.core` (state, gathering inputs, planning, warm-ahead, the answer);
- :mod:`.prediction`: the ledger's cached-token prediction per request;
- :mod:`.attempts`: one try at sending (:class:`Attempt`), :class:`Observation`, the request builders;
- :mod:`.responses`: cached tokens from responses and streams;
- :mod:`.record`: stats, ledger and the role of the last answered request;
- :mod:`.escalation`: KV handoff and the warm-prefix check at the move to slow.
"""

from agentkv._session.attempts import Observation
from agentkv._session.driver import Session

__all__ = ["Observation", "Session"]
