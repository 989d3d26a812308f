"""moe-swarm gateway: one OpenAI endpoint for every coordinator a market lists."""
