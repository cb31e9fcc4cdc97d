"""Bounds on the work one frame may cost to decode, the same for every body codec (msgpack, Godot Variant,
godot_rl JSON), and on what a peer's free-form values (infos) may hold so that every codec the broker
forwards them in can carry them. ``docs/reliability.md`` (section "Decoder limits") lists them.

The element and depth bounds are checked while a body is decoded, before its objects are built, so a frame
of millions of empty maps or a thousand nested arrays is refused at the cost of a scan, not of building it.
"""

from __future__ import annotations

from typing import Final

# Values (scalars and containers, at every level) one frame body may hold. Arrays travel as one binary
# value each, so a native step of any size needs a few dozen; the bound is for infos and godot_rl JSON,
# whose observations are number lists (64 agents x 4,000 numbers fit).
MAX_FRAME_ELEMENTS: Final = 1 << 18
# Containers nested in one body (the body itself is level 1). Messages nest at most 7 deep; 32 is also
# the depth a Godot Variant message may have, so a body accepted here can be re-encoded for the addon.
MAX_NESTING: Final = 32
# Integers anywhere in a message: what every codec can carry (Godot's int and msgpack's signed int64).
INT_MIN: Final = -(1 << 63)
INT_MAX: Final = (1 << 63) - 1
# The most decimal digits a JSON integer may have before it is even converted (a 64-bit int has 19).
MAX_JSON_INT_DIGITS: Final = 20
# Nesting inside one agent's info map (the map is level 1). An info sits 3 levels deep in a batch, so this
# keeps a forwarded batch within MAX_NESTING with room to spare.
MAX_INFO_NESTING: Final = 16
MAX_GROUPS: Final = 64  # agent groups (policies) in one game
MAX_CLAIM: Final = 4096  # games one sampler may claim
