"""State that many orchestrator replicas share: warm-ahead cooldowns and leases, discovered windows, backend replicas
cooling off after an outage, and each conversation's home replica in a pool (placed in O(1), within a bound on active
conversations that each tenant may fill only its share of).

- :mod:`agentkv.state.protocol`: the :class:`StateStore` Protocol and its value types;
- :mod:`agentkv.state.memory`: :class:`InProcessStore`, one process's guards (the default);
- :mod:`agentkv.state.redis`: :class:`RedisStore`, the same guards for a fleet, through Redis;
- :mod:`agentkv.state.ejections`: :class:`Ejections`, which replicas of a backend pool are out (over any store).

    Session(fast, slow, state=RedisStore.from_url("redis://cache:6379/0", namespace="prod"))

See ``docs/replicas.md`` for the failure policy and the key layout.
"""

from agentkv._support.lazy import lazy_exports
from agentkv.state.ejections import DEFAULT_COOLOFF_S, Ejections, ejections_for
from agentkv.state.memory import InProcessStore
from agentkv.state.protocol import Lease, SharedWindow, StateStore, StateUnavailable, WarmClaim

__all__ = ["DEFAULT_COOLOFF_S", "Ejections", "InProcessStore", "Lease", "RedisStore", "SharedWindow", "StateStore",
           "StateUnavailable", "WarmClaim", "ejections_for"]


# redis-py is imported only by those who use it
__getattr__, __dir__ = lazy_exports(__name__, {"RedisStore": "agentkv.state.redis"}, globals(), __all__)
