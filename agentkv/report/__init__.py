"""One picture of a conversation's life: its turn ledger written as JSON lines (``Session.write_ledger``), read back
and drawn by ``agentkv report`` (tokens per turn against fast's window, where routing leaves fast, the warm-ahead
line; the route of each turn, the warm, the escalation, the cached tokens).

- :mod:`agentkv.report.lines`: the input read line by line, bounded, and parsed strictly;
- :mod:`agentkv.report.ledger`: the file format and the report's data (pure);
- :mod:`agentkv.report.plot`: the picture (matplotlib, imported when drawing), its columns bounded whatever the rows;
- :mod:`agentkv.report.cli`: ``agentkv report``.
"""

from agentkv.report.ledger import ConversationLife, life_of, read_ledger, write_ledger
from agentkv.report.lines import ReportError

__all__ = ["ConversationLife", "ReportError", "life_of", "read_ledger", "write_ledger"]
