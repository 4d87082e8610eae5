"""One picture of a conversation's life: its turn ledger written as JSON lines (``Session.write_ledger``), read back
and drawn by ``agentkv report`` (tokens per turn against fast's window, where routing leaves fast, the warm-ahead
line; the route of each turn, the warm, the escalation, the cached tokens).

- :mod:`agentkv.report.ledger`: the file format and the report's data (pure);
- :mod:`agentkv.report.plot`: the PNG (matplotlib, imported when drawing);
- :mod:`agentkv.report.cli`: ``agentkv report``.
"""

from agentkv.report.ledger import ConversationLife, life_of, read_ledger, write_ledger

__all__ = ["ConversationLife", "life_of", "read_ledger", "write_ledger"]
