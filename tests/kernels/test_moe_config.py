"""Launch-config files: naming, lookup, nearest token count, shipped tables.

(The import rule of rimuru_kernels is checked in tests/test_layout.py.)
"""

import json

import pytest
import torch

pytest.importorskip("triton")

from rimuru_kernels import moe_config  # noqa: E402

KEYS = {"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages"}


def test_shipped_configs_are_complete():
    files = sorted(moe_config.CONFIG_DIR.glob("*.json"))
    assert moe_config.CONFIG_DIR / "default.json" in files
    for path in files:
        table = json.loads(path.read_text())
        assert table, path
        for tokens, cfg in table.items():
            assert int(tokens) >= 1
            assert set(cfg) == KEYS, (path.name, tokens)
            for key in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"):
                assert cfg[key] >= 16 and cfg[key] & (cfg[key] - 1) == 0, (path.name, tokens)


def test_unknown_device_gets_default_and_nearest_token_count(monkeypatch):
    moe_config.load_configs.cache_clear()
    monkeypatch.setattr(moe_config, "device_name", lambda device: "No_Such_GPU")
    default = json.loads((moe_config.CONFIG_DIR / "default.json").read_text())
    cuda = torch.device("cuda", 0)
    keys = sorted(int(k) for k in default)
    for m in (1, 3, 100, 5000, 10**6):
        want = default[str(min(keys, key=lambda k: abs(k - m)))]
        assert moe_config.get_paged_moe_config(8, 48, m, cuda) == want


