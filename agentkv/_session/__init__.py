"""The Session and what it is made of (private: import ``Session``, ``Attempt`` and ``Observation`` from ``agentkv``).

One request, in the order it happens:

- :mod:`.session`: :class:`Session`, holding its parts (:mod:`.parts`) behind the public methods, each a machine
  run by the sync or the async driver (:mod:`agentkv._support.effects`);
- :mod:`.turn`: THE turn, written once: its opening (facts, count, plan, warm-ahead) and the loop that does what
  :mod:`.decide` says (send with retries, hand off, recover, fail over, finish, give up);
- :mod:`.gather`: the turn's inputs through the seams (window facts, counts, a pool's replicas and their health);
- :mod:`.steps`: open, plan, the next step, the handoff, the answer; :mod:`.reactive`: the next try after an overflow
  (clamp, escalate) or an outage (fail over);
- :mod:`.warming`: warm-ahead at a turn; :mod:`.outside`: a request sent elsewhere (observe) or before it is counted
  (presend), and what a request sent outside agentkv must carry;
- :mod:`.attempts`: one try (:class:`Attempt`) and the request builders; :mod:`.inputs`: the facts and the checks;
- :mod:`.pipeline`: each thing that happens in a turn (routed, warmed, recovered, failed over, handed off, answered,
  failed) as one event through the Session's processors (:mod:`.processors`: stats, the structlog event, the span,
  what an answer teaches, a managed API's dollars);
- :mod:`.record`: stats and the turn ledger; :mod:`.prediction`: the cache ledger's prediction per request;
  :mod:`.warm_prefix`: the warm-prefix check at the move to slow; :mod:`.hosted`: a managed slow model's share of a
  warm (its cacheable minimum, its premium, the cost gate's tally).
"""

from agentkv._session.attempts import Attempt
from agentkv._session.session import Session
from agentkv._session.turn import TurnEnd
from agentkv.protocols import Observation

__all__ = ["Attempt", "Observation", "Session", "TurnEnd"]
