"""`zfctl estimate` through the CLI (tables show the JSON's numbers, errors exit 2), and the
preflight check of `zfctl finetune` (refusal with exit 2, --force, the env variable)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clihelp import assert_user_error

from zenflow.train import runs
from zfctl.estimate_render import fmt_bytes

BOX = ["--device-mem", "24GiB", "--host-mem", "256GiB"]
README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def estimate_json(cli, *args) -> dict:
    r = cli("estimate", *args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)  # stdout is exactly one JSON document


def test_json_for_a_7b_architecture(cli):
    data = estimate_json(cli, "llama-7b", *BOX, "--micro-batch", "1", "--seq-len", "512")
    assert data["params"] == 6_607_351_808
    assert (data["device_mem"], data["host_mem"]) == (24 * 2**30, 256 * 2**30)
    assert data["dtype"] == "bf16" and data["topk_ratio"] == 0.1
    assert (data["micro_batch"], data["seq_len"]) == (1, 512)
    for mode in ("device", "offload", "zenflow", "zenflow (compact)"):
        eng = data["engines"][mode]
        # the host is checked at the whole run's peak, not the steady state
        assert eng["host_peak_bytes"] > eng["host_bytes"]
        expect = (
            eng["device_bytes"] <= data["device_mem"] and eng["host_peak_bytes"] <= data["host_mem"]
        )
        assert eng["fits"] is expect
        # a separate device: only the buffers that cross the link are pinned
        pinned = sum(i["bytes"] for i in eng["items"] if i["side"] == "host" and i["pinned"])
        assert eng["pinned_bytes"] == pinned
    # streamed: 2 + 14k bytes per parameter, the gradient in flight, 2 copy buckets of 48M
    # elements ("auto" for a model this size: the least, 192 MiB, 0.03 bytes per parameter)
    # and 2 fp32 return buckets (384 MiB, 0.06), and a returned piece's bf16 cast (96 MiB, 0.015)
    assert 3.50 <= data["engines"]["zenflow"]["bytes_per_param"] <= 3.58
    # pinned: the fp32 master and the bf16 step store of the non-selected 0.9: 6 x 0.9
    assert 5.3 <= data["engines"]["zenflow"]["pinned_bytes"] / data["params"] <= 5.5


def test_flags_change_the_estimate(cli):
    base = estimate_json(cli, "gpt2", *BOX)
    fp32 = estimate_json(cli, "gpt2", *BOX, "--no-bf16")
    lower = estimate_json(cli, "gpt2", *BOX, "--topk-ratio", "0.01")
    overlap = estimate_json(cli, "gpt2", *BOX, "--overlap-step")
    host_gas = estimate_json(cli, "gpt2", *BOX, "--gradient-accumulation-steps", "2")
    device_gas = estimate_json(cli, "gpt2", *BOX, "--gradient-accumulation-steps", "2",
                               "--grad-accumulation", "device")  # fmt: skip
    p = base["params"]
    assert fp32["dtype"] == "fp32"
    assert fp32["engines"]["device"]["holders"]["device"]["weights"] == 4 * p
    assert base["engines"]["device"]["holders"]["device"]["weights"] == 2 * p
    z, zl = base["engines"]["zenflow"], lower["engines"]["zenflow"]
    assert zl["holders"]["device"]["optimizer"] < z["holders"]["device"]["optimizer"]
    acc = base["engines"]["zenflow"]["holders"]["host"]["accumulators"]
    # one window sum with or without overlap (the next window's first write waits)
    assert overlap["engines"]["zenflow"]["holders"]["host"]["accumulators"] == acc
    # micro-batches summed on the host: their fp32 sum in place of the bf16 step store; on
    # the device: a whole gradient
    n = base["zenflow_params"] - base["selected_elements"]
    assert host_gas["engines"]["zenflow"]["holders"]["host"]["accumulators"] == acc + 2 * n
    zg, zd = host_gas["engines"]["zenflow"], device_gas["engines"]["zenflow"]
    assert zd["holders"]["device"]["grads"] > zg["holders"]["device"]["grads"] + p


def test_host_state_and_the_step_time_flags(cli):
    """--host-state picks the configured row ("zenflow"), the other state sits beside it;
    --gpu, --mfu and --host-bw feed the predicted step, which says where each came from."""
    exact = estimate_json(cli, "gpt2", *BOX, "--micro-batch", "4", "--seq-len", "256")
    compact = estimate_json(cli, "gpt2", *BOX, "--micro-batch", "4", "--seq-len", "256",
                            "--host-state", "compact", "--gpu", "rtx4090", "--mfu", "0.3",
                            "--host-bw", "80")  # fmt: skip
    assert "zenflow (exact)" in compact["engines"]
    assert "zenflow (compact)" not in compact["engines"]
    assert compact["host_state"] == "compact" == compact["engines"]["zenflow"]["host_state"]
    assert (
        compact["engines"]["zenflow"]["host_peak_bytes"]
        == (exact["engines"]["zenflow (compact)"]["host_peak_bytes"])
    )
    st, st0 = compact["step_time"], exact["step_time"]
    assert (st["gpu"], st["mfu"], st["host_bw_gbs"], st["host_bw_source"]) == (
        "rtx4090", 0.3, 80, "--host-bw",
    )  # fmt: skip
    assert (st0["gpu"], st0["mfu"], st0["host_bw_gbs"], st0["host_bw_source"]) == (
        "h100-sxm", 0.45, 50, "default",
    )  # fmt: skip
    assert st["tokens_per_step"] == 4 * 256
    for eng in st["engines"].values():  # the step is at least its compute, at most the sum
        t = eng["terms_s"]
        assert t["compute"] <= eng["step_s"] <= sum(t.values()) * (1 + 1e-9)
        assert eng["bound"] in ("device compute", "link", "host")


def test_the_step_time_counts_the_step_store_the_memory_check_took(cli):
    """Issue 27's command on a 64 GB desktop's 60 GiB: the default step store ("auto")
    takes its 8-bit copies there, and the predicted step's host work counts them."""
    args = ["llama-7b", "--device-mem", "24GiB", "--gradient-checkpointing", "--micro-batch",
            "4", "--seq-len", "512", "--topk-ratio", "0.05"]  # fmt: skip
    tight = estimate_json(cli, *args, "--host-mem", "60GiB")
    room = estimate_json(cli, *args, "--host-mem", "1TiB")
    assert tight["engines"]["zenflow (compact)"]["step_store"] == "q8"
    assert room["engines"]["zenflow (compact)"]["step_store"] == "auto"
    hb, hb0 = (d["step_time"]["host_bytes_per_element"] for d in (tight, room))
    assert hb["compact"] > hb0["compact"] and hb0["exact"] == 19.0
    row, row0 = (d["step_time"]["engines"]["zenflow (compact)"] for d in (tight, room))
    assert row["terms_s"]["host"] > row0["terms_s"]["host"]


