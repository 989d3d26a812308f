"""The demand market: the control plane of moe-swarm (DESIGN §6).

Pure decisions live in ``market.core`` (demand, assignment, recruitment and age-out, registry,
dispatch-map wiring); ``market.state`` keeps the indexes and drives them; ``market.store`` keeps
the durable facts (SQLite, WAL); ``market.api`` / ``market.server`` / ``market.loops`` are the
HTTP and trio shell; ``market.cli`` adds ``moe-swarm market``.
"""

__all__: list[str] = []
