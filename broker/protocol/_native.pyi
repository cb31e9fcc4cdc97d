"""Types of the C codec (broker/protocol/_native.c); hot.py and spaces.py are its only users."""

from typing import Any

def configure(
    step_data: type,
    game_step: type,
    batch: type,
    act: type,
    actions: type,
    dtypes: dict[str, Any],
    limits: dict[str, int],
) -> None: ...
def decode(body: Any) -> Any: ...
def encode(message: Any, min_bytes: int, writable_too: bool) -> list[Any] | None: ...
def all_finite(array: Any) -> bool | None: ...