def test_config_supplies_the_settings(cli, tmp_path):
    cfg = tmp_path / "ds.json"
    r = cli("init", "--output", cfg, "--topk-ratio", "0.05")
    assert r.exit_code == 0, r.output
    data = estimate_json(cli, "gpt2", *BOX, "--config", cfg)
    written = json.loads(cfg.read_text())
    assert data["topk_ratio"] == 0.05
    assert data["dtype"] == ("bf16" if written["bf16"]["enabled"] else "fp32")
    assert data["micro_batch"] == written["train_micro_batch_size_per_gpu"]
    assert estimate_json(cli, "gpt2", *BOX, "--config", cfg, "--bf16")["dtype"] == "bf16"


def test_set_overrides_the_config_as_finetune_does(cli, tmp_path):
    """--set applies to --config (else the template) as zfctl finetune's does; the command's
    own flags win over it; the step store it names is the one checked."""
    cfg = tmp_path / "ds.json"
    assert cli("init", "--output", cfg, "--topk-ratio", "0.05").exit_code == 0
    topk = "zero_optimization.zenflow.topk_ratio"
    assert estimate_json(cli, "gpt2", *BOX, "--set", f"{topk}=0.2")["topk_ratio"] == 0.2
    assert estimate_json(cli, "gpt2", *BOX, "--config", cfg)["topk_ratio"] == 0.05
    assert estimate_json(cli, "gpt2", *BOX, "--config", cfg, "--set", f"{topk}=0.3",
                         "--set", "zfctl.host_state=compact")["topk_ratio"] == 0.3  # fmt: skip
    assert estimate_json(cli, "gpt2", *BOX, "--set", f"{topk}=0.2",
                         "--topk-ratio", "0.4")["topk_ratio"] == 0.4  # fmt: skip
    data = estimate_json(cli, "gpt2", *BOX, "--set", "zfctl.host_state=compact")
    assert data["engines"]["zenflow"]["host_state"] == "compact"
    # the 8-bit copies in place of the bf16 store: less host, in the row the run would take
    auto = estimate_json(cli, "llama-7b", *BOX)["engines"]["zenflow"]
    q8 = estimate_json(cli, "llama-7b", *BOX, "--set", "zfctl.step_store=q8")["engines"]["zenflow"]
    assert (auto["step_store"], q8["step_store"]) == ("auto", "q8")
    assert q8["host_bytes"] < auto["host_bytes"]


