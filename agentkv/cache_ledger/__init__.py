"""What the prefix caches hold: a tenant-scoped ledger rebuilt from vLLM's KV events.

Needs pyzmq and msgspec (``pip install 'agentkv[kvevents]'``). See ``docs/ledger.md``.

Usage::

    from agentkv.cache_ledger import CacheLedger
    with CacheLedger([big_backend]) as ledger:
        ledger.resident_tokens(big_backend, token_ids, cache_salt)
    with CacheLedger.discover([fast, slow]) as ledger:     # endpoints from each server's GET /kv_event_sources
        ledger.subscription(slow)
"""

from __future__ import annotations

from agentkv.cache_ledger.hit_rate import HitCounters, HitRateCheck
from agentkv.cache_ledger.ledger import CacheLedger, LedgerStats, RankedBlock, TenantScopeError
from agentkv.cache_ledger.sources import Subscription
from agentkv.cache_ledger.tree import BlockTree

__all__ = ["BlockTree", "CacheLedger", "HitCounters", "HitRateCheck", "LedgerStats", "RankedBlock", "Subscription",
           "TenantScopeError"]
