"""The CLI and app fixes of a new user's trial (issue 25): released Kimi-Linear folders load as ours at every entry
point, ``--trust-remote-code`` runs the folder's code, an unreachable Hub fails fast, atomic export, ``| head``,
malformed repo ids, the memory planner's config check and presets, the converter's ``--from`` check, the CLI's
strict-loading message, and Ctrl-D in chat. CPU only, no network (the unreachable-Hub test points ``HF_ENDPOINT``
at a closed local port)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conversion_fixtures import released_tensors, tiny_released_config, write_checkpoint
from kimi_hybrid import KimiHybridForCausalLM
from kimi_hybrid.app import cli, hub, memory
from kimi_hybrid.tokenization_kimi_hybrid import KimiHybridTokenizer

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "models" / "kimi-hybrid-stdlib"


@pytest.fixture(scope="module")
def tokenizer():
    return KimiHybridTokenizer.from_pretrained(str(EMBEDDED))


@pytest.fixture(scope="module")
def released(tmp_path_factory, tokenizer) -> Path:
    """A tiny released-format Kimi-Linear folder (model_type kimi_linear, released tensor names, an auto_map to
    code it does not ship, as the Hub copies' config.json has), with the stdlib tokenizer."""
    cfg = tiny_released_config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                               dtype="float32")
    folder = tmp_path_factory.mktemp("released") / "Kimi-Linear-tiny"
    folder.mkdir()
    tensors = {k: v.float() for k, v in released_tensors(cfg).items()}
    write_checkpoint(str(folder), cfg, tensors)
    tokenizer.save_pretrained(folder)
    return folder


