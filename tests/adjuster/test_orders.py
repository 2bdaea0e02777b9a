"""The migration order: exact bytes, round trip, every malformed case, the sequencer."""

from __future__ import annotations

import json

import pytest

from sglang_rimuru.adjuster import (
    ORDER_TYPE,
    ORDER_VERSION,
    ExpertMove,
    MigrationOrder,
    OrderError,
    OrderSequencer,
    decode,
    encode,
)


def order(seq: int = 1, **kw) -> MigrationOrder:
    args = dict(version=ORDER_VERSION, seq=seq, round=41,
                evict=(ExpertMove(0, 2, (15, 16, 17)),),
                restore=(ExpertMove(2, 6, (54, 55, 56)), ExpertMove(2, 7, (57, 58, 59))),
                reason="kv_short: R_b=8 F_b=0 in_flight_pages=0")
    return MigrationOrder(**{**args, **kw})


def msg(**changes) -> dict:
    """The JSON object of ``order()``, with top-level fields replaced (None: removed)."""
    m = json.loads(encode(order()))
    for k, v in changes.items():
        if v is None:
            del m[k]
        else:
            m[k] = v
    return m


def raw(obj) -> bytes:
    return json.dumps(obj).encode()


def test_exact_bytes() -> None:
    assert encode(order()) == (
        b'{"type":"rimuru.migration_order","version":1,"seq":1,"round":41,'
        b'"evict":[{"layer":0,"expert":2,"pages":[15,16,17]}],'
        b'"restore":[{"layer":2,"expert":6,"pages":[54,55,56]},'
        b'{"layer":2,"expert":7,"pages":[57,58,59]}],'
        b'"reason":"kv_short: R_b=8 F_b=0 in_flight_pages=0"}')
    assert ORDER_TYPE == "rimuru.migration_order" and ORDER_VERSION == 1


@pytest.mark.parametrize("o", [
    order(),
    order(seq=7, evict=(), reason=""),
    order(restore=(), reason="low_water \u00e9\u4e2d"),
    order(evict=(), restore=()),
    order(seq=2**40, round=0),
])
def test_round_trip(o) -> None:
    back = decode(encode(o))
    assert back == o
    assert isinstance(back.evict, tuple) and isinstance(back.restore, tuple)
    assert all(isinstance(m.pages, tuple) for m in back.evict + back.restore)
    assert decode(bytearray(encode(o))) == o
    assert decode(memoryview(encode(o))) == o


def test_key_order_irrelevant_on_decode() -> None:
    m = msg()
    assert decode(raw(dict(reversed(list(m.items()))))) == order()


def _move(**kw) -> dict:
    return {"layer": 0, "expert": 2, "pages": [15, 16, 17], **kw}


