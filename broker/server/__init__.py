"""The asyncio edge: listeners and per-connection protocols around the sans-IO core.

Public API (what peers and programs outside broker/ may use; everything else here is internal):
``ServerConfig``, ``BrokerServer``, ``new_event_loop``, and the in-process broker: ``ServerThread``
(a server whose loop waiting trainers run, else its daemon thread) and ``attach_trainer`` ->
``InProcessTrainer``."""

from broker.server.config import ServerConfig
from broker.server.inprocess import InProcessTrainer, ServerThread, attach_trainer
from broker.server.server import BrokerServer, new_event_loop

__all__ = ["BrokerServer", "InProcessTrainer", "ServerConfig", "ServerThread", "attach_trainer", "new_event_loop"]
