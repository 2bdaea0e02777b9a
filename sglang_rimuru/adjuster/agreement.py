"""``TPAgreement``: every TP rank planned the same migration orders, checked at run time.

Each TP rank's scheduler runs its own adjuster; the ranks plan the same orders
only because planning is deterministic and SGLang feeds every rank the same
batches.  ``TPAgreement`` checks that.  The controller tells it what it planned
(``planned``: every ``plan_round`` call, an order or none) and calls ``check``
at the end of a round, after the round's order is planned and before a forward
pass can run it.  ``check`` compares, across the TP group, one row per rank::

    (round, seq, digest)   round: the last round this rank planned
                           seq:   the last order it issued (0 before the first)
                           digest: 64-bit BLAKE2b of the encoded orders planned
                                   since the previous check; 0 when none

with one all-gather of three int64 per rank (``gather``, given by the
integrator over SGLang's TP CPU group).  Every rank must call the collective
equally often, whatever it planned, or the group hangs; so whether a round is
checked never depends on planning.  The controller checks every round that
holds a request (waiting, running or in the round's batch) and skips the idle
ones (SGLang's scheduler loop spins when nothing is there; those rounds' orders,
restores in a quiet period, are in the next check's digest).  Holding a request
is the same on every rank: requests arrive through SGLang's per-round broadcast
and leave by finishing (a forward pass, which a check precedes) or by an abort
SGLang broadcasts (its opt-in waiting/running timeouts abort per rank, which
would desync SGLang's own batches too); a split that diverged can move a request between waiting and
running, not out of the scheduler.  So a rank that planned an order where
another planned none is a mismatch of digests, not a hang, and it is found no
later than the first round after it that holds a request, before that round's
forward pass.  On a mismatch every rank logs one line (``ERROR``) naming the
round, each rank's round, seq and digest and which ranks disagree, then raises
``RanksDisagree``: the scheduler stops instead of serving with a split the
other ranks do not have.

Standard library only.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence

from .orders import MigrationOrder

__all__ = ["RanksDisagree", "TPAgreement"]

logger = logging.getLogger(__name__)

#: one rank's row: (round, seq, digest)
Row = tuple[int, int, int]
_MASK = (1 << 64) - 1


class RanksDisagree(RuntimeError):
    """TP ranks planned different migration orders (or a different number of rounds)."""


class TPAgreement:
    """Compares each round's planned orders across the TP group.

    ``gather(row)`` sends this rank's row and returns every rank's row in rank
    order (a collective: every rank must call it the same number of times).
    """

    def __init__(self, gather: Callable[[Row], Sequence[Sequence[int]]], rank: int) -> None:
        self._gather = gather
        self.rank = rank
        self._round = -1
        self._seq = 0
        self._hash = None

    def planned(self, round_no: int, order: MigrationOrder | None, encoded: bytes | None) -> None:
        """The adjuster planned round ``round_no``: ``order`` (``encoded``) or nothing."""
        self._round = round_no
        if order is None:
            return
        self._seq = order.seq
        if self._hash is None:
            self._hash = hashlib.blake2b(digest_size=8)
        self._hash.update(len(encoded).to_bytes(8, "little"))
        self._hash.update(encoded)

    def row(self) -> Row:
        """What ``check`` compares: (round, seq, digest of the orders since the last check)."""
        if self._hash is None:
            return (self._round, self._seq, 0)
        digest = int.from_bytes(self._hash.digest(), "little", signed=True)
        return (self._round, self._seq, digest or 1)  # 0 means "no order"

    def check(self) -> None:
        """Compare this rank's row with every other rank's; ``RanksDisagree`` on a mismatch."""
        mine = self.row()
        self._hash = None
        rows = [tuple(int(v) for v in r) for r in self._gather(mine)]
        if all(r == mine for r in rows):
            return
        message = describe(rows, self.rank)
        logger.error(message)
        raise RanksDisagree(message)


def describe(rows: Sequence[Row], rank: int) -> str:
    """One line: the round, each rank's row, which ranks disagree."""
    groups: dict[Row, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(tuple(r), []).append(i)
    rounds = sorted({r[0] for r in rows})
    where = f"round {rounds[0]}" if len(rounds) == 1 else "rounds " + "/".join(map(str, rounds))
    each = "; ".join(f"rank {i}: round {r[0]} seq {r[1]} digest {r[2] & _MASK:#018x}" for i, r in enumerate(rows))
    sides = " vs ".join(f"ranks {g}" for g in groups.values())
    return (f"sglang-rimuru: TP ranks planned different migration orders in {where} ({each}; "
            f"{sides} disagree); TP rank {rank} stops rather than serve with an expert/KV split "
            f"the other ranks do not have")
