"""The migration order: scheduler -> TP worker(s), over ZMQ (DESIGN §2 step 3, §5).

A versioned, typed message, serialised as UTF-8 JSON (never pickle: the worker
must be able to refuse garbage without running it)::

    {"type": "rimuru.migration_order", "version": 1, "seq": 7, "round": 1042,
     "evict":   [{"layer": 0, "expert": 2, "pages": [15, 16, 17]}],
     "restore": [{"layer": 2, "expert": 6, "pages": [54, 55, 56]}],
     "reason":  "high_water: R_b=0 F_b=26 in_flight_pages=0"}

``pages`` are expert-page ids of the unified pool in slot order (W1, W3, W2):
for an eviction the pages the expert gives up (freed by the worker's side only
after the forward pass that may still read them); for a restore the pages
already RESERVED for it in the scheduler's pool, which the worker copies into.

``decode`` raises ``OrderError`` (a ``ValueError``) naming the problem and
quoting the received bytes (truncated) for: not UTF-8 JSON, a wrong ``type``
tag, an unknown ``version``, a missing or extra field, a wrong type (a bool is
not an int), a negative id, ``pages`` not exactly 3 distinct ints >= 0, one
page in two moves, one expert twice in ``evict`` or in ``restore``, or one
expert in both.  The dataclasses enforce the same rules when built directly.

``OrderSequencer`` (receiving side): ``seq`` starts at 1 and goes up by one per
order from one scheduler; a gap or a repeat is refused without changing state.

Standard library only.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

__all__ = [
    "ORDER_TYPE",
    "ORDER_VERSION",
    "ExpertMove",
    "MigrationOrder",
    "OrderError",
    "OrderSequencer",
    "decode",
    "encode",
]

#: The protocol version this build writes and reads.
ORDER_VERSION = 1
#: The ``type`` tag of every migration order.
ORDER_TYPE = "rimuru.migration_order"

_ORDER_KEYS = ("type", "version", "seq", "round", "evict", "restore", "reason")
_MOVE_KEYS = ("layer", "expert", "pages")
_SNIPPET = 200  # characters of the received message quoted in an error


class OrderError(ValueError):
    """A migration order is malformed, of an unknown version, or out of sequence."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(v: object, limit: int = _SNIPPET) -> str:
    """``repr(v)`` cut to about ``limit`` characters (bytes are cut before ``repr``)."""
    if isinstance(v, (bytes, bytearray)) and len(v) > limit:
        return f"{bytes(v[:limit])!r}... ({len(v)} bytes)"
    s = repr(v)
    return s if len(s) <= limit else f"{s[:limit]}... ({len(s)} chars)"


