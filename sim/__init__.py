"""The deterministic simulator of a swarm at scale (application layer: drives the roles' pure cores).

``sim.engine`` runs a scenario (``sim.scenario``) in logical time over the real market
(``market.state.Market`` with an in-memory store) and the real volunteer lifecycle
(``volunteer.core.lifecycle``); ``sim.metrics`` measures it; ``sim.cli`` adds ``moe-swarm simulate``.
Like ``swarm``'s application layer it may import the roles; no role and no ``swarm`` module imports it.
It stays torch-free (``tests/unit/test_layers.py``).
"""

__all__: list[str] = []
