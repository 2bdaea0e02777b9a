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


def test_a_stages_override_past_shared_memory_is_left_out_not_launched():
    """--stages N sets num_stages on both GEMMs; a variant whose tiles then need more shared
    memory than a block has is left out (a launch would stop the call), and so is a fused one
    the kernel would shrink to its 200 KiB budget (it would run other tiles under this name).
    The kernel's default.json at 100 tokens (BM 16, BN 128, BK 128, 2 stages) takes 136 KiB
    fused: 3 stages (204 KiB) would run as 2; unfused (one B tile) 4 stages fit."""
    m = load()
    up = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
          "num_stages": 2}
    hopper = 227 * 1024
    assert m.with_stages(up, None, "cfg") == (up, None)
    up3, down3 = m.with_stages(up, dict(up), "3")
    assert (up3["num_stages"], down3["num_stages"], up["num_stages"]) == (3, 3, 2)  # the table is not touched
    assert m.pipelines_fit(up, None, "fused", hopper)  # 2 x (16*128 + 2*128*128) * 2 B = 136 KiB
    assert not m.pipelines_fit(up3, down3, "fused", hopper)  # 204 KiB: under Hopper's, past the kernel's budget
    assert m.pipelines_fit(up3, down3, "unfused", hopper)  # 3 x (16*128 + 128*128) * 2 B = 108 KiB
    up4, down4 = m.with_stages(up, dict(up), "4")
    assert not m.pipelines_fit(up4, down4, "fused", hopper)  # 272 KiB
    assert m.pipelines_fit(up4, down4, "unfused", hopper)  # 4 x (16*128 + 128*128) * 2 B = 144 KiB
    assert not m.pipelines_fit(up, None, "fused", 99 * 1024)  # an Ada card's block


def test_a_tiles_spec_sets_the_tile_stages_and_warps_of_both_gemms():
    m = load()
    up = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
          "num_stages": 2}
    got_up, got_down = m.with_stages(up, dict(up), "64x256x3x8")
    want = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 256, "GROUP_SIZE_M": 1, "num_warps": 8,
            "num_stages": 3}
    assert got_up == want and got_down == want and up["BLOCK_SIZE_N"] == 128
    # 3 x (16*256 + 2*256*64) * 2 B = 216 KiB fused: past the kernel's 200 KiB; 2 stages (144 KiB) run
    assert not m.pipelines_fit(got_up, got_down, "fused", 227 * 1024)
    assert m.pipelines_fit(*m.with_stages(up, dict(up), "64x256x2x8"), "fused", 227 * 1024)
    assert m.pipelines_fit(*m.with_stages(up, dict(up), "64x128x5x4"), "fused", 227 * 1024)  # 180 KiB
    assert m.TILES.match("64x128x4x4") and not m.TILES.match("64x128x4")
