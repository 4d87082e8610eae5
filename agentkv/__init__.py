"""agentkv: fast/slow model routing for agents that never loses a turn at the moment of escalation."""

__version__ = "0.1.0"
