"""`zfctl tune-hw` end to end through Typer's CliRunner."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zfctl.app import app

TEMPLATE = Path(__file__).parents[2] / "templates" / "zenflow.json"
TOY = ["--model", "builtin:gpt2-2x128", "--micro-batch", "2", "--seq-len", "16"]


def invoke(*args: str):
    return CliRunner().invoke(app, ["tune-hw", *args])


def check_choices(choices: dict) -> None:
    assert 0 < choices["topk_ratio"] <= 1
    assert isinstance(choices["update_interval"], int) and 1 <= choices["update_interval"] <= 64
    assert 0 < choices["pt_reserved_cores_perc"] < 1
    assert isinstance(choices["overlap_step"], bool)
    assert choices["select_interval"] == "auto" and choices["select_strategy"] == "auto"


def check_topk(data: dict) -> None:
    """topk_ratio is min(memory bound, time bound) of the figures hw.json records."""
    t = data["topk"]
    assert t["fixed"] is False and t["chosen"] == data["choices"]["topk_ratio"]
    assert t["chosen"] == min(t["memory_bound"], t["time_bound"])
    assert round(t["chosen"] * 100) == pytest.approx(t["chosen"] * 100)  # on the 0.01 grid
    time = t["time"]
    if t["time_met"]:
        assert time["total_ms"] <= time["budget_ms"]
    dev = data["probes"]["device_adam"]
    assert time["device_adam_rate"] in [a["params_per_s"] for a in dev.values()]
    link = data["probes"]["link"]
    assert (time["d2h_bytes_per_s"], time["h2d_bytes_per_s"]) == (
        link["d2h_bytes_per_s"],
        link["h2d_bytes_per_s"],
    )
    why = data["reasons"]["topk_ratio"]
    assert "headroom" in why and "forward+backward" in why


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One `tune-hw --quick` run (the default quick model), shared by the checks below."""
    out = tmp_path_factory.mktemp("hw") / "tmp" / "hw.json"
    result = invoke("--quick", "--output", str(out))
    return result, out


def test_quick_writes_hw_json(quick_run):
    result, out = quick_run
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    check_choices(data["choices"])
    assert set(data["reasons"]) >= {
        "topk_ratio",
        "update_interval",
        "select_interval",
        "overlap_step",
        "pt_reserved_cores_perc",
    }
    assert data["settings"] == {
        "model": "builtin:gpt2-4x512",
        "micro_batch": 4,
        "seq_len": 32,
        "quick": True,
        "device": data["device"],
        "bf16": data["device"] != "cpu",  # bf16 "auto": off on a CPU device, on elsewhere
        "device_mem": None,
        "gradient_checkpointing": False,
    }
    assert data["versions"]["torch"] and data["date"]
    probes = data["probes"]
    assert probes["cpu"]["logical_cores"] >= 1 and probes["cpu"]["simd"]["avx2"] is True
    assert probes["memory"]["copy_gbs"] > 0
    assert probes["model"]["params_total"] == 38_867_456  # the ZENFLOW.md section 7 shape
    # Both options of ZENFLOW.md section 7 were measured, and the choice follows them.
    cores = probes["cpu"]["usable_cores"]
    if cores >= 2:
        ov = probes["overlap"][-1]
        assert ov["on_window_ms"] > 0 and ov["off_window_ms"] > 0
        w = data["windows"]
        assert data["choices"]["overlap_step"] == (w["on_ms"] < w["off_ms"])
        if w["measured"]:
            assert (w["on_ms"], w["off_ms"]) == (ov["on_window_ms"], ov["off_window_ms"])
    # A fallback to the reference Adam is always said.
    adam = next(iter(probes["cpu_adam"].values()))
    if adam["backend"] == "reference":
        assert any("reference" in note for note in data["notes"])
    if probes["accelerator"]["kind"] == "cpu":
        assert any("device is the CPU" in note for note in data["notes"])
    assert data["memory_check"]["ok"] is True
    # the host state: exact fits this machine for a 38M model (its whole-run peak, checked)
    assert data["zfctl_choices"] == {"host_state": "exact"}
    # exact is chosen because its whole-run peak fits; compact's peak is not always the
    # smaller: on this model, most of it one embedding, compact's re-selection (the largest
    # weight's 8-bit moments through fp32, 20 B per element) tops exact's first selection
    need = data["memory_check"]["needed"]
    assert need["exact"] <= data["memory_check"]["available"] and need["compact"] > 0
    assert data["reasons"]["host_state"].startswith("exact:")
    # the predicted step of each engine, from this host's measured memory bandwidth
    st = data["step_time"]
    assert st["host_bw_source"] == "measured"
    assert st["host_bw_gbs"] == pytest.approx(probes["memory"]["copy_gbs"])
    assert set(st["engines"]) == {"device", "offload", "zenflow", "zenflow (compact)"}
    assert st["break_even_tokens"]["compact"] <= st["break_even_tokens"]["exact"]
    check_topk(data)
    # The engine cross-check ran both ways, or a note says why not.
    engine = probes["engine"]
    if cores >= 2 and not any("Engine cross-check skipped" in n for n in data["notes"]):
        assert [r["overlap_step"] for r in engine] == [True, False]
        assert "engine cross-check" in data["method"]


