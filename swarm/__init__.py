"""moe-swarm: the shared library of every role (``swarm.cli`` is the command line)."""

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)
