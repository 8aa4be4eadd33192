"""Tests of the cache memory planner (``kimi_hybrid.app.memory``, ``kimi-hybrid memory``).

The planner's byte counts are checked against ``KimiHybridCache.memory_report()`` summed from real tensors: a tiny
model run over N tokens (dynamic cache, fp32 and bf16, batch 1 and 2, prefill then decode steps), and static caches
of the real 48B-A3B and K3 shapes allocated on the meta device (no memory). The MHA / all-MLA comparison and the
fit arithmetic are checked against numbers worked out by hand here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kimi_hybrid import KimiHybridCache, KimiHybridConfig, KimiHybridForCausalLM
from kimi_hybrid.app import memory
from presets import preset_config

FIELDS = ("kda_state_bytes", "kda_conv_bytes", "kda_bytes", "mla_bytes", "mask_bytes", "hidden_bytes", "counter_bytes",
          "total_bytes")


def tiny_config() -> KimiHybridConfig:
    return preset_config("tiny-kda-first")


@pytest.mark.parametrize("dtype, batch", [(torch.float32, 1), (torch.bfloat16, 2)])
def test_plan_equals_memory_report_on_real_tensors(dtype, batch):
    cfg = tiny_config()
    torch.manual_seed(0)
    model = KimiHybridForCausalLM(cfg).to(dtype).eval()
    plan = memory.CachePlan.from_config(cfg, str(dtype).replace("torch.", ""))
    cache = KimiHybridCache(cfg)
    n = 37
    ids = torch.randint(3, cfg.vocab_size, (batch, n))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        rep = cache.memory_report()
        assert rep["seen_tokens"] == n and rep["rollback_bytes"] == 0
        assert {k: rep[k] for k in FIELDS} == plan.report(n, batch)
        for step in range(3):  # decode steps: the latents grow by one token each
            model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
            rep = cache.memory_report()
            assert {k: rep[k] for k in FIELDS} == plan.report(n + step + 1, batch)
    # the per-sequence formula the planner prints: fixed + per_token x T
    assert rep["total_bytes"] == batch * memory.sequence_bytes(plan.fixed, plan.per_token, n + 3)


@pytest.mark.parametrize("preset, n_kda, n_mla", [("kimi-linear-48b-a3b", 20, 7), ("kimi-k3", 69, 24)])
def test_plan_equals_memory_report_of_real_shapes_on_meta(preset, n_kda, n_mla):
    """Static caches of the real shapes at 1M tokens, allocated on the meta device (no memory)."""
    cfg = KimiHybridConfig.from_preset(preset)
    plan = memory.CachePlan.from_config(cfg, "bfloat16")
    assert (plan.n_kda, plan.n_mla) == (n_kda, n_mla)
    for tokens, batch in ((1 << 20, 1), (131072, 4)):
        cache = KimiHybridCache(cfg, max_cache_len=tokens, batch_size=batch, dtype=torch.bfloat16, device="meta")
        rep = cache.memory_report()
        assert {k: rep[k] for k in FIELDS} == plan.report(tokens, batch, static=True)


def test_48b_figures_by_hand():
    """Kimi-Linear-48B-A3B, bf16 cache: KDA 20 x (32 x 128 x 128 x 4 + 3 x 4096 x 4 x 2) = 43,909,120 B per
    sequence, MLA 7 x 576 x 2 = 8,064 B per token; all-MLA 27 x 576 x 2 = 31,104 B; MHA 27 x 32 x (192 + 128) x 2
    = 552,960 B per token. Weights: 49,122,681,728 parameters (the converter's inventory of the released config)."""
    plan = memory.make_plan(memory.load_config(preset="kimi-linear-48b-a3b"), "48b", memory.parse_size("141GB"),
                            131072)
    c = plan.cache
    assert c.kda_state + c.kda_conv == 43_909_120 and c.mla_per_token == 8_064 and c.hidden == 2304 * 2
    assert c.all_mla_per_token == 31_104 and c.mha_per_token == 552_960
    assert plan.parameters == 49_122_681_728 and plan.weights_bytes == 2 * 49_122_681_728
    budget = 141_000_000_000 - 98_245_363_456
    assert plan.budget == budget
    rows = plan.rows()
    for name, r in rows.items():  # the answers are the largest that fit
        f, p = r["fixed"], r["per_token"]
        assert f + p * r["max_context"] <= budget < f + p * (r["max_context"] + 1), name
        one = f + p * 131072
        assert r["max_batch"] * one <= budget < (r["max_batch"] + 1) * one, name
    assert rows["hybrid"]["max_context"] == (budget - 43_913_728) // 8_065 == 5_295_811
    assert rows["all_mla"]["max_context"] == budget // 31_104 and rows["mha"]["max_context"] == budget // 552_960
    assert rows["mha"]["max_batch"] == 0 and rows["hybrid"]["max_batch"] == 38
    # the instruct preset (the converter's shipped released config) has the same architecture
    inst = memory.make_plan(memory.load_config(preset="kimi-linear-48b-a3b-instruct"), "i", 141 * 10**9, 131072)
    assert inst.parameters == plan.parameters and inst.cache == plan.cache


def test_k3_weights_do_not_fit_one_gpu():
    plan = memory.make_plan(memory.load_config(preset="k3"), "k3", memory.parse_size("141GB"), 131072)
    assert plan.budget < 0 and all(r["max_context"] == 0 and r["max_batch"] == 0 for r in plan.rows().values())
    assert "do not fit" in memory.format_plan(plan)
    cache_only = memory.make_plan(memory.load_config(preset="k3"), "k3", memory.parse_size("141GB"), 131072,
                                  weights_dtype="none", parameters=plan.parameters)
    assert cache_only.budget == 141 * 10**9 and cache_only.rows()["hybrid"]["max_context"] > 4_000_000


def test_parse_size_and_dtypes():
    assert memory.parse_size("141GB") == 141 * 10**9 and memory.parse_size("80GiB") == 80 * 2**30
    assert memory.parse_size("1.5 TB") == 1_500_000_000_000 and memory.parse_size("4096") == 4096
    assert memory.parse_size("512mib") == 512 * 2**20
    with pytest.raises(memory.PlanError, match=r"the size must be positive \(got '-1GB'\)"):
        memory.parse_size("-1GB")
    for bad in ("lots", "80 GiBs", ""):
        with pytest.raises(memory.PlanError, match="cannot read the size"):
            memory.parse_size(bad)
    assert memory.dtype_bytes("fp8", "--weights-dtype") == 1 and memory.dtype_bytes("bf16", "--cache-dtype") == 2
    with pytest.raises(memory.PlanError, match="unknown --cache-dtype 'int4'"):
        memory.dtype_bytes("int4", "--cache-dtype")
    plan32 = memory.CachePlan.from_config(tiny_config(), "float32")
    plan16 = memory.CachePlan.from_config(tiny_config(), "bfloat16")
    assert plan32.kda_state == plan16.kda_state  # the recurrent state is fp32 whatever the cache dtype
    assert plan32.mla_per_token == 2 * plan16.mla_per_token and plan32.kda_conv == 2 * plan16.kda_conv


def test_load_config_sources(tmp_path):
    cfg = memory.load_config(preset="kimi-linear-48b-a3b")
    folder = tmp_path / "m"
    cfg.save_pretrained(folder)
    from_folder = memory.load_config(model=str(folder))
    from_file = memory.load_config(config=str(folder / "config.json"))
    assert memory.CachePlan.from_config(from_folder) == memory.CachePlan.from_config(cfg)
    assert memory.CachePlan.from_config(from_file) == memory.CachePlan.from_config(cfg)
    with pytest.raises(memory.PlanError, match="unknown preset 'kimi-99b'; the presets are kimi-linear-48b-a3b"):
        memory.load_config(preset="kimi-99b")
    with pytest.raises(memory.PlanError, match="give exactly one of"):
        memory.load_config()
    with pytest.raises(memory.PlanError, match="not a model folder with a config.json"):
        memory.load_config(model=str(tmp_path))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(memory.PlanError, match="not a readable JSON config"):
        memory.load_config(config=str(tmp_path / "bad.json"))


def run_memory(*args):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "kimi_hybrid.app.cli", "memory", *args], capture_output=True,
                          text=True, timeout=240, env=env)


