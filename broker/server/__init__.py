"""The asyncio edge: listeners and per-connection protocols around the sans-IO core."""
