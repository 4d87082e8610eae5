"""Real agent workloads for the benchmarks: AgentDojo's four suites as multi-turn tool conversations.

``load.py`` builds (once, in a venv of its own) and loads them; ``agentdojo_build.py`` is the builder. The format
is described in ``benchmarks/README.md`` ("A real agent workload: AgentDojo").
"""
