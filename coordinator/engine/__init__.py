"""The coordinator's engine: the backbone forward pass (``model``), its ggml graphs (``block``),
the engine thread with slots and continuous batching (``runtime``) and sampling."""