def test_quick_prints_table_and_note(quick_run):
    result, out = quick_run
    text = result.stdout
    for key in ("topk_ratio", "update_interval", "overlap_step", "pt_reserved_cores_perc"):
        assert key in text
    assert "host memory OK" in text
    assert "zfctl.host_state" in text and "Predicted step" in text and "Break-even" in text
    assert f"wrote {out}" in text.replace("\n", "")
    data = json.loads(out.read_text())
    if data["probes"]["accelerator"]["kind"] == "cpu":
        flat = " ".join(text.split())
        assert "device is the CPU" in flat
        assert "Offloading has nothing to win here" in flat
        assert "--engine device" in flat and "--device sim" in flat
        assert "CPU-only" in flat and data["cpu_only"] is True
        assert flat.index("nothing to win") < flat.index("topk_ratio")  # said first


def test_sim_rehearses_a_gpu_box(tmp_path):
    """--device sim: the sim's modelled bandwidth, its core split, the probe model and the
    engine cross-check on the simulated device; --device-mem models the GPU's memory; the
    host's accumulation is measured and bounds topk; --gradient-checkpointing is timed."""
    from zenflow.engine.accelerator import SIM_BANDWIDTH

    out = tmp_path / "hw.json"
    result = invoke("--quick", *TOY, "--device", "sim", "--device-mem", "1GiB", "--no-bf16",
                    "--gradient-checkpointing", "--output", str(out), "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["device"] == "sim" and data["cpu_only"] is False
    assert data["settings"]["device_mem"] == 2**30 and data["settings"]["bf16"] is False
    assert data["settings"]["gradient_checkpointing"] is True
    acc = data["probes"]["host_accumulate"]
    assert acc and all(a["elements_per_s"] > 0 and a["src_dtype"] == "float32"
                       for a in acc.values())  # fmt: skip
    assert data["topk"]["time"]["host_accumulate_rate"] in [
        a["elements_per_s"] for a in acc.values()
    ]
    check_choices(data["choices"])
    check_topk(data)
    assert data["probes"]["accelerator"]["kind"] == "sim"
    assert data["probes"]["link"]["d2h_bytes_per_s"] == SIM_BANDWIDTH
    assert data["probes"]["device_memory"] == {
        "device_bytes": 2**30,
        "host_bytes": data["probes"]["memory"]["available_bytes"],
        "shared": False,
        "source": "--device-mem",
    }
    assert data["probes"]["model"]["dtype"] == "fp32"
    assert data["topk"]["time"]["dtype_bytes"] == 4  # --no-bf16: the copies carry fp32
    assert any("Rehearsal on the simulated device" in n for n in data["notes"])
    cores = data["probes"]["cpu"]["usable_cores"]
    if cores >= 2:
        # The device computes on its share: the time bound hides under that share's
        # forward+backward, and the device AdamW was measured on the same threads.
        train = round(data["choices"]["pt_reserved_cores_perc"] * cores)
        assert str(train) in data["probes"]["device_adam"]
        assert all(ov["off_split"] for ov in data["probes"]["overlap"])
        if not any("Engine cross-check skipped" in n for n in data["notes"]):
            assert {r["accelerator"] for r in data["probes"]["engine"]} == {"sim"}


def test_config_write_updates_zenflow_block(tmp_path):
    from zenflow.config import load_config

    cfg = tmp_path / "ds.json"
    original = json.loads(TEMPLATE.read_text())
    original["zero_optimization"]["zenflow"]["update_interval"] = 99  # surely changed
    cfg.write_text(json.dumps(original))
    out = tmp_path / "hw.json"

    shown = invoke("--quick", *TOY, "--output", str(out), "--config", str(cfg))
    assert shown.exit_code == 0, shown.output
    assert json.loads(cfg.read_text()) == original  # a diff only, without --write
    assert "zero_optimization.zenflow.update_interval: 99 ->" in shown.stdout
    assert 'zfctl.host_state: "<unset>" -> "exact"' in shown.stdout  # this host holds it
    assert "add --write" in shown.stdout

    written = invoke("--quick", *TOY, "--output", str(out), "--config", str(cfg), "--write")
    assert written.exit_code == 0, written.output
    hw = json.loads(out.read_text())
    choices = hw["choices"]
    assert hw["settings"]["bf16"] is False  # the dtype the config trains in (bf16 disabled)
    check_choices(choices)
    after = json.loads(cfg.read_text())
    assert after["zero_optimization"]["zenflow"] == {
        **original["zero_optimization"]["zenflow"],
        **choices,
    }
    # the host state chosen goes to the zfctl block, beside its other keys
    assert hw["zfctl_choices"] == {"host_state": "exact"}
    assert after["zfctl"] == {**original["zfctl"], "host_state": "exact"}
    assert load_config(cfg).engine.host_state == "exact"
    for key in original:  # every other key kept as it was
        if key not in ("zero_optimization", "zfctl"):
            assert after[key] == original[key]
    assert after["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    zf = load_config(cfg).zenflow
    assert zf.update_interval == choices["update_interval"]
    assert zf.topk_ratio == choices["topk_ratio"]
    assert zf.overlap_step == choices["overlap_step"]


def test_config_layout_reads_what_changes_the_memory():
    from zfctl.tune_hw import config_layout

    doc = {"gradient_accumulation_steps": 4, "zfctl": {"grad_accumulation": "device",
                                                       "copy_buckets": 8}}  # fmt: skip
    assert config_layout(doc) == {"gradient_accumulation_steps": 4, "grad_accumulation": "device",
                                  "stream_grads": True, "copy_buckets": 8, "step_store": "auto",
                                  "clipping": True}  # fmt: skip
    no_clip = {"gradient_clipping": 0, "zfctl": {"step_store": "off"}}
    assert config_layout(no_clip)["step_store"] == "off" and not config_layout(no_clip)["clipping"]


def test_json_prints_hw_json(tmp_path):
    out = tmp_path / "hw.json"
    result = invoke("--quick", *TOY, "--topk", "0.25", "--output", str(out), "--json")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed == json.loads(out.read_text())
    assert printed["choices"]["topk_ratio"] == 0.25
    assert printed["settings"]["model"] == "builtin:gpt2-2x128"


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--write"], "--write"),
        (["--topk", "0"], "--topk"),
        (["--topk", "1.5"], "--topk"),
        (["--micro-batch", "0"], "--micro-batch"),
        (["--device", "tpu"], "--device"),
        (["--device", "cpu", "--device-mem", "1GiB"], "--device-mem"),
        (["--device", "sim", "--device-mem", "lots"], "--device-mem"),
    ],
)
def test_bad_flags_exit_2(args, flag, tmp_path):
    result = invoke("--quick", "--output", str(tmp_path / "hw.json"), *args)
    assert result.exit_code == 2
    assert flag in result.output
    assert not (tmp_path / "hw.json").exists()