def test_cli_memory_prints_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    r = run_memory("--preset", "kimi-linear-48b-a3b", "--gpu-mem", "141GB", "--context", "1048576", "--json",
                   str(out), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert "MLA per token                8,064 B" in r.stdout and "=> bytes(T) = 43,913,728 + 8,065 x T" in r.stdout
    d = json.loads(out.read_text())
    assert d["variants"]["hybrid"]["max_context"] == 5_295_811
    assert d["variants"]["hybrid"]["at_context"] == 43_913_728 + 8_065 * 1_048_576
    assert d["variants"]["hybrid"]["max_batch"] == 42_755_636_544 // (43_913_728 + 8_065 * 1_048_576) == 5
    assert d["variants"]["all_mla"]["max_batch"] == 1 and d["variants"]["mha"]["max_batch"] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


@pytest.mark.parametrize("args, expected", [
    (["--preset", "nope"], "kimi-hybrid: unknown preset 'nope'; the presets are"),
    (["--preset", "k3", "--gpu-mem", "lots"], "kimi-hybrid: cannot read the size 'lots'"),
    (["--preset", "k3", "--context", "0"], "kimi-hybrid: --context must be >= 1 token (got 0)"),
    (["--preset", "k3", "--weights-dtype", "fp7"], "kimi-hybrid: unknown --weights-dtype 'fp7'"),
])
def test_cli_memory_user_errors(args, expected):
    r = run_memory(*args)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(expected), r.stderr


def test_readme_memory_planner_section_is_the_planner_output():
    """The table in README's "Memory planner" section is what the planner prints for the command shown there."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split('<!-- BEGIN section "Memory planner" -->')[1].split("<!-- END")[0]
    assert "kimi-hybrid memory --preset kimi-linear-48b-a3b --gpu-mem 141GB --context 1048576" in section
    plan = memory.make_plan(memory.load_config(preset="kimi-linear-48b-a3b"), "kimi-linear-48b-a3b",
                            memory.parse_size("141GB"), 1048576)
    printed = memory.format_plan(plan).splitlines()
    table = [line for line in section.splitlines() if line.startswith("  ") and (" B " in line or "per token" in line)]
    assert len(table) == 4 and all(line in printed for line in table), table


def test_comparison_header_names_each_column():
    """The comparison table's header: "fixed part" and "total @ N tok" are separate columns (a bare "fixed" next to
    "at N tok" read as one header), each right-aligned over its figures."""
    plan = memory.make_plan(memory.load_config(preset="kimi-linear-48b-a3b"), "kimi-linear-48b-a3b",
                            memory.parse_size("141GB"), 1048576)
    lines = memory.format_plan(plan).splitlines()
    head = next(line for line in lines if line.lstrip().startswith("cache ") and "per token" in line)
    assert "   fixed part   total @ 1,048,576 tok  " in head
    row = next(line for line in lines if line.lstrip().startswith("hybrid"))
    assert row.index("43.91 MB") + len("43.91 MB") == head.index("fixed part") + len("fixed part")
    assert row.index("8.50 GB") + len("8.50 GB") == head.index("1,048,576 tok") + len("1,048,576 tok")


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_cli_memory_unwritable_output_is_a_user_error(tmp_path, option):
    """An output path in a missing folder: one line naming the path, nothing printed before it."""
    target = tmp_path / "no" / "such" / "dir" / "x.out"
    r = run_memory("--preset", "k3", option, str(target))
    assert r.returncode == 1 and "Traceback" not in r.stderr and "please report" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"kimi-hybrid: cannot write {target} ({option}): no such folder {target.parent}; create it first")
    assert r.stdout == ""  # checked before the table is printed


def test_cli_memory_plot_without_matplotlib_fails_before_the_table(monkeypatch, capsys, tmp_path):
    from kimi_hybrid.app import cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as e:
        cli.main(["memory", "--preset", "k3", "--plot", str(tmp_path / "p.png")])
    assert str(e.value.code).startswith("kimi-hybrid: the plot needs matplotlib: pip install")
    assert capsys.readouterr().out == "" and not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("argv", [["--gpu-mem=-5GB"], ["--gpu-mem", "-5GB"], ["--reserve", "-1GiB"]])
def test_cli_memory_negative_size_says_positive(argv):
    r = run_memory("--preset", "k3", *argv)
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stdout == "", r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kimi-hybrid: the size must be positive (got '-"), r.stderr
