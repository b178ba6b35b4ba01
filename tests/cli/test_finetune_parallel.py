"""`zfctl finetune --nproc 2` (ranks started by zfctl.launch on this machine) and `--device sim`.

Two ranks over a global micro-batch of 2 x 4 train what one process with micro-batch 8
trains, within fp32 tolerance; a two-rank run stopped at step 3 and resumed equals the
straight run; a simulated device is named in the header and reports device bytes.

Stops and crashes (issue 31): a SIGTERM to the launcher's PID alone, or a terminal's Ctrl-C
to its process group, stops every rank at a checkpoint, the ranks' lines reach stderr and
the exit status is 143 / 130, with no rank left behind; a SIGTERM to one rank is every
rank's 143; a rank killed by SIGKILL (mid-run, or before the group is formed) is named
with its signal, exit 137, never "internal error". Each waits on the JSON stream (a step
reported), never on a sleep; the subprocess timeouts only turn a hang into a failure.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zenflow.train import runs
from zenflow.train.data import write_sst2_sample
from zfctl.launch import Ending, Job

ENV = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", COLUMNS="200")
ENV.pop("WORLD_SIZE", None)
ZF = ["--set", "zero_optimization.zenflow.update_interval=2",
      "--set", "zero_optimization.zenflow.select_strategy=step",
      "--set", "zero_optimization.zenflow.select_interval=3"]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_sst2_sample(tmp_path_factory.mktemp("data"), n=48, n_dev=8)


@pytest.fixture(scope="module")
def tiny_gpt2_dir(tmp_path_factory) -> Path:
    """The tiny GPT-2 of tests/conftest.py without dropout: two ranks draw dropout masks
    for half a batch each and one process for all of it, so with dropout they would differ
    by design."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from zenflow.train.models import packaged_gpt2_tokenizer

    d = tmp_path_factory.mktemp("tiny-gpt2-nodrop")
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=50257, num_labels=2,
        pad_token_id=50256, bos_token_id=50256, eos_token_id=50256, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
    )  # fmt: skip
    GPT2ForSequenceClassification(cfg).save_pretrained(d)
    tok = packaged_gpt2_tokenizer()
    tok.pad_token = tok.eos_token
    tok.save_pretrained(d)
    return d


def _zfctl(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zfctl", *map(str, args)], env=ENV, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


def _finetune(model, data, run_dir, *extra):
    return _zfctl(
        "finetune", model, "--task", "sst2", "--data-dir", data, "--seq-len", 16,
        "--max-eval-samples", 8, "--run-dir", run_dir, "--no-dashboard", "--lr", "1e-3",
        *ZF, *extra,
    )  # fmt: skip


def _weights(run_dir: Path) -> dict:
    return load_file(run_dir / "model" / "model.safetensors")


def test_two_ranks_train_what_one_process_trains(tiny_gpt2_dir, data, tmp_path):
    one = _finetune(tiny_gpt2_dir, data, tmp_path / "one", "--max-steps", 4, "--micro-batch", 8)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _finetune(tiny_gpt2_dir, data, tmp_path / "two", "--max-steps", 4, "--micro-batch", 4,
                    "--nproc", 2)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 data-parallel ranks" in two.stdout  # rank 0 reports, once
    assert two.stdout.count("eval at step 4") == 1
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    s1 = json.loads((tmp_path / "one" / "summary.json").read_text())
    s2 = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert s2["world_size"] == 2 and s2["samples"] == s1["samples"] == 4 * 8
    dp = s2["data_parallel"]  # re-selection's score all-reduce, next to the gradients
    assert 0 < 10 * dp["selection_score_floats"] < dp["selection_gradient_floats_instead"]
    assert abs(s2["final_loss"] - s1["final_loss"]) < 1e-4
    shards = sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir())
    assert "step-0000004.pt" in shards and "step-0000004.rank-1.pt" in shards


