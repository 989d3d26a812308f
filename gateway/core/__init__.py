"""The gateway's pure cores (no clock, I/O or trio)."""