def test_table_shows_the_json_numbers(cli):
    data = estimate_json(cli, "llama-13b", "--device-mem", "80GiB", "--host-mem", "256GiB")
    r = cli("estimate", "llama-13b", "--device-mem", "80GiB", "--host-mem", "256GiB")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "Will it fit?" in out and "12,852,034,560" in out and "estimate" in out
    summary = out[out.index("Will it fit?") : out.index("Largest holders")]
    rows = {ln.split("│")[1].strip(): ln for ln in summary.splitlines() if ln.startswith("│ ")}
    for mode, eng in data["engines"].items():
        row = rows[mode]  # the summary table's row (the first cell is the engine's name)
        assert fmt_bytes(eng["device_bytes"]) in row and fmt_bytes(eng["host_peak_bytes"]) in row
        assert f"{eng['bytes_per_param']:.2f}" in row
        assert ("yes" if eng["fits"] else "NO") in row
        assert f"{mode}: {eng['title']}" in out  # its itemised table
        assert fmt_bytes(eng["host_bytes"]) in out  # its steady host total
    fits = {m: data["engines"][m]["fits"] for m in data["engines"]}
    assert [fits[m] for m in ("device", "offload", "zenflow", "zenflow (compact)")] == [
        False, True, True, True,
    ]  # fmt: skip
    # the predicted step: one row per engine, in the table after the summary
    timed = out[out.index("Predicted step") :]
    for row, pred in data["step_time"]["engines"].items():
        assert pred["bound"] in timed and row in timed
    summary = cli("estimate", "llama-13b", "--device-mem", "80GiB", "--summary")
    assert summary.exit_code == 0 and "Will it fit?" in summary.stdout
    assert "formula" not in summary.stdout  # no itemised tables


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only default")
def test_without_cuda_the_device_is_the_cpu(cli):
    data = estimate_json(cli, "gpt2", "--host-mem", "8GiB")
    assert data["device_is_host"] is True and data["device_mem"] == data["host_mem"] == 8 * 2**30
    for eng in data["engines"].values():
        assert eng["pinned_bytes"] == 0
        assert eng["fits"] is (eng["device_bytes"] + eng["host_bytes"] <= 8 * 2**30)
    r = cli("estimate", "gpt2", "--host-mem", "8GiB")
    assert "the device is the CPU" in r.stdout and "share this RAM" in r.stdout


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["no-such-arch-zfctl"], ["no-such-arch-zfctl", "llama-7b", "gpt2"]),
        (["gpt2", "--device-mem", "24 gigs"], ["--device-mem", "'24 gigs'", "24GiB"]),
        (["gpt2", "--host-mem", "0"], ["--host-mem", "more than 0"]),
        (["gpt2", "--topk-ratio", "0"], ["--topk-ratio", "(0, 1]"]),
        (["gpt2", "--head", "vision"], ["--head", "'vision'", "causal-lm"]),
        (["gpt2", "--config", "missing.json"], ["missing.json", "zfctl init"]),
        (["gpt2", "--gpu", "tpu-v5"], ["--gpu", "'tpu-v5'", "h100-sxm", "rtx4090"]),
        (["gpt2", "--mfu", "2"], ["--mfu", "(0, 1]"]),
        (["gpt2", "--host-bw", "0"], ["--host-bw", "GB/s", "tune-hw"]),
        (["gpt2", "--host-state", "tiny"], ["--host-state", "'tiny'", "exact or compact"]),
        (["gpt2", "--set", "zfctl.step_store=bogus"], ["zfctl.step_store", "bogus", "q8"]),
        (["gpt2", "--set", "topk"], ["--set", "KEY.PATH=VALUE"]),
    ],
)
def test_bad_input_exits_2(cli, args, fragments):
    assert_user_error(cli("estimate", *args), *fragments)