def test_two_rank_run_resumes_exactly(tiny_gpt2_dir, data, tmp_path):
    common = ("--micro-batch", 4, "--nproc", 2)
    straight = _finetune(tiny_gpt2_dir, data, tmp_path / "straight", "--max-steps", 6, *common)
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = _finetune(tiny_gpt2_dir, data, tmp_path / "r", "--max-steps", 3, *common)
    assert first.returncode == 0, first.stderr[-3000:]
    again = _zfctl(
        "finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", data, "--resume",
        tmp_path / "r", "--max-steps", 6, "--no-dashboard", "--nproc", 2,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "r")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    wrong = _zfctl("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", data,
                   "--resume", tmp_path / "r", "--max-steps", 8, "--no-dashboard")  # fmt: skip
    assert wrong.returncode == 2 and "--nproc 2" in wrong.stderr, wrong.stderr[-2000:]
    assert "Traceback" not in wrong.stderr


def test_a_bad_input_under_nproc_exits_2_without_a_launcher_traceback(tiny_gpt2_dir, tmp_path):
    r = _zfctl("finetune", tiny_gpt2_dir, "--task", "sst2", "--data-dir", tmp_path / "none",
               "--max-steps", 2, "--nproc", 2, "--runs-root", tmp_path)  # fmt: skip
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr
    assert "data-parallel run failed: rank" in r.stderr


def test_sim_device_is_named_and_reports_device_bytes(tiny_gpt2_dir, data, tmp_path):
    r = _finetune(tiny_gpt2_dir, data, tmp_path / "sim", "--max-steps", 4, "--device", "sim")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "simulated accelerator" in r.stdout
    s = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert s["device"].startswith("sim (simulated")
    assert 4.0 < s["device_bytes_per_param"] < 10.0  # fp32: 4 + 4 + the selected state
    assert s["bytes_per_step_x_model"] > 0.5  # a separate device: the gradient really moves
    # the device pool's peak: what the accounting counts, and activations and its cache
    # beside; the weights (made before the device) count outside the pool
    assert s["device_memory_peak_bytes"] >= s["device_peak_bytes"] > 0
    assert s["device_memory_peak_bytes"] < 4 * s["device_peak_bytes"]
    # what its live tensors held at most (activations included, the cache not)
    assert s["device_memory_peak_bytes"] >= s["device_allocated_peak_bytes"]
    assert s["device_allocated_peak_bytes"] > s["device_peak_bytes"]
    # the host memory the process held, measured (the kernel's VmHWM): its peak RSS less
    # the device pool's, beside the preflight's whole-run host peak of this run, which the
    # estimate gives for the same settings and the run keeps in its config
    assert s["process_rss_peak_bytes"] > s["device_memory_peak_bytes"]
    assert s["host_rss_peak_bytes"] == s["process_rss_peak_bytes"] - s["device_memory_peak_bytes"]
    from zenflow.config import load_config, parse_set_args
    from zenflow.hardware.preflight import preflight
    from zfctl.init_cmd import template_path

    cfg = load_config(template_path("zenflow"), overrides=parse_set_args(ZF[1::2]))
    est = preflight(str(tiny_gpt2_dir), mode="zenflow", config=cfg, seq_len=16,
                    device_kind="sim")  # fmt: skip
    run = json.loads((tmp_path / "sim" / "config.json").read_text())["run"]
    assert s["host_peak_estimate_bytes"] == run["host_peak_estimate"]
    assert s["host_peak_estimate_bytes"] == est.engines["zenflow"].host_peak_bytes
    # a tiny model: the process's runtime is most of both
    assert 0.6 < s["host_rss_peak_bytes"] / s["host_peak_estimate_bytes"] < 1.4
    r = _zfctl("report", tmp_path / "sim")
    assert r.returncode == 0 and "host peak" in r.stdout and "measured / estimate" in r.stdout
    # each step line: the process's resident set after it, never above the run's peak
    lines = [json.loads(x) for x in (tmp_path / "sim" / "metrics.jsonl").read_text().splitlines()]
    rss = [x["process_rss_bytes"] for x in lines if x.get("type") == "step"]
    assert len(rss) == 4 and all(0 < b <= s["process_rss_peak_bytes"] for b in rss)
    assert all(x["host_available_bytes"] > 0 for x in lines if x.get("type") == "step")


# ---- stops and crashes (issue 31)
HANG_S = 600  # a guard only: a job still running this long is hung, and the test says so


def _communicate(p: subprocess.Popen) -> tuple[str, str]:
    try:
        return p.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"the job hung: still running after {HANG_S} s; stderr:\n{err[-3000:]}")


