"""Peers of the broker: trainer VecEnvs, the Python game client and the simulated game."""

from clients.errors import BrokerError

__all__ = ["BrokerEnv", "BrokerError", "BrokerVecEnv", "GameClient"]


def __getattr__(name: str) -> object:
    # Lazy so that games and the broker do not import gymnasium and stable-baselines3.
    if name in ("BrokerVecEnv", "BrokerEnv"):
        from clients import vec_env

        return getattr(vec_env, name)
    if name == "GameClient":
        from clients.game import GameClient

        return GameClient
    raise AttributeError(name)
