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
    assert m.with_override(up, None, "cfg") == (up, None)
    up3, down3 = m.with_override(up, dict(up), "3")
    assert (up3["num_stages"], down3["num_stages"], up["num_stages"]) == (3, 3, 2)  # the table is not touched
    assert m.pipelines_fit(up, None, "fused", hopper)  # 2 x (16*128 + 2*128*128) * 2 B = 136 KiB
    assert not m.pipelines_fit(up3, down3, "fused", hopper)  # 204 KiB: under Hopper's, past the kernel's budget
    assert m.pipelines_fit(up3, down3, "unfused", hopper)  # 3 x (16*128 + 128*128) * 2 B = 108 KiB
    up4, down4 = m.with_override(up, dict(up), "4")
    assert not m.pipelines_fit(up4, down4, "fused", hopper)  # 272 KiB
    assert m.pipelines_fit(up4, down4, "unfused", hopper)  # 4 x (16*128 + 128*128) * 2 B = 144 KiB
    assert not m.pipelines_fit(up, None, "fused", 99 * 1024)  # an Ada card's block


def test_a_tiles_spec_sets_the_tile_stages_and_warps_of_both_gemms():
    m = load()
    up = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
          "num_stages": 2}
    got_up, got_down = m.with_override(up, dict(up), "64x256x3x8")
    want = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 256, "GROUP_SIZE_M": 1, "num_warps": 8,
            "num_stages": 3}
    assert got_up == want and got_down == want and up["BLOCK_SIZE_N"] == 128
    # 3 x (16*256 + 2*256*64) * 2 B = 216 KiB fused: past the kernel's 200 KiB; 2 stages (144 KiB) run
    assert not m.pipelines_fit(got_up, got_down, "fused", 227 * 1024)
    assert m.pipelines_fit(*m.with_override(up, dict(up), "64x256x2x8"), "fused", 227 * 1024)
    assert m.pipelines_fit(*m.with_override(up, dict(up), "64x128x5x4"), "fused", 227 * 1024)  # 180 KiB
    assert m.TILES.match("64x128x4x4") and not m.TILES.match("64x128x4")
    # a fifth number in front sets BLOCK_SIZE_M (the token alignment, and how often an
    # offloaded expert is read: once per BLOCK_SIZE_M of its tokens), gG GROUP_SIZE_M
    got_up, got_down = m.with_override(up, dict(up), "64x128x128x2x4g8")
    assert got_up == got_down == {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 8,
                                  "num_warps": 4, "num_stages": 2}
    assert m.with_override(up, None, "64x128x2x4g8")[0]["BLOCK_SIZE_M"] == 16
    assert m.pipelines_fit(got_up, got_down, "fused", 227 * 1024)  # 2 x (64*128 + 2*128*128) * 2 B = 160 KiB


def _row(T, k, spec, ms, equal=True, **kw):
    return {"layout": "compact", "configs": "kernel", "w13": "fused", "out_set": "random", "stages": spec,
            "T": T, "k": k, "step_ms": ms, "GBps": 19.0 * 635.0 / ms, "equal": equal, **kw}