def test_config_dir_override_and_file_name(tmp_path, monkeypatch):
    table = {
        "1": dict.fromkeys(KEYS, 1) | {"BLOCK_SIZE_M": 16},
        "64": dict.fromkeys(KEYS, 1) | {"BLOCK_SIZE_M": 64},
    }
    name = "E=128,N=768,device_name=Fake_GPU.json"
    assert moe_config.config_file_name(128, 768, "Fake_GPU") == name
    (tmp_path / name).write_text(json.dumps(table))
    monkeypatch.setenv("RIMURU_KERNELS_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(moe_config, "device_name", lambda device: "Fake_GPU")
    moe_config.load_configs.cache_clear()
    try:
        cuda = torch.device("cuda", 0)
        assert moe_config.get_paged_moe_config(128, 768, 20, cuda)["BLOCK_SIZE_M"] == 16
        assert moe_config.get_paged_moe_config(128, 768, 40, cuda)["BLOCK_SIZE_M"] == 64
        # Another shape falls back to the default table.
        assert moe_config.get_paged_moe_config(64, 768, 40, cuda) != table["64"]
    finally:
        moe_config.load_configs.cache_clear()


def test_cpu_gets_the_small_interpreter_config():
    cfg = moe_config.get_paged_moe_config(8, 48, 1000, torch.device("cpu"))
    assert cfg == moe_config.INTERPRETER_CONFIG


def test_down_table_beside_the_shapes_table(tmp_path, monkeypatch):
    up = {"1": dict.fromkeys(KEYS, 1) | {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32},
          "64": dict.fromkeys(KEYS, 1) | {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 32}}
    down = {"1": dict.fromkeys(KEYS, 1) | {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128},
            "64": dict.fromkeys(KEYS, 1) | {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 256}}
    assert moe_config.config_file_name(128, 768, "Fake_GPU", down=True) == \
        "E=128,N=768,device_name=Fake_GPU_down.json"
    (tmp_path / "E=128,N=768,device_name=Fake_GPU.json").write_text(json.dumps(up))
    (tmp_path / "E=128,N=768,device_name=Fake_GPU_down.json").write_text(json.dumps(down))
    (tmp_path / "E=60,N=1408,device_name=Fake_GPU.json").write_text(json.dumps(up))
    monkeypatch.setenv("RIMURU_KERNELS_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(moe_config, "device_name", lambda device: "Fake_GPU")
    for f in (moe_config.load_configs, moe_config.load_down_configs):
        f.cache_clear()
    try:
        cuda = torch.device("cuda", 0)
        assert moe_config.get_paged_moe_down_config(128, 768, 3, cuda)["BLOCK_SIZE_N"] == 128
        assert moe_config.get_paged_moe_down_config(128, 768, 50, cuda)["BLOCK_SIZE_N"] == 256
        assert moe_config.get_paged_moe_config(128, 768, 50, cuda)["BLOCK_SIZE_N"] == 32
        # A shape with its own table but no down table: the down GEMM takes the up config.
        assert moe_config.get_paged_moe_down_config(60, 1408, 3, cuda) is None
        # A shape on the default table has no down table either.
        assert moe_config.get_paged_moe_down_config(64, 768, 3, cuda) is None
        assert moe_config.get_paged_moe_down_config(128, 768, 3, torch.device("cpu")) is None
    finally:
        for f in (moe_config.load_configs, moe_config.load_down_configs):
            f.cache_clear()


def test_shipped_down_tables_pair_with_their_up_tables():
    for path in sorted(moe_config.CONFIG_DIR.glob("*_down.json")):
        up_path = path.with_name(path.name.replace("_down.json", ".json"))
        assert up_path.is_file(), path.name
        up, down = json.loads(up_path.read_text()), json.loads(path.read_text())
        assert set(up) == set(down), path.name
        for tokens in up:
            assert up[tokens]["BLOCK_SIZE_M"] == down[tokens]["BLOCK_SIZE_M"], (path.name, tokens)


@pytest.mark.parametrize("E,N", [(60, 1408), (128, 768)])  # Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B at TP1
def test_served_shapes_have_h200_tables(monkeypatch, E, N):
    """--rimuru-moe-kernel fast on the H200 reads the tuned tables (gate/up and down) of the served shapes."""
    monkeypatch.delenv("RIMURU_KERNELS_CONFIG_DIR", raising=False)
    monkeypatch.setattr(moe_config, "device_name", lambda device: "NVIDIA_H200")
    up, down = moe_config.config_files(E, N, "NVIDIA_H200")
    assert up == moe_config.CONFIG_DIR / f"E={E},N={N},device_name=NVIDIA_H200.json"
    assert down == moe_config.CONFIG_DIR / f"E={E},N={N},device_name=NVIDIA_H200_down.json"
    moe_config.load_configs.cache_clear()
    moe_config.load_down_configs.cache_clear()
    try:
        cuda = torch.device("cuda", 0)
        table = json.loads(up.read_text())
        down_table = json.loads(down.read_text())
        for m in (1, 7, 64, 300, 8192):
            key = str(min((int(k) for k in table), key=lambda k: abs(k - m)))
            assert moe_config.get_paged_moe_config(E, N, m, cuda) == table[key]
            assert moe_config.get_paged_moe_down_config(E, N, m, cuda) == down_table[key]
            assert down_table[key]["BLOCK_SIZE_M"] == table[key]["BLOCK_SIZE_M"]  # one alignment for both
    finally:
        moe_config.load_configs.cache_clear()
        moe_config.load_down_configs.cache_clear()


def test_shape_without_a_table_reads_default_and_no_down_table():
    # Qwen1.5-MoE-A2.7B at TP2 (N=704) has no table: default.json, and the down GEMM takes its config
    assert moe_config.config_files(60, 704, "NVIDIA_H200") == (moe_config.CONFIG_DIR / "default.json", None)
    assert moe_config.config_files(60, 1408, "Some_Other_GPU") == (moe_config.CONFIG_DIR / "default.json", None)


def test_the_shared_memory_estimate_bounds_what_triton_asked_for_on_the_h200():
    """pipeline_shared_bytes is an upper estimate: for tiles the tuner failed to compile on
    the H200 (bench/results/tune_paged_moe_h200.json.gz, "Required: N" of Triton's
    OutOfResources, limit 232,448 B) it gives at least what Triton asked for, so a table
    that fits by it fits the GPU. The shipped tables of the served shapes fit the H200;
    default.json (136 KiB fused at BM 16, BN 128, BK 128, 2 stages) fits Hopper and A100
    (163 KiB), not a 99 KiB Ada card."""
    failed = [((16, 256, 64, 5), 270_336), ((128, 128, 128, 3), 294_912), ((16, 128, 256, 3), 278_528),
              ((128, 256, 128, 2), 327_680)]
    for (bm, bn, bk, stages), required in failed:
        config = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "num_stages": stages}
        assert moe_config.pipeline_shared_bytes(config, fused=True) >= required
        assert not moe_config.table_fits({1: config}, 232_448)
    default = moe_config.load_configs(60, 704, "NVIDIA_H200")  # no table for this shape: default.json
    assert max(moe_config.pipeline_shared_bytes(c, True) for c in default.values()) == 136 * 1024
    assert moe_config.table_fits(default, 232_448) and moe_config.table_fits(default, 166_912)
    assert not moe_config.table_fits(default, 101_376)
    for E, N in ((60, 1408), (128, 768)):
        assert moe_config.table_fits(moe_config.load_configs(E, N, "NVIDIA_H200"), 232_448)
        assert moe_config.table_fits(moe_config.load_down_configs(E, N, "NVIDIA_H200"), 232_448, fused=False)
        assert moe_config.tables_fit(E, N, "NVIDIA_H200", 232_448)
    # Qwen3-30B-A3B at TP=2: its 4096-token tile (BM 128, BN 256, BK 64, 4 stages) is one Triton refused
    assert not moe_config.tables_fit(128, 384, "NVIDIA_H200", 232_448)
