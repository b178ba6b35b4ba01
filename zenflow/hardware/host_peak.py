"""The host memory of a whole run: ``host_phases(census, mode, settings, items)``, the host
bytes an engine holds in each phase of a run, and ``host_peak`` (their largest, plus the
process's runtime).

``zenflow.hardware.layout`` lays out the steady state between steps. A run holds more at
other moments; each phase below is that steady state plus what the phase adds, or what
replaces it before it exists (P params, Pz of ZenFlow weights, N non-selected elements,
dt the training dtype's bytes, C the compact host state, L the largest tensor):

- **set-up**: the model is loaded on the host in fp32 (4P) before it moves to the device;
  with bf16 its fp32 tensors become the masters (no copy) while the bf16 copy is made (2P).
- **first selection** (ZenFlow): the masters (bf16: 4Pz; an fp32 model on a separate device
  has none, its values are read from the device) are consumed weight by weight as the compact
  state is created: max(C, masters) + one weight's master (compact: + the fp32 moments'
  pair of the selection, the largest weight's size: ``q8_state.MomentScratch``).
  Whole gradients land on the host for that step when micro-batches are summed on the
  host, with warm-up rounds or without streaming (Pz x dt, fp32 when summed on the host);
  the landing is freed after it.
- **warm-up** (``full_warm_up_rounds`` > 0): the full host state (12 Pz) and the whole
  gradient's landing until the first selection.
- **steps**: the steady state.
- **early phase** (``zfctl.early`` with a bf16 model): + the return's bf16 images (2N),
  made at the first window's end and freed after the phase. A re-selection or a checkpoint
  inside the phase holds them too.
- **checkpoint**: the host state is shared with torch.save (no copy); on cuda torch.save
  copies device tensors to the host one storage at a time: + the largest.
- **re-selection**: the compact arrays are re-laid in place (``compact_merge_``), so only
  the moving columns' values are extra: the entering columns' fp32 master, moments and
  counts on their way to the device (16 x the largest weight's selected elements; the
  leaving columns arrive in the read buffer, part of the steady state); compact also
  dequantises each weight's 8-bit moments into the selection's pair of fp32 arrays (of the
  largest weight's size, held for the whole selection), merges them and quantises them
  again (8 N_w: the two fp32 moments; the second is squared and square-rooted in place, a
  chunk at a time). The q8 step store's 8-bit copies are dropped before it (the new pieces
  need new ones, made by the next window's second step): - their N + N/64.
- **evaluation**: nothing material on the host.
- **final save**: ZenFlow's host state (not its link) is released before it
  (``ZenFlowEngine.release_host_state``); on cuda, safetensors (0.8) moves every tensor of a
  shard to the host before writing it, and transformers writes shards of up to 50 GB:
  + min(P x dt, 50 GB).

The process's runtime (Python, torch, transformers, the tokenizer and the data) is
``RUNTIME_BYTES``, a constant measured here (docs/BENCHMARKS.md), added to every phase.

Must not lay out buffers of its own (every steady byte comes from ``layout``) nor check a
budget (``zenflow.hardware.estimate``'s).
"""

from __future__ import annotations

from dataclasses import dataclass

from zenflow.hardware.census import ParamCensus
from zenflow.hardware.layout import Q8_COPIES, Item, Settings

# The runtime: the whole-run peak RSS of `zfctl finetune` of a 1.6M-parameter GPT-2 (2
# layers, width 32: its own bytes are ~30 MB) on SST-2 (67k rows, tokenized), --device sim,
# device and offload engines, 4 steps, an evaluation and the final save, measured with
# /usr/bin/time -v on the project's CPU machine: 585 MiB (docs/BENCHMARKS.md, "The host
# runtime"): Python, torch, transformers, datasets, the native op, the tokenizer and the
# data. Rounded up; a larger dataset adds its rows, a CUDA context its host pages.
RUNTIME_BYTES = 600 * 2**20
# transformers' save_pretrained writes shards of at most this many bytes (its default
# max_shard_size, transformers 5); safetensors holds one shard's tensors on the host
SAVE_SHARD_BYTES = 50 * 10**9
PHASES = (
    "set-up", "warm-up", "first selection", "early phase", "steps", "checkpoint",
    "re-selection", "evaluation", "final save",
)  # fmt: skip


@dataclass(frozen=True)
class Phase:
    """The host bytes of one phase of a run (the runtime not included) and its terms."""

    name: str
    bytes: int
    terms: str


def host_phases(census: ParamCensus, mode: str, s: Settings, items: list[Item]) -> list[Phase]:
    """The host bytes of ``mode`` in every phase of a run (``items``: its layout)."""
    steady = sum(i.bytes for i in items if i.side == "host")
    P, dt = census.params, s.dtype_bytes
    out = [_setup(census, s)]
    if mode == "zenflow":
        out += _zenflow_phases(census, s, items, steady)
    else:
        if mode == "offload":  # the masters stay alive while the host state is built
            out.append(Phase("set-up", 4 * P + steady, "masters 4P + host state"))
        out.append(Phase("steps", steady, "steady state"))
    largest = _largest_device_tensor(census, mode, s)
    # the final save: zenflow's host state is released before it (its link stays)
    if mode == "zenflow":
        kept = sum(i.bytes for i in items if i.side == "host" and i.category == "staging")
        kept_terms = "link (the host state is released before the save)"
    else:
        kept, kept_terms = steady, "steady"
    if s.copies_on_save:
        images = early_images(census, s) if mode == "zenflow" else 0
        out.append(Phase("checkpoint", steady + images + largest,
                         "steady + the largest device tensor"
                         + (" + the early phase's images (2*N)" if images else "")))  # fmt: skip
        shard = min(P * dt, SAVE_SHARD_BYTES)
        out.append(Phase("final save", kept + shard, f"{kept_terms} + min(P*{dt}, 50 GB shard)"))
    else:
        out.append(Phase("checkpoint", steady, "steady (the host state is shared)"))
        out.append(Phase("final save", kept, f"{kept_terms} (tensors already in host memory)"))
    out.append(Phase("evaluation", steady, "steady"))
    best: dict[str, Phase] = {}
    for ph in out:  # one figure per phase: its largest moment
        if ph.name not in best or ph.bytes > best[ph.name].bytes:
            best[ph.name] = ph
    return [best[name] for name in PHASES if name in best]