# (bytes, a fragment the message must contain)
BAD = {
    "not json": (b"\x80\x81garbage", "not UTF-8 JSON"),
    "truncated json": (encode(order())[:30], "not UTF-8 JSON"),
    "pickle": (b"\x80\x04\x95\x05\x00\x00", "not UTF-8 JSON"),
    "NaN": (b'{"type": NaN}', "not UTF-8 JSON"),
    "duplicate key": (b'{"type":"rimuru.migration_order","type":"x"}', "duplicate key"),
    "not an object": (raw([1, 2, 3]), "expected a JSON object, got list"),
    "wrong type tag": (raw(msg(type="rimuru.stats")), "type is 'rimuru.stats'"),
    "no type tag": (raw(msg(type=None)), "type is None"),
    "unknown version": (raw(msg(version=2)), "unknown version 2"),
    "version bool": (raw(msg(version=True)), "unknown version True"),
    "version missing": (raw(msg(version=None)), "unknown version None"),
    "missing field": (raw(msg(round=None)), "missing field(s) ['round']"),
    "extra field": (raw({**msg(), "priority": 3}), "unknown field(s) ['priority']"),
    "seq string": (raw(msg(seq="1")), "seq must be an int >= 1, got '1'"),
    "seq zero": (raw(msg(seq=0)), "seq must be an int >= 1, got 0"),
    "seq bool": (raw(msg(seq=True)), "seq must be an int >= 1, got True"),
    "seq float": (raw(msg(seq=1.0)), "seq must be an int >= 1, got 1.0"),
    "round negative": (raw(msg(round=-1)), "round must be an int >= 0, got -1"),
    "reason not str": (raw(msg(reason=5)), "reason must be a string, got 5"),
    "evict not list": (raw(msg(evict={"layer": 0})), "evict must be a list of moves"),
    "move not object": (raw(msg(evict=[[0, 2, [1, 2, 3]]])), "evict[0] must be an object"),
    "move missing field": (raw(msg(evict=[{"layer": 0, "expert": 2}])),
                           "evict[0] is missing field(s) ['pages']"),
    "move extra field": (raw(msg(evict=[_move(matrix="w1")])),
                         "evict[0] has unknown field(s) ['matrix']"),
    "layer negative": (raw(msg(evict=[_move(layer=-3)])), "layer must be an int >= 0, got -3"),
    "expert bool": (raw(msg(restore=[_move(expert=False)])),
                    "expert must be an int >= 0, got False"),
    "expert string": (raw(msg(evict=[_move(expert="2")])), "expert must be an int >= 0, got '2'"),
    "pages not list": (raw(msg(evict=[_move(pages=15)])), "evict[0].pages must be a list, got 15"),
    "two pages": (raw(msg(evict=[_move(pages=[15, 16])])), "must be 3 distinct ints >= 0"),
    "four pages": (raw(msg(evict=[_move(pages=[15, 16, 17, 18])])), "got (15, 16, 17, 18)"),
    "repeated page": (raw(msg(restore=[_move(pages=[15, 15, 17])])), "got (15, 15, 17)"),
    "negative page": (raw(msg(restore=[_move(pages=[15, -1, 17])])), "got (15, -1, 17)"),
    "bool page": (raw(msg(restore=[_move(pages=[15, True, 17])])), "got (15, True, 17)"),
    "float page": (raw(msg(restore=[_move(pages=[15, 16.0, 17])])), "got (15, 16.0, 17)"),
    "expert twice in evict": (
        raw(msg(evict=[_move(), _move(pages=[1, 2, 3])], restore=[])),
        "layer 0 expert 2 is twice in evict"),
    "expert twice in restore": (
        raw(msg(evict=[], restore=[_move(), _move(pages=[1, 2, 3])])),
        "layer 0 expert 2 is twice in restore"),
    "evicted and restored": (
        raw(msg(evict=[_move()], restore=[_move(pages=[1, 2, 3])])),
        "layer 0 expert 2 is both evicted and restored"),
    "page in two moves": (
        raw(msg(evict=[_move()], restore=[_move(expert=5, pages=[3, 4, 15])])),
        "page 15 of restore layer 0 expert 5 is also a page of evict layer 0 expert 2"),
    "deep nesting": (b"[" * 100000 + b"]" * 100000, "not UTF-8 JSON"),
    "huge int": (b'{"seq": ' + b"9" * 5000 + b"}", "not UTF-8 JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_orders_are_refused_with_their_content(case) -> None:
    data, fragment = BAD[case]
    with pytest.raises(OrderError) as info:
        decode(data)
    text = str(info.value)
    assert text.startswith("bad migration order: ")
    assert fragment in text
    assert "received " + repr(data[:60])[:-1] in text  # the offending content, quoted
    assert len(text) < 1000  # truncated
    assert isinstance(info.value, ValueError)


def test_long_garbage_is_truncated() -> None:
    with pytest.raises(OrderError, match=r"received b'x{200}'\.\.\. \(10000 bytes\)$"):
        decode(b"x" * 10000)


def test_not_bytes() -> None:
    with pytest.raises(OrderError, match="expected bytes, got str"):
        decode(encode(order()).decode())  # type: ignore[arg-type]


@pytest.mark.parametrize("kw,fragment", [
    (dict(version=2), "unknown migration order version 2"),
    (dict(seq=0), "seq must be an int >= 1"),
    (dict(restore=(ExpertMove(0, 2, (1, 2, 3)),)), "both evicted and restored"),
    (dict(evict=((0, 2, (1, 2, 3)),)), "not an ExpertMove"),
])
def test_dataclass_enforces_the_same_rules(kw, fragment) -> None:
    with pytest.raises(OrderError, match=fragment):
        order(**kw)
    with pytest.raises(OrderError, match="3 distinct"):
        ExpertMove(0, 1, (4, 5, 4))


def test_sequencer_refuses_gaps_and_repeats_without_changing_state() -> None:
    s = OrderSequencer()
    assert s.last_seq == 0
    with pytest.raises(OrderError, match=r"seq=2 .* expected seq=1, orders 1\.\.1 are missing"):
        s.accept(order(seq=2))
    assert s.last_seq == 0
    s.accept(order(seq=1))
    assert s.last_seq == 1
    with pytest.raises(OrderError, match="seq=1 .*repeats or is older than the last accepted seq=1"):
        s.accept(order(seq=1))
    with pytest.raises(OrderError, match="expected seq=2, orders 2..4 are missing"):
        s.accept(order(seq=5))
    assert s.last_seq == 1
    s.accept(decode(encode(order(seq=2))))  # the right next order is still accepted
    s.accept(order(seq=3))
    assert s.last_seq == 3
    with pytest.raises(OrderError, match="seq=2 .*older than the last accepted seq=3"):
        s.accept(order(seq=2))
    with pytest.raises(OrderError, match="expected a MigrationOrder"):
        s.accept(encode(order(seq=4)))  # type: ignore[arg-type]
    assert s.last_seq == 3
