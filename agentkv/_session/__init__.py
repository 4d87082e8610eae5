"""The Session and what it is made of (private: import ``Session``, ``Attempt`` and ``Observation`` from ``agentkv``).

One request, in the order it happens:

- :mod:`.driver`: :class:`Session`: its state (:mod:`.state`, one object) with the public methods on top;
- :mod:`.steps`: what a request goes through, as functions of that state: inputs (facts, counts), open, plan,
  warm-ahead, the handoff, the answer;
- :mod:`.decide`: THE decision: what a turn does next (send, hand off, recover, fail over, finish, give up);
- :mod:`.drive`: the one loop every entry point (``completion``, the OpenAI transport, the gateway) runs it in;
- :mod:`.reactive`: the next try after an overflow (clamp, escalate) or an outage (fail over);
- :mod:`.outside`: a request sent elsewhere (observe) or before it is counted (presend);
- :mod:`.attempts`: one try (:class:`Attempt`) and the request builders; :mod:`.inputs`: the facts and the checks;
- :mod:`.record`: stats and the turn ledger; :mod:`.prediction`: the cache ledger's prediction per request;
- :mod:`.warm_prefix`: the warm-prefix check at the move to slow.
"""

from agentkv._session.attempts import Attempt
from agentkv._session.drive import TurnEnd
from agentkv._session.driver import Session
from agentkv.protocols import Observation

__all__ = ["Attempt", "Observation", "Session", "TurnEnd"]