def test_host_read_table_takes_the_fastest_bit_equal_variant_into_the_nearest_entry(tmp_path):
    """bench/kernel/host_read_table.py: per token count the fastest variant whose output was
    bit-equal replaces the table entry a batch of that size reads, keeping the table's token
    alignment (BLOCK_SIZE_M, GROUP_SIZE_M) unless the spec names it; a gain under --min-gain, a
    variant that was not equal, or another k, change nothing."""
    import json
    import subprocess
    import sys

    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    hrt = bench_module("kernel/host_read_table.py")
    rows = [_row(100, 49, "cfg", 635.0), _row(100, 49, "64x128x4x4", 420.0),
            _row(100, 49, "32x128x6x4", 400.0, equal=False),  # faster, but its output differed
            _row(100, 9, "64x128x5x4", 50.0),  # fewer experts out: not the full-batch case
            _row(56, 49, "cfg", 600.0), _row(56, 49, "128x64x4x4", 590.0),  # 1.7 %: under the gain
            _row(100, 49, "64x128x5x4", 410.0, configs="sglang")]  # SGLang's configs: not the kernel's
    picked = hrt.winners(rows, 0.05)
    assert picked == {100: {"spec": "64x128x4x4", "k": 49, "step_ms": 420.0, "cfg_ms": 635.0, "GBps": 28.7}}
    base = {64: {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                 "num_warps": 4, "num_stages": 2},
            128: {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                  "num_warps": 4, "num_stages": 2},
            256: {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8,
                  "num_warps": 4, "num_stages": 3}}
    table = hrt.table_with(base, picked)
    assert table[128] == {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                          "num_warps": 4, "num_stages": 4}  # 100 reads the entry of 128
    assert table[64] == base[64] and table[256] == base[256] and base[128]["BLOCK_SIZE_N"] == 128
    # a spec naming BLOCK_SIZE_M sets the entry's token alignment too (the thirty-fourth session's trial)
    assert hrt.table_with(base, {100: {"spec": "64x128x128x2x4"}})[128]["BLOCK_SIZE_M"] == 64

    # the command: a run on the default table, written where the device returns it, then here
    run = {"shape": "qwen1.5", "device": "NVIDIA H100 80GB HBM3", "rows": rows,
           "configs_read": ["/tmp/site/kernels/rimuru_kernels/configs/default.json"]}
    (tmp_path / "zcs.json").write_text(json.dumps(run))
    script = str(root / "bench/kernel/host_read_table.py")
    out = subprocess.run([sys.executable, script, str(tmp_path / "zcs.json"), "--out-dir", str(tmp_path / "d"),
                          "--json", str(tmp_path / "t.json")], capture_output=True, text=True, check=True).stdout
    name = "E=60,N=1408,device_name=NVIDIA_H100_80GB_HBM3.json"
    assert "T=100, k=49: 64x128x4x4 420.0 ms against the table's 635.0" in out
    written = json.loads((tmp_path / "d" / name).read_text())
    assert written["128"]["BLOCK_SIZE_N"] == 64 and written["128"]["num_stages"] == 4 and len(written) > 3
    subprocess.run([sys.executable, script, "--tables-from", str(tmp_path / "t.json"), "--out-dir",
                    str(tmp_path / "here")], check=True, capture_output=True)
    assert json.loads((tmp_path / "here" / name).read_text()) == written
    # no gain: nothing written, and said
    slow = {**run, "rows": [_row(100, 49, "cfg", 635.0), _row(100, 49, "64x128x4x4", 630.0)]}
    (tmp_path / "slow.json").write_text(json.dumps(slow))
    out = subprocess.run([sys.executable, script, str(tmp_path / "slow.json"), "--out-dir", str(tmp_path / "none")],
                         capture_output=True, text=True, check=True).stdout
    assert "no table written" in out and not (tmp_path / "none").exists()


def test_the_variants_a_call_runs_are_those_whose_tiles_run_as_asked():
    """main() times, per token count, only the variants runnable_variants keeps: at 100
    tokens default.json's entry (BN 128, BK 128, 2 stages) fused runs as it is and with BN 64
    at 5 stages, not at 3 stages (the kernel would shrink it to 2); unfused, 3 stages run."""
    m = load()
    entry = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "num_warps": 4,
             "num_stages": 2}

    def configs_of(T, kind, st):
        return m.with_override(dict(entry), None, st)

    variants = [("kernel", w13, st) for w13 in ("fused", "unfused") for st in ("cfg", "3", "64x128x5x4")]
    keep, left_out = m.runnable_variants([56, 100], variants, configs_of, 227 * 1024)
    runs = [("kernel", "fused", "cfg"), ("kernel", "fused", "64x128x5x4"), ("kernel", "unfused", "cfg"),
            ("kernel", "unfused", "3"), ("kernel", "unfused", "64x128x5x4")]
    assert keep == {56: runs, 100: runs}
    assert left_out == ["T=56 kernel/fused/s3", "T=100 kernel/fused/s3"]


def test_shared_routing_gives_dup_tokens_each_routing_and_host_reads_counts_a_read_per_block():
    """--dup D: T tokens take ceil(T / D) routings, D tokens each in a row; an out expert is
    read once per BLOCK_SIZE_M of the tokens routed to it (the kernel's blocks hold one
    expert's rows each), and an expert no token routes to is not read."""
    import torch

    m = load()
    w = torch.arange(10, dtype=torch.float32).view(5, 2)
    ids = torch.tensor([[0, 1], [2, 3], [0, 2], [4, 1], [3, 0]], dtype=torch.int32)
    assert m.shared_routing(w, ids, 1)[1] is ids
    w2, ids2 = m.shared_routing(w, ids, 2)
    assert ids2.tolist() == [[0, 1], [0, 1], [2, 3], [2, 3], [0, 2]]
    assert w2.tolist() == [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5]]
    # ids2 routes expert 0 three tokens, 1 two, 2 three, 3 two, 4 none
    assert m.host_reads(ids2, [0, 1, 4], 16) == 2
    assert m.host_reads(ids2, [0, 1, 2, 3], 2) == 2 + 1 + 2 + 1
    # every token on one routing: experts 0 and 1 get 5 tokens each, two blocks of 4 apiece
    assert m.host_reads(m.shared_routing(w, ids, 5)[1], [0, 1], 4) == 4
    assert m.host_reads(m.shared_routing(w, ids, 5)[1], [0, 1], 16) == 2