def test_estimate_help_imports_no_torch():
    code = (
        "import sys\nfrom zfctl.app import app\n"
        "try:\n    app(['estimate', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules, 'zenflow.hardware.estimate' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)  # fmt: skip
    assert "--device-mem" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "False False"


# --------------------------------------------------------------------------- preflight

SHORT = ["--max-steps", "2", "--micro-batch", "4", "--seq-len", "16", "--max-eval-samples", "8"]


def test_finetune_refuses_an_impossible_run(cli, tmp_path, tiny_gpt2_dir, glue_dir):
    root = tmp_path / "runs"
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", glue_dir,
            "--runs-root", root, "--device-mem", "1KiB", *SHORT)  # fmt: skip
    assert_user_error(r, "will not fit", "zenflow", "short by", "--force", "zfctl estimate")
    assert not root.exists()  # refused before anything was made


def test_finetune_device_mem_from_the_environment(cli, tmp_path, tiny_gpt2_dir, glue_dir,
                                                  monkeypatch):  # fmt: skip
    monkeypatch.setenv("ZFCTL_DEVICE_MEM", "1KiB")
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", glue_dir,
            "--runs-root", tmp_path, "--engine", "offload", *SHORT)  # fmt: skip
    assert_user_error(r, "will not fit with the offload engine", "(--device-mem)", "short by")


def test_finetune_force_skips_the_check(cli, tmp_path, tiny_gpt2_dir, glue_dir):
    root = tmp_path / "runs"
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", glue_dir,
            "--runs-root", root, "--device-mem", "1KiB", "--force", "--json", *SHORT)  # fmt: skip
    assert r.exit_code == 0, r.output
    run_dir = runs.latest_run(root)
    summary = json.loads((run_dir / runs.SUMMARY_FILE).read_text())
    assert summary["steps"] == 2 and summary["status"] == "finished"


def test_finetune_refuses_a_run_whose_whole_run_host_peak_does_not_fit(
    cli, tmp_path, tiny_gpt2_dir, glue_dir
):
    """Issue 27: the host is checked at the whole run's peak (here --host-mem, tiny), before
    the model loads (no run folder made), exit 2, and the message names the levers it tried:
    the compact host state, the offload engine, no step store. Just under the whole-run
    peak with the store set "on" the fixes that fit are named; with the template's "auto"
    the run takes the store's 8-bit copies and goes, as it does with the store off. (Which
    fix fits where, by hand: tests/hardware/test_estimate.py.)"""
    root = tmp_path / "runs"
    r = cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", glue_dir,
            "--runs-root", root, "--device", "sim", "--device-mem", "1GiB",
            "--host-mem", "1MiB", *SHORT)  # fmt: skip
    assert_user_error(r, "will not fit", "zfctl.host_state exact", "on the host over the whole",
                      "--host-mem)", "short by", 'zfctl.host_state "compact"',
                      "--engine offload", 'zfctl.step_store "off" (each window',
                      "--force")  # fmt: skip
    assert not root.exists()  # refused before anything was made
    # just under the whole-run peak (the steady state would fit): the fix that fits, named
    from zenflow.config import load_config
    from zenflow.hardware.preflight import preflight
    from zfctl.init_cmd import template_path

    cfg = load_config(template_path("zenflow"))  # what finetune runs without --config
    est = preflight(str(tiny_gpt2_dir), mode="zenflow", config=cfg, seq_len=16, micro_batch=4,
                    device_mem="1GiB", host_mem="1TiB", device_kind="sim")  # fmt: skip
    zf, off = est.engines["zenflow"], est.engines["offload"]
    host = zf.host_peak_bytes - 1
    assert zf.host_bytes + zf.runtime_bytes < host and off.host_peak_bytes <= host

    def run(*extra: str):
        return cli("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", glue_dir,
                   "--runs-root", root, "--device", "sim", "--device-mem", "1GiB",
                   "--host-mem", str(host), *SHORT, *extra)  # fmt: skip

    r = run("--set", "zfctl.step_store=on")
    store_off = "--set zfctl.step_store=off"
    assert_user_error(r, "will not fit", "short by 1 B", "Fix:", "--engine offload", store_off,
                      "--set zfctl.step_store=q8")  # fmt: skip
    assert not root.exists()
    # the template's "auto": the store's 8-bit copies, said; the advice taken: no store
    r = run()
    assert r.exit_code == 0 and 'zfctl.step_store runs as "q8"' in " ".join(r.output.split())
    r = run(*store_off.split())
    assert r.exit_code == 0, r.output


