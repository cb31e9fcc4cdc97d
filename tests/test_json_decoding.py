"""unpack_json decodes with orjson where that gives what the standard library gives, and otherwise with the
standard library: the same objects, the same refusals (64-bit integers, nesting, lone surrogates, NaN)."""

from __future__ import annotations

import json
import random

import pytest

from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.json_body import unpack_json
from broker.protocol.limits import INT_MAX, INT_MIN, MAX_NESTING


def random_texts(count: int) -> list[bytes]:
    rng = random.Random(7)
    texts = []
    for _ in range(count):
        floats = [rng.uniform(-1, 1) * 10 ** rng.randint(-30, 30) for _ in range(8)]
        written = [rng.choice([repr(x), f"{x:.15g}", f"{x:.17g}", f"{x:.9g}"]) for x in floats]
        ints = [str(rng.randint(-(10**18) + 1, 10**18 - 1)) for _ in range(4)]
        texts.append(
            f'{{"type": "step", "obs": [{{"obs": [{", ".join(written)}]}}], "n": [{", ".join(ints)}], '
            f'"s": "caf\\u00e9 \\ud83d\\ude00 \\"q\\" [{{", "done": [true, false, null]}}'.encode()
        )
    return texts


def test_ordinary_texts_decode_as_the_standard_library_decodes_them() -> None:
    for text in random_texts(300):
        assert unpack_json(text) == json.loads(text)
        assert unpack_json(memoryview(text)) == json.loads(text)


@pytest.mark.parametrize("value", [INT_MAX, INT_MIN, 10**18, -(10**18)])
def test_integers_of_19_digits_that_fit_64_bits_stay_exact(value: int) -> None:
    assert unpack_json(f'{{"a": {value}}}'.encode()) == {"a": value}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f'{{"a": {INT_MAX + 1}}}', "does not fit 64 bits"),
        (f'{{"a": {INT_MIN - 1}}}', "does not fit 64 bits"),
        ('{"a": "\\ud800"}', "lone surrogate"),
        ("[1, 2]", "must be an object"),
        ('{"a": 1', "undecodable"),
    ],
)
def test_refusals_are_the_standard_library_path_s(text: str, message: str) -> None:
    with pytest.raises(RemoteProtocolError) as refused:
        unpack_json(text.encode())
    assert refused.value.code is ErrorCode.MALFORMED and message in refused.value.message


def test_non_finite_numbers_decode_for_the_value_checks_to_refuse() -> None:
    # godot_rl's json.dumps writes NaN and Infinity; the legacy value checks refuse them with bad_step.
    decoded = unpack_json(b'{"a": NaN, "b": Infinity, "c": 1e400}')
    assert all(v != v or abs(v) == float("inf") for v in decoded.values())


def nested(depth: int, inside: str = "1") -> bytes:
    text = inside
    for level in range(depth - 1):
        text = f'{{"k": {text}}}' if level % 2 else f"[{text}, 2]"
    return f'{{"a": {text}, "s": "[[[[{{{{"}}'.encode()


def test_nesting_up_to_the_limit_decodes_and_one_more_level_is_refused() -> None:
    assert unpack_json(nested(MAX_NESTING)) == json.loads(nested(MAX_NESTING))
    with pytest.raises(RemoteProtocolError) as refused:
        unpack_json(nested(MAX_NESTING + 1))
    assert "nests deeper" in refused.value.message
    wide = b'{"rows": [' + b", ".join([b'{"obs": [[0, 1], [2]]}'] * 500) + b"]}"  # many brackets, 5 deep
    assert unpack_json(wide) == json.loads(wide)


def test_brackets_that_do_not_pair_up_are_traced_as_before() -> None:
    with pytest.raises(RemoteProtocolError) as refused:
        unpack_json(b'{"a": ' + b"[" * (MAX_NESTING + 5) + b"}" * (MAX_NESTING + 5) + b"}")
    assert "nests deeper" in refused.value.message
