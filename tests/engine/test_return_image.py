"""zfctl.return_image: a bf16 model's host results go back to the device as a bf16 image the
host step writes in the same pass, instead of the fp32 master columns cast on the device.

The plain path (the master, "never") is the reference: the image path must give the same
weights bit for bit (both round to nearest even), move 2 bytes less per non-selected
element per returned result, and hold its images only while windows use them."""

from __future__ import annotations

import pytest
import torch
from conftest import MLP, make_config, mlp_batches, train_engine

from zenflow import ZenFlowEngine
from zenflow.config import ConfigError, load_config
from zenflow.engine.accelerator import SimAccelerator

STEPS = 20
ZF = {"topk_ratio": 0.25, "update_interval": 4, "select_interval": 5}
EARLY = {"steps": 8}  # windows 1 (steps 1-3), 2 (4-7), then 4 from step 8


def _train(setting: str, *, overlap=True, early=EARLY, state="exact", bf16=True,
           accelerator="sim", steps=STEPS):  # fmt: skip
    """The MLP trained ``steps`` steps; (weights, engine, the step stats) after close."""
    torch.manual_seed(0)
    model = MLP()
    zfctl = {"return_image": setting, "host_state": state}
    if early is not None:
        zfctl["early"] = early
    cfg = make_config(dict(ZF, overlap_step=overlap), bf16={"enabled": bf16}, zfctl=zfctl)
    if accelerator == "sim":
        accelerator = SimAccelerator(strict=True)
    engine = ZenFlowEngine(model, cfg, accelerator=accelerator, device_adam="reference",
                           host_kernel="reference")  # fmt: skip
    stats = train_engine(engine, model, mlp_batches(steps))
    engine.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, engine, stats


def _image_results(engine) -> int:
    """Host results that reached the device as an image."""
    return sum(1 for job in engine.impl.window.host_log
               if job.meta.get("images") is not None and job.applied_step is not None)  # fmt: skip


@pytest.mark.parametrize("state", ["exact", "compact"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("setting", ["early", "always"])
def test_the_image_returns_the_same_weights_in_half_the_bytes(setting, overlap, state):
    ref, ref_engine, ref_stats = _train("never", overlap=overlap, state=state)
    got, engine, stats = _train(setting, overlap=overlap, state=state)
    for name, p in ref.items():
        assert p.dtype == torch.bfloat16
        assert torch.equal(got[name], p), name
    assert _image_results(ref_engine) == 0
    n_images = _image_results(engine)
    applied = sum(1 for job in engine.impl.window.host_log if job.applied_step is not None)
    if setting == "always":
        assert n_images == applied
    else:  # the windows that ended in the early phase, at steps 1, 2, 3, 5 and 7 (the
        # next one ends at step 11, after it)
        assert n_images == 5 < applied
    # each image result moved 2 bytes less per non-selected element; nothing else changed
    nonsel = sum(w.compact_numel for w in engine.zweights)
    saved = sum(s.h2d_bytes for s in ref_stats) - sum(s.h2d_bytes for s in stats)
    assert saved == 2 * nonsel * n_images
    assert [s.d2h_bytes for s in stats] == [s.d2h_bytes for s in ref_stats]


def test_early_images_are_freed_after_the_phase_and_always_kept():
    _, early, _ = _train("early")
    assert early.impl.image_return.images == {}  # the phase ended at step 8
    assert not early.accel.host_held().get("images")  # their memory is back too
    _, always, _ = _train("always")
    held = always.impl.image_return.images
    assert sorted(held) == [w.position for w in always.zweights]
    nonsel = sum(w.compact_numel for w in always.zweights)
    assert always.accel.host_held()["images"] == 2 * nonsel  # bf16, accounted
    for w in always.zweights:
        assert held[w.position].dtype == torch.bfloat16
        assert held[w.position].numel() == w.compact_numel
    # mid-phase (step 6), the early images are held, pinned where the link pins
    _, mid, _ = _train("early", steps=6)
    assert len(mid.impl.image_return.images) == len(mid.zweights)
    assert mid.accel.host_held()["images"] == 2 * sum(w.compact_numel for w in mid.zweights)
    assert mid.resolved["return_image"] == "early"


@pytest.mark.parametrize(
    "kw",
    [
        dict(setting="early", early=None),  # no early phase: nothing to image
        dict(setting="never"),
        dict(setting="always", bf16=False),  # an fp32 master is its own image
        dict(setting="always", accelerator="cpu"),  # the CPU device shares the master
    ],
    ids=["early-without-phase", "never", "fp32", "cpu"],
)
def test_no_image_where_it_saves_nothing(kw):
    _, engine, _ = _train(kw.pop("setting"), **kw)
    assert _image_results(engine) == 0
    assert engine.impl.image_return.images == {}
    assert not engine.accel.host_held().get("images")


@pytest.mark.parametrize("seed", [0, 1])
def test_the_image_is_stable_while_lagging_copies_read_it(seed):
    """Copies that lag (the sim's strict mode, delayed at random) still read each image
    before the next host step writes it: the same weights as the master's return."""
    ref, _, _ = _train("never")
    torch.manual_seed(0)
    model = MLP()
    cfg = make_config(dict(ZF, overlap_step=True), bf16={"enabled": True},
                      zfctl={"return_image": "always", "early": EARLY})  # fmt: skip
    engine = ZenFlowEngine(
        model,
        cfg,
        device_adam="reference",
        host_kernel="reference",
        accelerator=SimAccelerator(strict=True, lag_s=0.002, lag_seed=seed),
    )
    train_engine(engine, model, mlp_batches(STEPS))
    engine.close()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), ref[name]), name


def test_return_image_config():
    raw = {"zfctl": {"return_image": "always"}}
    assert load_config(raw).engine.return_image == "always"
    assert load_config({}).engine.return_image == "early"
    with pytest.raises(ConfigError) as err:
        load_config({"zfctl": {"return_image": "bf16"}})
    msg = str(err.value)
    assert "zfctl.return_image" in msg and '"early" or "always" or "never"' in msg