def assert_fitted(config: dict, key: str, value: str) -> None:
    """A run's config.json holds the zfctl setting ``key`` the preflight fitted it with: in
    the config it ran, in what the engine ran, in the run's spec, and not in your config."""
    assert config["zfctl"][key] == value
    assert config["engine_resolved"][key] == value  # what the engine ran
    assert config["run"][key] == value
    assert config["run"]["config_input"]["zfctl"].get(key) is None  # yours


def test_finetune_runs_without_the_early_images_where_they_do_not_fit(
    cli, tmp_path, wide_mlp_gpt2_dir, glue_dir
):
    """zfctl.early on, a bf16 model on sim: a host with room for the run but not for the
    early phase's return images is not refused. The run takes zfctl.return_image "never",
    says so, records it in its config and its resolved settings; with room it keeps them."""
    from zenflow.config import load_config
    from zenflow.hardware.preflight import preflight
    from zfctl.init_cmd import template_path

    early = ["--set", "zfctl.early.steps=4"]
    early_set = {"zfctl.early.steps": 4}
    cfg = load_config(template_path("zenflow"), overrides=early_set)
    off = load_config(
        template_path("zenflow"), overrides={**early_set, "zfctl.return_image": "never"}
    )

    def peak(c, host="1TiB"):
        est = preflight(str(wide_mlp_gpt2_dir), mode="zenflow", config=c, seq_len=16,
                        micro_batch=4, device_mem="1GiB", host_mem=host,
                        device_kind="sim")  # fmt: skip
        return est.engines["zenflow"]

    with_images, without = peak(cfg), peak(off)
    # the images' peak on sim: a re-selection inside the phase, its hand-over beside them
    assert with_images.host_peak_phase == "re-selection"
    assert with_images.host_peak_bytes > without.host_peak_bytes
    assert peak(cfg, str(without.host_peak_bytes)).return_image == "never"

    def run(host: int):
        root = tmp_path / f"runs-{host}"
        r = cli("finetune", wide_mlp_gpt2_dir, "--task", "sst2", "--data-dir", glue_dir,
                "--runs-root", root, "--device", "sim", "--device-mem", "1GiB",
                "--host-mem", str(host), "--no-dashboard", *early, *SHORT)  # fmt: skip
        assert r.exit_code == 0, r.output
        run_dir = runs.latest_run(root)
        return " ".join(r.output.split()), json.loads((run_dir / "config.json").read_text()), \
            run_dir  # fmt: skip

    out, config, run_dir = run(without.host_peak_bytes)
    assert 'zfctl.return_image runs as "never"' in out
    assert_fitted(config, "return_image", "never")
    # a resume (no preflight: it keeps what the run was checked with) keeps it, given the
    # same --set as the run (your config, unchanged)
    r = cli("finetune", wide_mlp_gpt2_dir, "--resume", run_dir, "--max-steps", "3",
            "--device", "sim", "--no-dashboard", *early)  # fmt: skip
    assert r.exit_code == 0, r.output
    config = json.loads((run_dir / "config.json").read_text())
    assert config["engine_resolved"]["return_image"] == "never" and "runs as" not in r.output
    out, config, _ = run(with_images.host_peak_bytes)
    assert "runs as" not in out and config["engine_resolved"]["return_image"] == "early"


