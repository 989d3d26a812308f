"""The coordinator's HTTP API: the OpenAI-compatible app, its typed bodies and the slice routes."""