def host_peak(phases: list[Phase], runtime: int = RUNTIME_BYTES) -> tuple[int, str]:
    """(whole-run host peak, the phase it happens in): the largest phase + the runtime."""
    top = max(phases, key=lambda p: p.bytes)
    return top.bytes + runtime, top.name


def _setup(census: ParamCensus, s: Settings) -> Phase:
    """The model on the host before it moves: loaded in fp32, with bf16 its copy beside."""
    P = census.params
    if s.cpu_device:  # the loaded model is the device's weights; bf16 keeps fp32 masters
        return Phase("set-up", 4 * P if s.bf16 else 0, "fp32 masters 4P" if s.bf16 else "-")
    if s.bf16:
        return Phase("set-up", 6 * P, "fp32 model 4P + its bf16 copy 2P")
    return Phase("set-up", 4 * P, "fp32 model 4P")


def _zenflow_phases(census: ParamCensus, s: Settings, items: list[Item], steady: int):
    """ZenFlow's first selection, warm-up, steps and re-selection."""
    Pz, k = census.zenflow_params, s.topk_ratio
    link = sum(i.bytes for i in items if i.side == "host" and i.category == "staging")
    state = steady - link  # the compact state, its sums and counts
    # the q8 step store's copies are made by a window's second step, after the selection
    later = sum(i.bytes for i in items if i.side == "host" and i.what.startswith(Q8_COPIES))
    per_weight = [r * c for r, c in census.zenflow_weights]
    big = max(per_weight, default=0)
    whole = s.host_sums or s.warmup or not s.stream_grads
    landing = 0 if s.cpu_device or not whole else Pz * (4 if s.host_sums else s.dtype_bytes)
    before = 12 if s.warmup else (4 if s.bf16 else 0)  # host bytes per param before it
    n_big = max(census.nonselected(k), default=0)
    # compact: the moments are filled in the selection's fp32 pair (the largest weight's
    # size, held through the selection), then quantised
    temps = 8 * n_big if s.compact else 0
    first = link + landing + max(state - later, before * Pz) + before * big + temps
    held = "compact state" + (" without the q8 copies" if later else "")
    terms = (f"link + max({held}, {before}*Pz) + one weight's {before}*numel"
             + (" + its fp32 moments (8*N)" if temps else "")
             + (" + whole-gradient landing" if landing else ""))  # fmt: skip
    out = [Phase("first selection", first, terms)]
    if s.warmup:
        out.append(Phase("warm-up", link + 12 * Pz + landing,
                         "link + full state 12*Pz + whole-gradient landing"))  # fmt: skip
    images = early_images(census, s)
    if images:  # zfctl.return_image "early": made at the first window's end, freed after
        out.append(Phase("early phase", steady + images,
                         "steady + the return's bf16 images (2*N, zfctl.early)"))  # fmt: skip
    out.append(Phase("steps", steady, "steady state"))
    # a hand-over re-lays one weight at a time, in place: the entering columns' values
    # (16*S) are extra; compact also goes through fp32 moments (4*N + 4*N, the second
    # squared and square-rooted in place) before quantising them into the same codes; a
    # re-selection inside the early phase has its images beside it
    moving = 16 * census.largest_selected(k)
    per_elem = 8 if s.compact else 0
    terms = "steady + the entering columns' values (16*S)"
    if per_elem:
        terms += f" + the largest weight's moments through fp32 ({per_elem}*N)"
    if images:
        terms += " + the early phase's images (2*N)"
    if later:  # dropped before it: the next window's second step makes them for its pieces
        terms += " - the q8 copies (dropped before it)"
    out.append(Phase("re-selection", steady - later + images + moving + n_big * per_elem,
                     terms))  # fmt: skip
    return out


def early_images(census: ParamCensus, s: Settings) -> int:
    """Bytes of the return's bf16 images while ``zfctl.early``'s phase holds them (2 per
    non-selected element; 0 where there are none). Whatever the phase overlaps holds them
    too: a re-selection or a checkpoint may fall inside it (measured: docs/BENCHMARKS.md,
    "The compact state with a bf16 model")."""
    if not s.return_images(early=True):
        return 0
    return 2 * sum(census.nonselected(s.topk_ratio))


def _largest_device_tensor(census: ParamCensus, mode: str, s: Settings) -> int:
    """Bytes of the largest device tensor a checkpoint copies: the largest weight in the
    training dtype, or (device engine) its fp32 moment."""
    L = census.largest_numel
    if mode == "device":
        return L * 4
    return L * s.dtype_bytes
