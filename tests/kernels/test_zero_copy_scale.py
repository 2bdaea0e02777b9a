"""bench/kernel/zero_copy_scale.py registers its host region in pieces (one registration of
38 GiB returned success and left the memory unpinned on the H200); a copy into pinned memory
fails ("invalid argument") where it straddles two registrations, so every expert slot must
fall inside one piece. The rest of the script needs a GPU (the device call runs it)."""

from tests.conftest import bench_module


def load():
    return bench_module("kernel/zero_copy_scale.py")


def test_chunk_ranges_cover_the_region_and_keep_every_slot_whole():
    m = load()
    base, first, slot, per_chunk, slots = 4096, 4096 + 1000, 300, 4, 23
    end = first + slots * slot + 77  # alignment slack before the slots, a tail after
    ranges = m.chunk_ranges(base, end, first, per_chunk * slot)
    assert ranges[0][0] == base and ranges[-1][1] == end
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no gap, no overlap
    assert [lo for lo, _ in ranges[1:]] == [first + n * per_chunk * slot for n in range(1, 6)]
    for s in range(slots):
        lo, hi = first + s * slot, first + (s + 1) * slot
        assert sum(1 for a, b in ranges if a <= lo and hi <= b) == 1, s


def test_a_region_smaller_than_a_chunk_is_one_range():
    m = load()
    assert m.chunk_ranges(0, 500, 10, 1000) == [(0, 500)]
