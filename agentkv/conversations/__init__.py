"""Many conversations through one object: a conversation's identity, the bounded map of their Sessions, and
:class:`Conversations`, which an integration (or the gateway) asks for each request's Session.

    from agentkv import Conversations
    from agentkv.conversations import session_of

    convs = Conversations(fast, slow, tenant="acme", cache_salt_secret=secret)
    session = session_of(convs, conversation=thread_id, body={"messages": messages, "tools": tools})
"""

from agentkv.conversations.conversations import LEDGER_ROWS, Conversations, session_of
from agentkv.conversations.identity import PROMPT_OPENING, conversation_id, fingerprint, opening_messages, session_id
from agentkv.conversations.sessions import SessionMap

__all__ = ["LEDGER_ROWS", "PROMPT_OPENING", "Conversations", "SessionMap", "conversation_id", "fingerprint",
           "opening_messages", "session_id", "session_of"]
