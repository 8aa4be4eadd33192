"""The kernel micro-benchmark module (``kimi_hybrid.kernels.bench_kernels``) on CPU: its registry, its row
arithmetic, and a clear refusal without CUDA (the measurements themselves run on the GPU)."""

import pytest
import torch

from kimi_hybrid.kernels import bench_kernels as bk


def test_sections_registry_and_row_arithmetic():
    assert list(bk.SECTIONS) == ["copy", "mla_decode", "mla_sweep", "moe_gemv", "moe_gemv_sweep", "routing",
                                 "kda_decode", "kda_decode_step"]
    r = bk.row({"copy_gbps": 4000.0}, "x", 1e-3, 2_000_000_000, ref_seconds=3e-3)
    assert r["GB/s"] == 2000.0 and r["of_copy_bw"] == 0.5 and r["speedup"] == 3.0 and r["us"] == 1000.0
    assert bk.sets_for(bk.L2_FLUSH_BYTES) == 1 and bk.sets_for(1) == 16
    assert bk._mla_bytes(1, 1 << 20) == 2 * ((1 << 20) * 576 + 32 * 576 + 32 * 512)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_refuses_without_cuda(capsys, tmp_path):
    assert bk.main(["--out", str(tmp_path / "x.json")]) == 2
    assert "needs CUDA" in capsys.readouterr().err
