"""`zfctl env`: the values it reports are the real ones, and it never compiles by itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib import metadata

import pytest
import torch

import zfctl
from zenflow import ops
from zenflow.hardware import probes as hw
from zenflow.hardware import tuning
from zenflow.train import runs
from zfctl import env_cmd


def env_json(cli, *args) -> dict:
    """Run `zfctl env --json ...`; stdout must be exactly one JSON document."""
    r = cli("env", "--json", *args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def tune_hw_result() -> dict:
    """A hw.json in tune-hw's format, decided by zenflow.hardware.tuning.choose from synthetic
    figures."""
    choices = tuning.choose(
        tuning.TuneInputs(
            cores=8, params_total=124_000_000, params_2d=85_000_000, fb_all_ms=120.0,
            fb_split_ms=200.0, train_threads=4, adam_rate_worker=2.0e8, adam_rate_all=4.0e8,
            mem_available_bytes=64 * 2**30, topk_ratio=0.1,
        )
    )  # fmt: skip
    return {
        "date": "2026-01-02T03:04:05+00:00",
        "versions": {"python": "3.11.7", "torch": torch.__version__},
        "settings": {"model": "gpt2", "micro_batch": 8, "seq_len": 128, "quick": False},
        "method": "components",
        "probes": {},
        "choices": choices.zenflow_block(),
        "reasons": choices.reasons,
        "windows": choices.windows,
        "memory_check": {**choices.memory, "verdict": tuning.memory_verdict(choices.memory)},
        "notes": [],
    }


def test_json_reports_installed_versions(cli, tmp_path):
    info = env_json(cli, "--hw", tmp_path / "hw.json")
    v = info["versions"]
    assert v["torch"] == torch.__version__
    try:
        deepspeed = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        deepspeed = "not installed"
    assert v["deepspeed"] == deepspeed
    assert v["rich"] == metadata.version("rich") and v["typer"] == metadata.version("typer")
    assert v["zfctl"] == zfctl.__version__
    assert v["python_executable"] == sys.executable
    assert v["python"].startswith(".".join(map(str, sys.version_info[:3])))
    assert set(env_cmd.PACKAGES) <= set(v)
    pinned_problem = [p for p in info["problems"] if "deepspeed" in p]
    assert bool(pinned_problem) == (deepspeed != "0.19.6")


def test_json_reports_device_and_cpu(cli, tmp_path):
    info = env_json(cli, "--hw", tmp_path / "hw.json")
    dev = info["device"]
    assert dev["cuda_available"] is torch.cuda.is_available()
    if not dev["cuda_available"]:
        assert dev["device"] == "cpu (no CUDA device: the device is the CPU itself)"
        assert dev["cuda_devices"] == []
    else:
        assert len(dev["cuda_devices"]) == torch.cuda.device_count()
    assert dev["torch_num_threads"] == torch.get_num_threads()
    assert dev["os_cpu_count"] == os.cpu_count()
    assert dev["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert any("parallel backend" in line for line in dev["parallel_info"])
    probe = hw.probe_cpu()
    cpu = info["cpu"]
    assert cpu["model"] == probe.model and cpu["logical_cores"] == probe.logical_cores
    assert list(cpu["flags"]) == ["avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx"]
    if os.path.exists("/proc/cpuinfo"):
        assert cpu["flags"]["avx2"] == probe.simd["avx2"]
        flags = hw.parse_cpuinfo(open("/proc/cpuinfo").read())["flags"]
        assert cpu["flags"]["f16c"] == ("f16c" in flags)


def test_native_status_matches_zenflow_and_builds_nothing(cli, tmp_path, monkeypatch):
    build_root = tmp_path / "build"
    monkeypatch.setenv("ZENFLOW_BUILD_DIR", str(build_root))
    monkeypatch.delenv("ZENFLOW_OPS", raising=False)
    info = env_json(cli, "--hw", tmp_path / "hw.json")
    native, expected = info["native"], ops.native_status()
    for key in ("state", "ops", "build_dir", "key", "cpu_capability", "error"):
        assert native[key] == expected[key], key
    assert native["build_dir"] == str(build_root / expected["key"])
    assert native["ops"] == "native"
    if native["state"] == "not-built":
        assert native["cached_library"] is False
    assert not build_root.exists()  # env without --build compiled nothing, made no folder
    r = cli("env", "--hw", tmp_path / "hw.json")
    assert r.exit_code == 0, r.output
    if native["state"] == "not-built":
        assert "not built" in r.output and "zfctl env --build" in r.output
    assert expected["key"] in r.output


def test_failed_build_log_is_a_problem_and_dead_lock_is_shown(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("ZENFLOW_BUILD_DIR", str(tmp_path))
    directory = tmp_path / ops.native_status()["key"]
    directory.mkdir()
    (directory / "build.log").write_text("zenflow native build failed\nerror: boom\n")
    lock = directory / "lock"
    lock.write_text("")
    old = time.time() - 3600
    os.utime(lock, (old, old))
    info = env_json(cli, "--hw", tmp_path / "hw.json")
    assert info["native"]["build_log"] == {
        "path": str(directory / "build.log"),
        "first_line": "zenflow native build failed",
    }
    assert info["native"]["lock_age_s"] >= 3599
    assert info["native"]["build_running"] is False
    problems = "\n".join(info["problems"])
    assert f"the last native build failed; the compiler output is in {directory}" in problems
    # A killed build's lock is no problem: the guarded build clears it.
    assert "lock" not in problems
    r = cli("env", "--hw", str(tmp_path / "hw.json"))
    assert r.exit_code == 0, r.output
    assert "left by a killed build" in r.output and "the next build clears it" in r.output


def test_offline_variables_and_glue_dir(cli, tmp_path, monkeypatch):
    glue = tmp_path / "glue"
    (glue / "sst2").mkdir(parents=True)
    monkeypatch.setenv("GLUE_DIR", str(glue))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("ZENFLOW_OPS", "reference")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    info = env_json(cli, "--hw", tmp_path / "hw.json")
    e = info["environment"]
    assert e["GLUE_DIR"] == str(glue)
    assert e["glue_sst2_train"] == {"path": str(glue / "sst2" / "train.tsv"), "exists": False}
    assert e["HF_HUB_OFFLINE"] == "1"  # set by tests/conftest.py for every test
    assert e["HF_HOME"] == str(tmp_path / "hf")
    assert e["TRANSFORMERS_OFFLINE"] is None
    assert e["ZENFLOW_OPS"] == "reference" and info["native"]["ops"] == "reference"
    (glue / "sst2" / "train.tsv").write_text("sentence\tlabel\nok\t1\n")
    assert env_json(cli, "--hw", tmp_path / "hw.json")["environment"]["glue_sst2_train"]["exists"]
    r = cli("env", "--hw", tmp_path / "hw.json")
    assert f"{glue / 'sst2' / 'train.tsv'} found" in r.output


def test_hw_json_choices_shown(cli, tmp_path):
    result = tune_hw_result()
    path = tmp_path / "hw.json"
    runs.write_json_atomic(path, result)
    info = env_json(cli, "--hw", path)
    shown = info["hw"]
    assert shown["present"] is True and shown["path"] == str(path)
    assert shown["choices"] == result["choices"]
    assert shown["reasons"] == result["reasons"]
    assert shown["memory_verdict"] == result["memory_check"]["verdict"]
    assert shown["notes"] == [] and info["problems"] == []
    r = cli("env", "--hw", path)
    assert r.exit_code == 0, r.output
    for key, value in result["choices"].items():
        assert f"{key}" in r.output and json.dumps(value) in r.output
    assert "2026-01-02T03:04:05+00:00, model gpt2" in r.output


def test_hw_json_from_older_torch_gets_a_note(cli, tmp_path):
    result = tune_hw_result()
    result["versions"]["torch"] = "1.0.0"
    path = tmp_path / "hw.json"
    runs.write_json_atomic(path, result)
    notes = env_json(cli, "--hw", path)["hw"]["notes"]
    assert len(notes) == 1 and "measured with torch 1.0.0" in notes[0]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"choices": {"topk_ratio": 0.1', "is not valid JSON"),
        ("[1, 2]", "has no 'choices' object"),
    ],
)
def test_broken_hw_json_is_a_problem_not_a_crash(cli, tmp_path, text, fragment):
    path = tmp_path / "hw.json"
    path.write_text(text)
    info = env_json(cli, "--hw", path)
    assert "choices" not in info["hw"] and info["hw"]["present"] is True
    matching = [p for p in info["problems"] if fragment in p]
    assert len(matching) == 1 and str(path) in matching[0], info["problems"]
    r = cli("env", "--hw", path)
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    assert "problems:" in r.output and fragment in r.output


def test_missing_hw_json_says_to_run_tune_hw(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    info = env_json(cli)
    assert info["hw"] == {
        "path": "hw.json",
        "present": False,
        "message": "no hw.json (run `zfctl tune-hw`)",
    }
    assert not any("hw.json" in p for p in info["problems"])
    r = cli("env")
    assert r.exit_code == 0, r.output
    assert "no hw.json (run `zfctl tune-hw`)" in r.output
    other = tmp_path / "sub" / "mine.json"
    assert env_json(cli, "--hw", other)["hw"]["message"] == (
        f"no hw.json at {other} (run `zfctl tune-hw --output {other}`)"
    )


def test_plain_output_shows_versions(cli, tmp_path):
    r = cli("env", "--hw", tmp_path / "hw.json")
    assert r.exit_code == 0, r.output
    rows = [line.split("│") for line in r.output.splitlines() if line.count("│") == 3]
    assert ["torch", torch.__version__] in [[c.strip() for c in row[1:3]] for row in rows]
    assert "deepspeed" in r.output and metadata.version("deepspeed") in r.output
    assert sys.executable in r.output


def test_deepspeed_off_the_pin_is_flagged(cli, tmp_path, monkeypatch):
    real = metadata.version

    def fake(dist: str) -> str:
        return "0.19.7" if dist == "deepspeed" else real(dist)

    monkeypatch.setattr(metadata, "version", fake)
    info = env_cmd.collect_env(tmp_path / "hw.json")
    assert info["versions"]["deepspeed"] == "0.19.7"
    flagged = [p for p in info["problems"] if "deepspeed 0.19.7" in p]
    assert len(flagged) == 1 and "deepspeed==0.19.6" in flagged[0]
    r = cli("env", "--hw", tmp_path / "hw.json")
    assert "0.19.7 (warning: zenflow is pinned to deepspeed==0.19.6" in r.output


def test_a_failing_section_is_reported_and_the_rest_shown(cli, tmp_path, monkeypatch):
    def boom(problems):
        raise RuntimeError("no device today")

    monkeypatch.setattr(env_cmd, "collect_device", boom)
    info = env_json(cli, "--hw", tmp_path / "hw.json")
    assert info["device"] == {"gather_error": "RuntimeError: no device today"}
    assert info["versions"]["torch"] == torch.__version__
    assert "could not gather device: RuntimeError: no device today" in info["problems"]
    r = cli("env", "--hw", tmp_path / "hw.json")
    assert r.exit_code == 0 and "could not gather: RuntimeError: no device today" in r.output


def test_build_loads_a_cached_native_op(cli, tmp_path, monkeypatch):
    monkeypatch.delenv("ZENFLOW_OPS", raising=False)
    status = ops.native_status()
    if not (status["state"] in ("built", "cached") or status.get("cached_library")):
        pytest.skip("the native op is not built yet; `zfctl env --build` would compile (~1 min)")
    info = env_json(cli, "--build", "--hw", tmp_path / "hw.json")
    attempt = info["native"]["build_attempt"]
    assert attempt["ok"] is True and attempt["state"] in ("built", "cached")
    assert info["native"]["state"] == attempt["state"] == ops.native_status()["state"]
    assert hasattr(torch.ops.zenflow, "adamw_step_")
    assert info["native"]["simd_path"] == ops.simd_path() in ("avx512", "avx2", "scalar")
    assert "-march=" in info["native"]["flags"]


def test_env_module_imports_no_torch():
    code = "import sys, zfctl.env_cmd; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=300).returncode == 0
