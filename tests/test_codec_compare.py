"""benchmarks/codec_compare.py compares like with like: msgspec's Structs read and write the very bytes of the
present codec, to the same arrays, and its table has one row per message and size (no timing asserted)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("msgspec", reason="benchmarks.codec_compare compares against msgspec")

from benchmarks import codec_compare
from broker.protocol.codec import pack
from broker.protocol.errors import RemoteProtocolError


@pytest.mark.parametrize(("agents", "floats"), [(1, 8), (16, 64), (400, 64)])
def test_both_codecs_read_each_others_bytes(agents: int, floats: int) -> None:
    for message in codec_compare.sample_messages(agents, floats).values():
        codec_compare.check_same_bytes_meaning(message)


def test_the_msgspec_side_makes_the_array_checks_of_the_present_one() -> None:
    step = codec_compare.sample_messages(4, 8)["step"]
    wire = step.to_wire()
    wire["groups"]["p"]["reward"]["data"] = bytes(wire["groups"]["p"]["reward"]["data"])[:-4]  # one float short
    with pytest.raises(RemoteProtocolError, match="does not match its bytes"):
        codec_compare.struct_to_message(codec_compare.DECODER.decode(pack(wire)))
    nan = codec_compare.sample_messages(4, 8)["batch"]
    nan.data.reward[0] = np.nan
    with pytest.raises(RemoteProtocolError, match="finite"):
        codec_compare.struct_to_message(codec_compare.DECODER.decode(pack(nan.to_wire())))


def test_the_table_has_a_row_per_message_and_size() -> None:
    rows = codec_compare.measure([(1, 8)], repeat=1)
    assert [row["message"] for row in rows] == ["step", "act", "batch"]
    text = codec_compare.table(rows)
    assert text.count("\n| 1x8 |") == 3
