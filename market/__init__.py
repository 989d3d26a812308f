"""The demand market: the control plane of moe-swarm (DESIGN §6).

Pure decisions live in ``market.core`` (demand, assignment, recruitment and age-out, registry,
dispatch-map wiring, heartbeat directives, download sources); ``market.policy`` holds their
parameters; ``market.indexes`` keeps the in-memory indexes they read; ``market.state`` handles
requests by driving the cores and writing what they decide; ``market.views`` builds the read
views; ``market.store`` keeps the durable facts (SQLite, WAL); ``market.api`` /
``market.server`` / ``market.loops`` are the HTTP and trio shell; ``market.cli`` adds
``moe-swarm market``.
"""

__all__: list[str] = []
