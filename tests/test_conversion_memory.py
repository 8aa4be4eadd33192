"""Peak memory of a conversion does not grow with the number (or total size) of shards.

Two checkpoints with equally sized shards (one MoE layer of ~12.6 MB per shard): 2 shards vs 8 shards (4x the
data). Each is converted in a fresh child process; the child reports its own peak RSS (VmHWM) and the
converter's `peak_buffer_bytes`. If the converter held a shard, or all shards, the 8-shard peak would be >= 75 MB
higher; we require the difference to stay below 20 MB and the converter's buffer to be identical.
"""

import json
import subprocess
import sys

from conversion_fixtures import released_tensors, tiny_released_config, write_checkpoint


def _make(folder, n_layers):
    cfg = tiny_released_config(
        hidden_size=256, num_hidden_layers=n_layers, first_k_dense_replace=0, num_experts=32,
        moe_intermediate_size=256, num_experts_per_token=2,
        linear_attn_config={"full_attn_layers": [], "head_dim": 8, "kda_layers": list(range(1, n_layers + 1)),
                            "num_heads": 2, "short_conv_kernel_size": 4},
    )
    t = released_tensors(cfg, seed=n_layers)
    shards = [[k for k in t if k.startswith(f"model.layers.{i}.")] for i in range(n_layers)]
    shards[0] = ["model.embed_tokens.weight"] + shards[0]
    shards[-1] = shards[-1] + ["model.norm.weight", "lm_head.weight"]
    write_checkpoint(folder, cfg, t, shards, side_files=False)
    return sum(v.numel() * v.element_size() for v in t.values())


CHILD = r"""
import json, resource, sys
from kimi_hybrid.conversion.convert import convert_checkpoint
rep = convert_checkpoint({src!r}, {out!r}, progress=False, with_bundle=False, chunk_bytes=4 << 20,
                         max_shard_size="1GB")
# VmHWM: peak RSS of this process image (ru_maxrss would include the parent's RSS at fork time: it survives exec)
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
print(json.dumps({{"maxrss_kb": hwm,
                  "peak_buffer": rep["peak_buffer_bytes"], "shards": len(rep["source"]["shards"])}}))
"""


def _measure(tmp_path, n):
    src = str(tmp_path / f"src{n}")
    total = _make(src, n)
    code = CHILD.format(src=src, out=str(tmp_path / f"out{n}"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["total"] = total
    return res


def test_peak_memory_does_not_scale_with_shards(tmp_path):
    a = _measure(tmp_path, 2)
    b = _measure(tmp_path, 8)
    assert a["shards"] == 2 and b["shards"] == 8
    assert b["total"] > 3.5 * a["total"]
    assert a["peak_buffer"] == b["peak_buffer"] <= 2 * (4 << 20)  # two streaming buffers
    grow_mb = (b["maxrss_kb"] - a["maxrss_kb"]) / 1024
    data_grow_mb = (b["total"] - a["total"]) / 2**20
    print(f"peak RSS 2 shards {a['maxrss_kb'] / 1024:.1f} MiB, 8 shards {b['maxrss_kb'] / 1024:.1f} MiB "
          f"(+{grow_mb:.1f} MiB for +{data_grow_mb:.1f} MiB of data)")
    assert grow_mb < 20, (a, b)
