"""The market's pure cores: no I/O, no clock, no global randomness (``now`` and an ``Rng`` are given).

- ``records``: the durable facts as frozen Structs.
- ``demand``: targets, replica/pending counts, scarcity, demand segments.
- ``assign``: the scarcest slice that fits a volunteer's budget.
- ``recruit``: saturation (the one rule), recruitment hysteresis, age-out planning.
- ``registry``: heartbeat freshness (epoch / sequence), expiry, coverage diffs.
- ``directive``: the keep / drain / release answer per reported slice, with its reason.
- ``sources``: which coordinators a volunteer downloads its slice from, best first.
- ``wiring``: dispatch-map layers from what volunteers serve.
"""

__all__: list[str] = []