@dataclasses.dataclass(frozen=True)
class ExpertMove:
    """One expert of one MoE layer and its three expert pages (W1, W3, W2)."""

    layer: int
    expert: int
    pages: tuple[int, int, int]

    def __post_init__(self) -> None:
        for name in ("layer", "expert"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise OrderError(f"{name} must be an int >= 0, got {_short(v)}")
        pages = self.pages
        if (not isinstance(pages, (list, tuple)) or len(pages) != 3
                or not all(_is_int(p) and p >= 0 for p in pages) or len(set(pages)) != 3):
            raise OrderError(f"pages of layer {self.layer} expert {self.expert} must be 3 distinct "
                             f"ints >= 0 (W1, W3, W2), got {_short(pages)}")
        object.__setattr__(self, "pages", tuple(pages))

    @property
    def key(self) -> tuple[int, int]:
        return (self.layer, self.expert)


@dataclasses.dataclass(frozen=True)
class MigrationOrder:
    """Experts leaving and entering the pool, decided in scheduling round ``round``.

    ``seq`` is 1, 2, 3, ... per scheduler; ``version`` is ``ORDER_VERSION``.
    An expert appears at most once in the whole order and a page at most once.
    """

    version: int
    seq: int
    round: int
    evict: tuple[ExpertMove, ...]
    restore: tuple[ExpertMove, ...]
    reason: str

    def __post_init__(self) -> None:
        if not _is_int(self.version) or self.version != ORDER_VERSION:
            raise OrderError(f"unknown migration order version {_short(self.version)}; "
                             f"this build speaks version {ORDER_VERSION}")
        if not _is_int(self.seq) or self.seq < 1:
            raise OrderError(f"seq must be an int >= 1, got {_short(self.seq)}")
        if not _is_int(self.round) or self.round < 0:
            raise OrderError(f"round must be an int >= 0, got {_short(self.round)}")
        if not isinstance(self.reason, str):
            raise OrderError(f"reason must be a string, got {_short(self.reason)}")
        seen_expert: dict[tuple[int, int], str] = {}
        seen_page: dict[int, tuple[str, int, int]] = {}
        for kind in ("evict", "restore"):
            moves = getattr(self, kind)
            if not isinstance(moves, (list, tuple)):
                raise OrderError(f"{kind} must be a sequence of ExpertMove, got {_short(moves)}")
            for m in moves:
                if not isinstance(m, ExpertMove):
                    raise OrderError(f"{kind} holds {_short(m)}, not an ExpertMove")
                if m.key in seen_expert:
                    what = ("twice in " + kind if seen_expert[m.key] == kind
                            else "both evicted and restored")
                    raise OrderError(f"layer {m.layer} expert {m.expert} is {what} in one order")
                seen_expert[m.key] = kind
                for p in m.pages:
                    if p in seen_page:
                        k2, l2, e2 = seen_page[p]
                        raise OrderError(f"page {p} of {kind} layer {m.layer} expert {m.expert} is "
                                         f"also a page of {k2} layer {l2} expert {e2}")
                    seen_page[p] = (kind, m.layer, m.expert)
            object.__setattr__(self, kind, tuple(moves))

    @property
    def experts(self) -> tuple[tuple[int, int], ...]:
        """``(layer, expert)`` of every move, evictions first."""
        return tuple(m.key for m in self.evict + self.restore)


def encode(order: MigrationOrder) -> bytes:
    """UTF-8 JSON bytes of ``order`` (compact; keys in the documented order)."""
    if not isinstance(order, MigrationOrder):
        raise TypeError(f"encode needs a MigrationOrder, got {type(order).__name__}")

    def moves(ms: Sequence[ExpertMove]) -> list[dict]:
        return [{"layer": m.layer, "expert": m.expert, "pages": list(m.pages)} for m in ms]

    msg = {"type": ORDER_TYPE, "version": order.version, "seq": order.seq, "round": order.round,
           "evict": moves(order.evict), "restore": moves(order.restore), "reason": order.reason}
    return json.dumps(msg, separators=(",", ":")).encode("utf-8")


def decode(data: bytes) -> MigrationOrder:
    """Parse and validate one message; ``OrderError`` quoting ``data`` on any problem."""

    def fail(problem: str) -> OrderError:
        return OrderError(f"bad migration order: {problem}; received {_short(data)}")

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise fail(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    try:
        msg = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicate_keys,
                         parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise fail(f"not UTF-8 JSON ({e})") from None
    if not isinstance(msg, dict):
        raise fail(f"expected a JSON object, got {type(msg).__name__}")
    if msg.get("type") != ORDER_TYPE:
        raise fail(f"type is {_short(msg.get('type'))}, expected {ORDER_TYPE!r}")
    if "version" not in msg or not _is_int(msg["version"]) or msg["version"] != ORDER_VERSION:
        raise fail(f"unknown version {_short(msg.get('version'))}; "
                   f"this build speaks version {ORDER_VERSION}")
    _check_keys(msg, _ORDER_KEYS, "order", fail)
    kw = {}
    for kind in ("evict", "restore"):
        raw = msg[kind]
        if not isinstance(raw, list):
            raise fail(f"{kind} must be a list of moves, got {_short(raw)}")
        moves = []
        for i, m in enumerate(raw):
            if not isinstance(m, dict):
                raise fail(f"{kind}[{i}] must be an object, got {_short(m)}")
            _check_keys(m, _MOVE_KEYS, f"{kind}[{i}]", fail)
            if not isinstance(m["pages"], list):
                raise fail(f"{kind}[{i}].pages must be a list, got {_short(m['pages'])}")
            try:
                moves.append(ExpertMove(m["layer"], m["expert"], tuple(m["pages"])))
            except OrderError as e:
                raise fail(f"{kind}[{i}]: {e}") from None
        kw[kind] = tuple(moves)
    try:
        return MigrationOrder(version=msg["version"], seq=msg["seq"], round=msg["round"],
                              reason=msg["reason"], **kw)
    except OrderError as e:
        raise fail(str(e)) from None


class OrderSequencer:
    """The receiving side's check that orders arrive once each, in ``seq`` order.

    ``accept`` takes the order with ``seq == last_seq + 1`` and raises
    ``OrderError`` for any other (a gap, a repeat, an old one) without changing
    state, so a refused order does not stop serving and the right next order
    is still accepted.
    """

    def __init__(self) -> None:
        self._last = 0

    @property
    def last_seq(self) -> int:
        """``seq`` of the last accepted order; 0 before the first."""
        return self._last

    def accept(self, order: MigrationOrder) -> None:
        if not isinstance(order, MigrationOrder):
            raise OrderError(f"expected a MigrationOrder, got {_short(order)}")
        want = self._last + 1
        if order.seq < want:
            raise OrderError(f"migration order seq={order.seq} (round {order.round}) repeats or "
                             f"is older than the last accepted seq={self._last}; refused")
        if order.seq > want:
            raise OrderError(f"migration order seq={order.seq} (round {order.round}) is out of "
                             f"sequence: expected seq={want}, orders {want}..{order.seq - 1} are "
                             f"missing; refused")
        self._last = order.seq


def _check_keys(obj: dict, keys: tuple[str, ...], what: str, fail) -> None:
    missing = [k for k in keys if k not in obj]
    if missing:
        raise fail(f"{what} is missing field(s) {missing}")
    extra = sorted(k for k in obj if k not in keys)
    if extra:
        raise fail(f"{what} has unknown field(s) {_short(extra)}")


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")