def _template_peak(model_dir, **overrides) -> int:
    """The template's whole-run host peak on sim for ``model_dir`` with ``overrides``
    (micro-batch 4 x 16 tokens, a 1 GiB device, host room to spare)."""
    from zenflow.config import load_config
    from zenflow.hardware.preflight import preflight
    from zfctl.init_cmd import template_path

    c = load_config(template_path("zenflow"), overrides=overrides)
    est = preflight(str(model_dir), mode="zenflow", config=c, seq_len=16, micro_batch=4,
                    device_mem="1GiB", host_mem="1TiB", device_kind="sim")  # fmt: skip
    return est.engines["zenflow"].host_peak_bytes


def _finetune_on_host(cli, tmp_path, model_dir, glue_dir, host: int, *extra: str):
    """A short run on sim with ``--host-mem host`` in a runs root of its own."""
    root = tmp_path / f"runs-{host}-{'_'.join(extra)}"
    r = cli("finetune", model_dir, "--task", "sst2", "--data-dir", glue_dir,
            "--runs-root", root, "--device", "sim", "--device-mem", "1GiB",
            "--host-mem", str(host), "--no-dashboard", *extra, *SHORT)  # fmt: skip
    return r, root


def test_finetune_without_clipping_runs_without_the_step_store_where_it_does_not_fit(
    cli, tmp_path, tiny_gpt2_dir, glue_dir
):
    """gradient_clipping 0 on sim: a host with room for the run but not for the step store
    is not refused. The run takes zfctl.step_store "off", says so, records it in its
    config and in what the engine ran, and a resume keeps it; with room it keeps the store;
    with clipping and the store set "on" the same host refuses, naming its 8-bit copies and
    the store off."""
    no_clip = ["--set", "gradient_clipping=0"]
    with_store, without = (
        _template_peak(tiny_gpt2_dir, gradient_clipping=0, **{"zfctl.step_store": v})
        for v in ("on", "off")
    )
    assert with_store > without

    def run(host: int, *extra: str):
        return _finetune_on_host(cli, tmp_path, tiny_gpt2_dir, glue_dir, host, *extra)

    r, root = run(without, *no_clip)
    assert r.exit_code == 0, r.output
    out, run_dir = " ".join(r.output.split()), runs.latest_run(root)
    assert 'zfctl.step_store runs as "off"' in out
    assert_fitted(json.loads((run_dir / "config.json").read_text()), "step_store", "off")
    r = cli("finetune", tiny_gpt2_dir, "--resume", run_dir, "--max-steps", "3",
            "--device", "sim", "--no-dashboard", *no_clip)  # fmt: skip
    assert r.exit_code == 0, r.output
    config = json.loads((run_dir / "config.json").read_text())
    assert config["engine_resolved"]["step_store"] == "off" and "runs as" not in r.output
    r, root = run(with_store, *no_clip)
    assert r.exit_code == 0 and "runs as" not in r.output, r.output
    resolved = json.loads((runs.latest_run(root) / "config.json").read_text())["engine_resolved"]
    assert resolved["step_store"] == "on"
    # the template's clipping with the store set "on" by hand: refused, the fixes named
    # (with "auto" the run takes the store's 8-bit copies: the next test)
    r, root = run(without, "--set", "zfctl.step_store=on")
    assert_user_error(r, "will not fit", "--set zfctl.step_store=q8", "--set zfctl.step_store=off")
    assert not root.exists()


