"""Broker logic: plain Python and numpy, no transports, no asyncio."""