def test_cuda_without_cuda_says_what_to_use(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "hw.json"
    result = invoke("--quick", "--device", "cuda", "--output", str(out))
    assert result.exit_code == 2
    flat = " ".join(result.output.split())
    assert "sees no CUDA device" in flat and "--device sim" in flat
    assert not out.exists()


def test_unreadable_config_is_a_user_error(tmp_path):
    from zenflow.errors import UserInputError

    out = tmp_path / "hw.json"
    result = invoke("--quick", "--output", str(out), "--config", str(tmp_path / "nope.json"))
    if isinstance(result.exception, UserInputError):  # a bare app without the error handler
        assert "cannot be read" in str(result.exception)
    else:  # zfctl's app: one red line, exit 2
        assert result.exit_code == 2 and "cannot be read" in result.output
    assert not out.exists()  # failed before measuring anything


@pytest.fixture
def probes(monkeypatch):
    """Records every call of the probing entry point (and measures nothing)."""
    from zenflow.hardware import tune_run

    calls = []

    def fake(settings):
        calls.append(settings)
        return {"choices": {}}

    monkeypatch.setattr(tune_run, "run_tune", fake)
    return calls


def _refused_before_probing(result, probes, *fragments) -> str:
    text = " ".join(result.output.split())
    assert result.exit_code == 2, text
    assert probes == []  # refused before any probe ran (the old code probed for minutes)
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    return text


def test_output_that_cannot_be_written_is_refused_before_probing(tmp_path, probes):
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = blocker / "hw.json"  # a file where a folder must be
    r = invoke("--quick", "--output", str(out))
    _refused_before_probing(r, probes, f"--output: cannot write {out}: Not a directory")
    r = invoke("--quick", "--output", str(tmp_path))
    _refused_before_probing(r, probes, f"--output: cannot write {tmp_path}: it is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_config_write_that_cannot_be_written_is_refused_before_probing(
    tmp_path, probes, monkeypatch
):
    """The config's folder cannot be written into (os.access says so for it alone: a
    read-only folder that works as root too); --config without --write is only read."""
    import zenflow.outputs

    folder = tmp_path / "configs"
    folder.mkdir()
    cfg = folder / "ds.json"
    cfg.write_text(TEMPLATE.read_text())
    real_access = os.access
    monkeypatch.setattr(
        zenflow.outputs.os, "access", lambda p, mode: Path(p) != folder and real_access(p, mode)
    )
    out = tmp_path / "hw.json"
    r = invoke("--quick", "--output", str(out), "--config", str(cfg), "--write")
    text = _refused_before_probing(r, probes, f"--config ... --write: cannot write {cfg}")
    assert "Permission denied" in text and not out.exists()
    r = invoke("--quick", "--output", str(out), "--config", str(cfg))
    assert probes  # without --write nothing is written to the config: it probes


def test_a_failed_write_names_the_output_not_its_temp_file(tmp_path, probes, monkeypatch):
    def refuse(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", src)

    monkeypatch.setattr(os, "replace", refuse)
    out = tmp_path / "hw.json"
    r = invoke("--quick", "--output", str(out))
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and f"--output: cannot write {out}: Permission denied" in text
    assert ".tmp" not in text and list(tmp_path.iterdir()) == []


def test_importing_the_command_imports_no_torch():
    code = "import sys, zfctl.tune_hw; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=300).returncode == 0


@pytest.mark.slow
def test_full_run_builds_native_adam(tmp_path):
    """Without --quick: the native CPU Adam is built and measured (about a minute or more)."""
    out = tmp_path / "hw.json"
    result = invoke("--model", "builtin:gpt2-4x512", "--output", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    check_choices(data["choices"])
    adam = next(iter(data["probes"]["cpu_adam"].values()))
    assert adam["backend"] == "native", adam["fallback_reason"]