def _launch(model, data, run_dir, *extra) -> subprocess.Popen:
    """`zfctl finetune --nproc 2 --json` in a session of its own: a signal the test sends
    to its process group reaches what a terminal's Ctrl-C would reach."""
    argv = [sys.executable, "-m", "zfctl", "finetune", str(model), "--task", "sst2",
            "--data-dir", str(data), "--seq-len", "16", "--max-eval-samples", "8",
            "--micro-batch", "2", "--run-dir", str(run_dir), "--nproc", "2", "--json",
            *map(str, extra)]  # fmt: skip
    return subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip


def _ranks(launcher: int) -> dict[int, int]:
    """{RANK: pid} of the launcher's rank processes (Linux /proc)."""
    kids = []
    for task in Path(f"/proc/{launcher}/task").iterdir():
        kids += (task / "children").read_text().split()
    out = {}
    for pid in map(int, kids):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # it ended meanwhile
            continue
        rank = [e for e in env if e.startswith(b"RANK=")]
        if rank:
            out[int(rank[0][5:])] = pid
    return out


def _wait_for_step(p: subprocess.Popen, step: int) -> list[str]:
    """Read the JSON stream until rank 0 reports ``step`` (every line must be JSON)."""
    lines = []
    for line in p.stdout:
        lines.append(line)
        event = json.loads(line)
        if event.get("event") == "StepEvent" and event["step"] >= step:
            return lines
    pytest.fail(f"the job ended before step {step}: {p.stderr.read()[-3000:]}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _reap_leftovers(pids) -> None:
    for pid in pids:  # hygiene only: a failed test must not leave ranks training
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _zfctl_lines_only(err: str, *prefixes: str) -> None:
    """stderr holds zfctl's own lines alone: no warning of torch, transformers, DeepSpeed."""
    for line in err.splitlines():
        assert line.startswith(prefixes), f"not zfctl's: {line!r}\n{err[-3000:]}"


@pytest.mark.usefixtures("terminal_sigint")  # the test's Ctrl-C reaches the job
@pytest.mark.parametrize("how", ["sigterm-to-the-launcher", "ctrl-c-to-the-group"], ids=lambda h: h)
def test_a_stop_reaches_every_rank_and_their_lines_reach_the_user(
    tiny_gpt2_dir, data, tmp_path, how
):
    """SIGTERM to the launcher's PID alone (a supervisor, Kubernetes), or SIGINT to its whole
    process group (a terminal's Ctrl-C): every rank stops at one step boundary with a
    checkpoint, rank 0's "checkpoint:" and "resume with:" lines reach stderr, the launcher
    waits for the ranks (none is left, the run's lock is free) and exits 143 / 130; the
    printed command finishes the run. stdout is JSON alone and stderr zfctl's lines alone.
    Before, the launcher exited within a second: the ranks went on training as orphans
    holding the lock (SIGTERM), or their lines were lost with its pipe (Ctrl-C)."""
    run_dir = tmp_path / "r"
    p = _launch(tiny_gpt2_dir, data, run_dir, "--max-steps", 400)
    ranks = {}
    try:
        _wait_for_step(p, 2)
        ranks = _ranks(p.pid)
        assert sorted(ranks) == [0, 1]
        if how == "sigterm-to-the-launcher":
            p.send_signal(signal.SIGTERM)
        else:
            os.killpg(p.pid, signal.SIGINT)
        out, err = _communicate(p)
    finally:
        _reap_leftovers(ranks.values())
    code, said = (143, "stopped by SIGTERM") if how.startswith("sigterm") else (130, "interrupted")
    assert p.returncode == code, err[-3000:]
    assert not [pid for pid in ranks.values() if _alive(pid)], "ranks left running"
    for line in out.splitlines():
        json.loads(line)
    _zfctl_lines_only(err, said, "checkpoint: ", "resume with: ")
    ckpt = runs.latest_checkpoint(run_dir)
    assert f"{said} after step {runs.checkpoint_step(ckpt)}" in err
    assert f"checkpoint: {ckpt}" in err and ckpt.with_name(ckpt.stem + ".rank-1.pt").is_file()
    with open(run_dir / runs.LOCK_FILE) as lock:  # released: rank 0 ended
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    if how == "sigterm-to-the-launcher":  # the printed command continues the run
        (resume,) = [ln for ln in err.splitlines() if ln.startswith("resume with: ")]
        cmd = shlex.split(resume[len("resume with: ") :])
        assert cmd[cmd.index("--nproc") + 1] == "2"
        steps = runs.checkpoint_step(ckpt) + 2
        r = _zfctl(*cmd[1:], "--max-steps", steps, "--json", timeout=HANG_S)
        assert r.returncode == 0, r.stderr[-3000:]
        assert runs.read_run(run_dir)["summary"]["steps"] == steps


def test_sigterm_to_one_rank_stops_every_rank_with_143(tiny_gpt2_dir, data, tmp_path):
    """SIGTERM to rank 1 alone: the ranks agree on the stop and on its signal, so rank 0
    too says "stopped by SIGTERM" and the job exits 143 (it was 130: rank 0 had no signal)."""
    run_dir = tmp_path / "r"
    p = _launch(tiny_gpt2_dir, data, run_dir, "--max-steps", 400)
    ranks = {}
    try:
        _wait_for_step(p, 2)
        ranks = _ranks(p.pid)
        os.kill(ranks[1], signal.SIGTERM)
        out, err = _communicate(p)
    finally:
        _reap_leftovers(ranks.values())
    assert p.returncode == 143, err[-3000:]
    _zfctl_lines_only(err, "stopped by SIGTERM after step", "checkpoint: ", "resume with: ")
    assert runs.latest_checkpoint(run_dir) is not None


@pytest.mark.parametrize("when", ["mid-run", "before-the-group"])
def test_a_rank_killed_by_sigkill_is_named_with_its_signal(tiny_gpt2_dir, data, tmp_path, when):
    """Rank 1 killed by SIGKILL (what the out-of-memory killer sends) after step 3, or as soon
    as it started (before the group is formed, as a rank killed during the native op's first
    build): the job ends (rank 0 does not wait for a collective's timeout), the last line
    names rank 1 and SIGKILL, the exit status is 137, and rank 0 says which checkpoint is
    kept. Never "internal error (a bug in zfctl)" with gloo's "Connection closed by peer"."""
    run_dir = tmp_path / "r"
    p = _launch(tiny_gpt2_dir, data, run_dir, "--max-steps", 400, "--checkpoint-every", 2)
    ranks = {}
    try:
        if when == "mid-run":
            _wait_for_step(p, 3)  # checkpoint 2 is written before step 3 is reported
        while 1 not in ranks:  # the launcher starts the ranks right away
            assert p.poll() is None, p.stderr.read()[-3000:]
            ranks = _ranks(p.pid)
            time.sleep(0.01)  # polling /proc, not a timed assertion
        os.kill(ranks[1], signal.SIGKILL)
        out, err = _communicate(p)
    finally:
        _reap_leftovers(ranks.values())
    assert p.returncode == 137, err[-3000:]
    assert "rank 1 was killed by SIGKILL (often the kernel's out-of-memory killer" in err
    for bad in ("internal error", "Traceback", "Connection closed by peer", "reset by peer"):
        assert bad not in err, err[-3000:]
    if when == "mid-run":
        ckpt = runs.latest_checkpoint(run_dir)
        assert runs.checkpoint_step(ckpt) >= 2
        assert "another rank of this data-parallel job ended" in err
        assert f"The last good checkpoint, {ckpt}, is kept" in err


@pytest.mark.usefixtures("terminal_sigint")  # the test's Ctrl-C reaches the job
def test_ctrl_c_while_a_rank_waits_for_the_others_ends_the_job(tiny_gpt2_dir, data, tmp_path):
    """Ctrl-C while rank 0 waits in the rendezvous for rank 1 (frozen before it joins): the
    job ends at once with 130. That wait is in C++, where no KeyboardInterrupt is raised:
    before, rank 0 went on waiting for the rendezvous timeout (10 min) after rank 1 ended."""
    p = _launch(tiny_gpt2_dir, data, tmp_path / "r", "--max-steps", 400)
    ranks = {}
    try:
        while len(ranks) < 2:
            assert p.poll() is None, p.stderr.read()[-3000:]
            ranks = _ranks(p.pid)
            time.sleep(0.01)  # polling /proc, not a timed assertion
        # past Python's start-up (a Ctrl-C inside `site` is a fatal error Python prints
        # with a traceback, whatever zfctl does): torch is loaded, the rendezvous is ahead
        while b"libtorch" not in Path(f"/proc/{ranks[1]}/maps").read_bytes():
            assert p.poll() is None, p.stderr.read()[-3000:]
            time.sleep(0.01)  # polling /proc, not a timed assertion
        os.kill(ranks[1], signal.SIGSTOP)  # rank 1 cannot join
        env = Path(f"/proc/{ranks[0]}/environ").read_bytes().split(b"\0")
        port = int(next(e for e in env if e.startswith(b"MASTER_PORT="))[12:])
        while True:  # rank 0 hosts the rendezvous: listening = waiting for rank 1
            assert p.poll() is None, p.stderr.read()[-3000:]
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)  # polling, not a timed assertion
        os.killpg(p.pid, signal.SIGINT)  # the terminal's Ctrl-C
        os.kill(ranks[1], signal.SIGCONT)
        out, err = _communicate(p)
    finally:
        _reap_leftovers(ranks.values())
    assert p.returncode == 130, err[-3000:]
    assert "internal error" not in err and "Traceback" not in err, err[-3000:]


