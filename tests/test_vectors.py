"""The shared test vectors: every frame decodes to its stated meaning and re-encodes to the same bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.protocol.codec import BodyKind, body_kind, decode_body, encode_body
from broker.protocol.framing import FrameDecoder, encode_frame
from broker.protocol.messages import message_from_wire
from tests.vectors import generate

VECTORS = Path(__file__).parent / "vectors" / "protocol_v1.json"
DATA = json.loads(VECTORS.read_text())


def from_meaning(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__array__"}:
            a = value["__array__"]
            array = np.array(a["values"], dtype=a["dtype"]).reshape(a["shape"])
            return {"dtype": a["dtype"], "shape": a["shape"], "data": array.tobytes()}
        return {(int(k) if k.isdigit() else k): from_meaning(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_meaning(v) for v in value]
    return value


def test_vectors_file_is_up_to_date() -> None:
    assert VECTORS.read_text() == generate.render(), "run: python tests/vectors/generate.py"


@pytest.mark.parametrize("vector", DATA["vectors"], ids=lambda v: v["name"])
def test_vector_decodes_to_its_meaning(vector: dict[str, Any]) -> None:
    decoder = FrameDecoder()
    decoder.feed(bytes.fromhex(vector["hex"]))
    body = decoder.next_frame()
    assert body is not None and decoder.buffered_bytes == 0
    kind = body_kind(body)
    assert kind.value == vector["codec"]
    wire = decode_body(kind, body)
    if kind is BodyKind.JSON:
        assert wire == vector["meaning"]
        return
    message = message_from_wire(wire)  # typed and validated
    assert generate.meaning(message.to_wire()) == vector["meaning"]


@pytest.mark.parametrize("vector", [v for v in DATA["vectors"] if v["codec"] == "msgpack"], ids=lambda v: v["name"])
def test_vector_meaning_encodes_to_its_bytes(vector: dict[str, Any]) -> None:
    wire = from_meaning(vector["meaning"])
    assert encode_frame(encode_body(BodyKind.MSGPACK, wire)).hex() == vector["hex"]