def run_cli(*args, env_extra=None, timeout=240, **kw):
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    env.update(env_extra or {})
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run([sys.executable, "-m", "kimi_hybrid.app.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env, **kw)


# ---------------------------------------------------------------------------------------------------------------
# item 1: released folders are ours at every entry point
# ---------------------------------------------------------------------------------------------------------------

def test_cli_loads_a_released_folder_as_ours(released):
    lm, tok = cli.load_model_and_tokenizer(str(released), "cpu", torch.float32)
    assert type(lm) is KimiHybridForCausalLM
    ref = KimiHybridForCausalLM.from_pretrained(str(released), dtype=torch.float32).eval()
    ids = torch.tensor([tok("def f(x):").input_ids])
    with torch.no_grad():
        assert torch.equal(lm(ids).logits, ref(ids).logits)


def test_generate_on_a_released_folder_runs_our_model(released):
    r = run_cli("generate", "--model", str(released), "--prompt", "def f(x):", "--max-new-tokens", "4",
                "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "cache memory (KimiHybridCache.memory_report)" in r.stdout  # our cache, so our model
    assert "falling back" not in r.stderr


def test_export_of_a_released_folder_is_complete_and_loads(released, tmp_path, capsys):
    out = tmp_path / "export"
    assert cli.main(["export", "--model", str(released), "--out", str(out), "--device", "cpu"]) == 0
    assert hub.missing_files(out) == []
    back = KimiHybridForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ref = KimiHybridForCausalLM.from_pretrained(str(released), dtype=torch.float32)
    sd, ref_sd = back.state_dict(), ref.state_dict()
    assert sd.keys() == ref_sd.keys() and all(torch.equal(sd[k], ref_sd[k]) for k in sd)


def test_a_folder_that_is_not_kimi_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(SystemExit) as e:
        cli.load_config(str(tmp_path))
    assert str(e.value.code).startswith("kimi-hybrid: ") and "model_type 'llama'" in str(e.value.code)


# ---------------------------------------------------------------------------------------------------------------
# item 6: --trust-remote-code runs the folder's code
# ---------------------------------------------------------------------------------------------------------------

def test_trust_remote_code_runs_the_folders_own_code(released, tmp_path, capsys):
    folder = tmp_path / "hub"
    assert cli.main(["export", "--model", str(released), "--out", str(folder), "--device", "cpu"]) == 0
    modeling = folder / "modeling_kimi_hybrid.py"
    modeling.write_text(modeling.read_text() + "\nTRIAL_MARKER = 'the folder copy'\n")
    lm, _ = cli.load_model_and_tokenizer(str(folder), "cpu", torch.float32, trust_remote_code=True)
    module = sys.modules[type(lm).__module__]
    assert not type(lm).__module__.startswith("kimi_hybrid")
    assert getattr(module, "TRIAL_MARKER", None) == "the folder copy"
    assert "running the folder's own" in capsys.readouterr().err
    # without the flag: the installed package
    lm, _ = cli.load_model_and_tokenizer(str(folder), "cpu", torch.float32)
    assert type(lm) is KimiHybridForCausalLM


def test_trust_remote_code_on_a_folder_without_code_says_so(tmp_path, tokenizer):
    from presets import preset_config

    folder = tmp_path / "plain"
    KimiHybridForCausalLM(preset_config("tiny-kda-first", vocab_size=len(tokenizer))).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for code in folder.glob("*.py"):
        code.unlink()
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("auto_map", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as e:
        cli.load_model_and_tokenizer(str(folder), "cpu", torch.float32, trust_remote_code=True)
    assert "ships no code of its own" in str(e.value.code) and "\n" not in str(e.value.code)


# ---------------------------------------------------------------------------------------------------------------
# item 7: an unreachable Hub fails at once
# ---------------------------------------------------------------------------------------------------------------

def test_unreachable_hub_is_one_line_and_fast(tmp_path):
    t0 = time.monotonic()
    r = run_cli("generate", "--model", "nobody-here/no-such-model", "--prompt", "x", "--device", "cpu",
                env_extra={"HF_HUB_OFFLINE": None, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path)},
                timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    assert "Retry" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("kimi-hybrid: loading")]
    assert len(lines) == 1 and lines[0].startswith(
        "kimi-hybrid: cannot load 'nobody-here/no-such-model' from the Hugging Face Hub"), r.stderr
    assert elapsed < 25, elapsed  # start-up ~5-10 s; huggingface_hub's 5 retries with backoff took 30-50 s


# ---------------------------------------------------------------------------------------------------------------
# item 5: atomic export
# ---------------------------------------------------------------------------------------------------------------

def _interrupt_tokenizer_save(monkeypatch):
    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(KimiHybridTokenizer, "save_pretrained", interrupted)


def test_interrupted_export_leaves_nothing(released, tmp_path, monkeypatch, capsys):
    out = tmp_path / "export"
    _interrupt_tokenizer_save(monkeypatch)  # Ctrl-C after the weights and the code are written
    assert cli.main(["export", "--model", str(released), "--out", str(out), "--device", "cpu"]) == 130
    assert not out.exists() and list(tmp_path.iterdir()) == []
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("kimi-hybrid: interrupted;") and "left as it was" in err


def test_interrupted_export_over_a_previous_one_keeps_it(released, tmp_path, monkeypatch, capsys):
    out = tmp_path / "export"
    assert cli.main(["export", "--model", str(released), "--out", str(out), "--device", "cpu"]) == 0
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with monkeypatch.context() as m:
        _interrupt_tokenizer_save(m)
        assert cli.main(["export", "--model", str(released), "--out", str(out), "--device", "cpu"]) == 130
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    # a complete re-export replaces the files, keeps the user's own file and the folder's mode
    assert cli.main(["export", "--model", str(released), "--out", str(out), "--device", "cpu"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and hub.missing_files(out) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask


# ---------------------------------------------------------------------------------------------------------------
# item 9: | head, malformed repo ids
# ---------------------------------------------------------------------------------------------------------------

def test_closed_stdout_exits_quietly():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    p = subprocess.Popen([sys.executable, "-m", "kimi_hybrid.app.cli", "memory", "--preset", "kimi-linear-48b-a3b"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.close()  # the reader is gone before the table is written (`| head` that already exited)
    err = p.stderr.read().decode()
    assert p.wait(timeout=240) in (0, 141), err
    assert err == "", err


@pytest.mark.parametrize("repo_id", ["not a valid id!!", "a/b/c", ""])
def test_malformed_repo_id_is_refused_before_loading(repo_id, monkeypatch):
    def no_loading(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "load_model_and_tokenizer", no_loading)
    for command in (["push"], ["export", "--out", "/nonexistent-out"]):
        with pytest.raises(SystemExit) as e:
            cli.main([*command, "--repo-id", repo_id, "--device", "cpu"])
        msg = str(e.value.code)
        assert msg.startswith(f"kimi-hybrid: --repo-id {repo_id!r} is not a Hub repo id") and "\n" not in msg


def test_out_of_memory_is_one_line(monkeypatch):
    def oom(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 10737418240 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(cli, "read_prompt", oom)  # the first step of `generate`
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompt", "x"])
    msg = str(e.value.code)
    assert msg.startswith("kimi-hybrid: out of memory (") and "shorter prompt" in msg
    assert "please report" not in msg and "\n" not in msg


# ---------------------------------------------------------------------------------------------------------------
# item 8 / 12: the planner's config check and presets, the converter's --from, strict loading, Ctrl-D
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [{"a": 1}, {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096}])
def test_memory_config_is_validated_like_the_converters_inventory(config, tmp_path):
    from kimi_hybrid.conversion.__main__ import main as convert_main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(memory.PlanError, match="is not a KimiHybrid / Kimi-Linear / K3 config"):
        memory.load_config(config=str(path))
    assert convert_main(["inventory", "--config", str(path)]) == 2


def test_memory_and_inventory_take_the_same_presets(capsys):
    from kimi_hybrid.conversion import config_io
    from kimi_hybrid.conversion.__main__ import main as convert_main

    for name in (*memory.PRESET_NAMES, *memory.PRESET_ALIASES):
        memory.load_config(preset=name)
        assert convert_main(["inventory", "--preset", name]) == 0, name
    assert set(memory.PRESET_NAMES) == set(config_io.RELEASED_PRESETS)
    assert "kimi-k3" in memory.PRESET_NAMES and "kimi-linear-48b-a3b" in memory.PRESET_NAMES


@pytest.mark.parametrize("wrong", ["k3", "native"])
def test_convert_from_that_contradicts_the_config_is_refused(released, tmp_path, wrong, capsys):
    from kimi_hybrid.conversion.__main__ import main as convert_main

    out = tmp_path / "out"
    assert convert_main(["convert", str(released), str(out), "--from", wrong, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--from {wrong}: {released} holds a 'released' checkpoint" in err
    assert not out.exists()


def test_k3_planner_prints_no_negative_bytes():
    r = subprocess.run([sys.executable, "-m", "kimi_hybrid.app.cli", "memory", "--preset", "k3"], cwd=ROOT,
                       capture_output=True, text=True, timeout=240, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stderr
    assert not re.search(r"-\s*[0-9.,]+\s*[kMGT]?B\b", r.stdout.replace("GPU 141.00 GB - weights", "")
                         .replace(" - reserve", "")), r.stdout
    assert "leaves nothing for the cache (5.42 TB short)" in r.stdout


def test_strict_loading_message_says_what_a_cli_user_can_do(released, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(released, bad)
    weights = next(bad.glob("*.safetensors"))
    tensors = load_file(str(weights))
    tensors.pop(next(k for k in tensors if k.endswith("q_proj.weight")))
    save_file(tensors, str(weights), metadata={"format": "pt"})
    index = bad / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if k in tensors or v != weights.name}
        index.write_text(json.dumps(data))
    with pytest.raises(SystemExit) as e:
        cli.load_model_and_tokenizer(str(bad), "cpu", torch.float32)
    msg = str(e.value.code)
    assert msg.startswith(f"kimi-hybrid: the weights in {bad} do not match its config: missing 1 tensor(s)"), msg
    assert "pass strict_loading=False" not in msg and "kimi-hybrid-convert" in msg and "\n" not in msg


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_ctrl_d_in_chat_ends_on_a_new_line(released):
    master, slave = os.openpty()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    p = subprocess.Popen([sys.executable, "-m", "kimi_hybrid.app.cli", "chat", "--model", str(released), "--device",
                          "cpu", "--no-memory-report"], cwd=ROOT, stdin=slave, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    os.close(slave)
    try:
        time.sleep(0.5)
        os.write(master, b"\x04")  # Ctrl-D on an empty line: end of input
        _, err = p.communicate(timeout=240)
    finally:
        os.close(master)
    assert p.returncode == 0, err
    assert err.decode().endswith("you> \n"), err[-300:]


def test_users_get_the_clis_memory_table(released, capsys):
    """``print_memory_report(cache)`` prints the table ``kimi-hybrid generate`` prints (one formatter for both)."""
    from kimi_hybrid import KimiHybridCache
    from kimi_hybrid.app.memory import format_memory_report, print_memory_report

    model = KimiHybridForCausalLM.from_pretrained(str(released), dtype=torch.float32).eval()
    cache = KimiHybridCache(model.config)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, cache=cache)
    print_memory_report(cache)
    out = capsys.readouterr().out
    assert out == format_memory_report(cache.memory_report()) + "\n"
    # 5 prompt tokens + 2 of the 3 new ones (the last is not fed back)
    assert out.startswith("cache memory (KimiHybridCache.memory_report): 7 tokens, batch 1")
    assert cli.format_memory_report is format_memory_report


@pytest.mark.parametrize("command", ["kimi-hybrid", "kimi-hybrid-convert"])
def test_ctrl_c_during_start_up_is_one_line(command):
    """Ctrl-C while the commands import torch / transformers (the first seconds) ends with one line and status 130,
    no traceback (issue 25 item 12). The console scripts are the installed ones beside this interpreter."""
    import signal

    script = Path(sys.executable).parent / command
    if not script.exists():
        pytest.skip(f"{command} is not installed beside {sys.executable} (pip install -e . creates it)")
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    args = ["generate", "--prompt", "def f(", "--max-new-tokens", "400"] if command == "kimi-hybrid" else \
        ["inventory", "--preset", "kimi-linear-48b-a3b"]
    p = subprocess.Popen([str(script), *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    time.sleep(1.0)  # inside the imports (torch alone takes longer), or at worst in the command itself
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    err = err.decode()
    assert p.returncode == 130, (p.returncode, err[-2000:])
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "interrupted" in err, err[-2000:]