def _ending(rank, status, *sent):
    return Ending(rank, status, set(sent))


@pytest.mark.parametrize(
    "endings,received,code,line",
    [
        ([(0, 0), (1, 0)], [], 0, None),
        ([(1, 0), (0, 0)], [signal.SIGINT], 0, None),  # asked after the last step: finished
        ([(0, 130, signal.SIGINT), (1, 130, signal.SIGINT)], [signal.SIGINT], 130, None),
        ([(1, 143), (0, 143)], [], 143, None),  # SIGTERM to one rank, agreed
        ([(0, -15, signal.SIGTERM), (1, 143, signal.SIGTERM)], [signal.SIGTERM], 143, None),
        # a Ctrl-C before the loop: rank 0 then finds its peer gone (exit 2): a consequence
        ([(1, 130, signal.SIGINT), (0, 2, signal.SIGINT)], [signal.SIGINT], 130, None),
        ([(1, -9), (0, 2)], [], 137, "rank 1 was killed by SIGKILL (often the kernel's"),
        # killed during a stop: not a consequence of it
        ([(1, 130, signal.SIGINT), (0, -9, signal.SIGINT)], [signal.SIGINT], 137,
         "rank 0 was killed by SIGKILL"),
        # Ctrl-C while rank 1's Python started up: its exit 1 is the stop, not a failure
        ([(1, 1, signal.SIGINT), (0, 130, signal.SIGINT)], [signal.SIGINT], 130, None),
        ([(1, 1, signal.SIGINT), (0, 1, signal.SIGINT)], [signal.SIGINT], 130, None),
        # rank 1's own error first; rank 0 aborted at exit after losing it
        ([(1, 2), (0, -6)], [], 2, "rank 1 exited with code 2"),
        # the launcher's own SIGKILL to a blocked survivor is no cause
        ([(1, -11), (0, -9, signal.SIGTERM, signal.SIGKILL)], [], 139,
         "rank 1 was killed by SIGSEGV"),
    ],
)  # fmt: skip
def test_the_job_outcome_names_the_rank_that_ended_it(endings, received, code, line, capsys):
    """The launcher's verdict from the ranks' statuses in the order they ended: the first
    failure decides (an error exit, or a signal it did not send: 128 + the signal), what
    follows it is its consequence; a stop every rank took gives 130 / 143."""
    job = Job(2, ["finetune"])
    job.procs = [None, None]  # both started (only counted here)
    job.endings = [_ending(*e) for e in endings]
    job.received = received
    assert job.outcome() == code
    err = capsys.readouterr().err
    assert (line in " ".join(err.split())) if line else err == ""


def test_a_stop_before_the_ranks_started_is_the_stop():
    """A SIGTERM that came before the second rank was started: the first got it, and it is
    the job's status (not 0 for "every started rank finished")."""
    job = Job(2, ["finetune"])
    job.procs, job.received = [None], [signal.SIGTERM]
    job.endings = [_ending(0, -15, signal.SIGTERM)]
    assert job.outcome() == 143
    job.procs, job.endings = [], []  # before the first
    assert job.outcome() == 143