def test_finetune_takes_the_step_stores_8_bit_copies_where_the_store_does_not_fit(
    cli, tmp_path, tiny_gpt2_dir, glue_dir
):
    """The template's clipping and its zfctl.step_store "auto" on sim: a host with room for
    the run with the store's 8-bit copies but not with the store is not refused. The run
    takes "q8", says so, records it in its config and in what the engine ran (per-step
    clipping from the copies: host_clipping "step-q8"), and a resume keeps it. The same
    host with the store set "on" by hand refuses, naming q8; with room "auto" is the
    store."""
    with_store, copies = (_template_peak(tiny_gpt2_dir, **{"zfctl.step_store": v})
                          for v in ("on", "q8"))  # fmt: skip
    assert with_store > copies

    def run(host: int, *extra: str):
        return _finetune_on_host(cli, tmp_path, tiny_gpt2_dir, glue_dir, host, *extra)

    r, root = run(copies)
    assert r.exit_code == 0, r.output
    out, run_dir = " ".join(r.output.split()), runs.latest_run(root)
    assert 'zfctl.step_store runs as "q8"' in out
    config = json.loads((run_dir / "config.json").read_text())
    assert_fitted(config, "step_store", "q8")
    assert config["engine_resolved"]["host_clipping"] == "step-q8"
    r = cli("finetune", tiny_gpt2_dir, "--resume", run_dir, "--max-steps", "3",
            "--device", "sim", "--no-dashboard")  # fmt: skip
    assert r.exit_code == 0, r.output
    config = json.loads((run_dir / "config.json").read_text())
    assert config["engine_resolved"]["step_store"] == "q8" and "runs as" not in r.output
    r, root = run(copies, "--set", "zfctl.step_store=on")  # yours: refused, q8 named
    assert_user_error(r, "will not fit", "--set zfctl.step_store=q8")
    assert not root.exists()
    r, root = run(with_store)
    assert r.exit_code == 0 and "runs as" not in r.output, r.output
    resolved = json.loads((runs.latest_run(root) / "config.json").read_text())["engine_resolved"]
    assert resolved["step_store"] == "on" and resolved["host_clipping"] == "step"


def test_a_causal_lm_preflight_counts_the_lm_heads_logits(cli, tmp_path, tiny_gpt2_dir):
    """--objective causal-lm checks the fit with the LM head's fp32 logits and their
    gradient (b*s*vocab*8 bytes): a device that holds the classifier run refuses the LM."""
    from zenflow.hardware.preflight import preflight

    def need(head: str) -> int:
        est = preflight(str(tiny_gpt2_dir), mode="zenflow", micro_batch=4, seq_len=16,
                        head=head, device_mem="1TiB", separate_device=True)  # fmt: skip
        return est.engines["zenflow"].device_bytes

    classifier, lm = need("classification"), need("causal-lm")
    assert lm - classifier >= 4 * 16 * 50257 * 8 - 4 * 2 * 8
    between = (classifier + lm) // 2
    preflight(
        str(tiny_gpt2_dir),
        mode="zenflow",
        micro_batch=4,
        seq_len=16,
        device_mem=between,
        separate_device=True,
    )  # fmt: skip  (fits: no error)
    data = tmp_path / "t.jsonl"
    data.write_text("".join(f'{{"text": "line {i}"}}\n' for i in range(20)))
    r = cli("finetune", tiny_gpt2_dir, "--objective", "causal-lm", "--data", data,
            "--device", "sim", "--device-mem", between, "--runs-root", tmp_path / "runs",
            *SHORT)  # fmt: skip
    assert_user_error(r, "will not fit", "zenflow", "short by")
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- README


def readme_section() -> str:
    start = README.index("## Will it fit? `zfctl estimate`")
    return README[start : README.index("\n## ", start + 1)]


def test_readme_commands_print_what_the_readme_shows(cli, monkeypatch):
    """Every `zfctl estimate` line of the README section runs; the two examples print exactly
    the output shown under them (computed numbers, given memory sizes: deterministic)."""
    section = readme_section()
    (commands,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    outputs = re.findall(r"```text\n(.*?)```", section, flags=re.S)
    assert len(outputs) == 2
    monkeypatch.setenv("COLUMNS", "100")  # the width the README's output was printed at
    shown = []
    for line in commands.splitlines():
        argv = shlex.split(line.split("#")[0])
        assert argv[:2] == ["zfctl", "estimate"], line
        r = cli(*argv[1:])
        assert r.exit_code == 0, (line, r.output)
        if "--json" in argv:
            assert json.loads(r.stdout)["params"] > 0
        else:
            shown.append("\n".join(ln.rstrip() for ln in r.stdout.splitlines()))
    assert [o.rstrip("\n") for o in outputs] == shown
