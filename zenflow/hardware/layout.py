"""The bytes each engine holds for a model: ``layout(census, mode, settings)``, one line per
buffer, the single source of the formulas (ZENFLOW.md section 2b).

Notation (as in ZENFLOW.md section 2b): P = trainable params, Pz = params of ZenFlow weights
(2-D, >= ``DEFAULT_MIN_NUMEL`` elements, scored by columns), Pd = P - Pz (dense params),
S = selected elements (sum over ZenFlow weights of rows x k), N = Pz - S, dt = bytes of the
training dtype (2 bf16, 4 fp32), B = elements of one staging bucket, nb = device buckets
(2; 4 with data parallelism), L = elements of the largest gradient the stream routes (the
one being produced during backward), A = trainable params of --engine lora (its adapters
and the head, ``ParamCensus.lora_params``).

The layout is the streamed one (``zfctl.stream_grads``, on for a separate device): every
gradient leaves the device as backward produces it, so the device holds the selected
columns' gradient (S), the always-important parameters' (Pd), the one in flight (L) and the
buckets, at the peak of backward. Without streaming, or with micro-batches summed on the
device (``zfctl.grad_accumulation: "device"``), it holds the whole gradient (P) instead.

ZenFlow's host keeps only the non-selected columns of each weight, compact
(``zfctl.host_state``): "exact" holds an fp32 master, fp32 moments and an fp32 window sum
(16 N bytes), "compact" the fp32 master, 8-bit block-wise moments with two fp32 scales per
256 elements and a bf16 window sum (8 N + 8 N/256); both an int64 step count per
non-selected column, and a store of the step's pieces in the link's dtype while they wait
for the step's clipping coefficient (N x 2 in bf16, pinned: the device copies the pieces
there; micro-batches summed on the host: their fp32 sum instead, and a bounded ring of
pinned staging slots their pieces land in; ``zfctl.step_store`` "off": neither, only the
ring; with clipping each window's sum is then clipped once, by its steps' smallest
coefficient; "q8": the ring, and with clipping an 8-bit copy of the step's pieces, N + 4
N/256, not pinned). The link has one pinned read buffer; the
master is pinned too (the host->device return reads it). These are the steady
state, between steps; ``zenflow.hardware.host_peak`` adds what a whole run holds on top.

Every item has a category the engine's own memory accounting uses: on the device "weights",
"grads", "optimizer" (fp32 master slices, moments, step counts), "staging" (copy buckets)
and "activations" (an estimate); on the host "master_moments", "accumulators" and "staging".

Lays out one engine mode; checking the items against a memory budget, and the verdict, are
``zenflow.hardware.estimate``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zenflow.engine.accelerator.base import READ_BUFFER_BYTES
from zenflow.engine.copies import bucket_count
from zenflow.hardware.census import ArchShape, EstimateError, ParamCensus
from zenflow.ops import I8_BLOCK  # elements per fp32 scale of the q8 step store's copies

ENGINE_MODES = ("device", "offload", "zenflow", "lora")
HOST_STATES = ("exact", "compact")  # zfctl.host_state
Q8_BLOCK = 256  # elements per fp32 scale of the compact state's 8-bit moments (zenflow.ops)
# the q8 step store's item (made at a window's second step: not there at the first selection)
Q8_COPIES = "step store: 8-bit copies"
RING_MIN_SLOTS = 4  # pinned staging slots of the link: max(4, copy buckets)
DEVICE_CATEGORIES = ("weights", "grads", "optimizer", "staging", "activations")
HOST_CATEGORIES = ("master_moments", "accumulators", "staging")


@dataclass(frozen=True)
class Settings:
    """The run settings the layout depends on."""

    topk_ratio: float = 0.1
    bf16: bool = True
    overlap_step: bool = False  # the host step runs while the next window trains
    pin_memory: bool = True  # link buffers pinned (only with a separate device)
    micro_batch: int = 8
    seq_len: int = 128
    stream_grads: bool = True  # gradients leave the device during backward
    grad_accumulation: str = "host"  # where micro-batches are summed ("host" or "device")
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False  # activations recomputed in backward
    world_size: int = 1  # data-parallel ranks: more device buckets in flight
    warmup: bool = False  # full_warm_up_rounds > 0: warm-up images on the host
    cpu_device: bool = False  # the device is the CPU: ZenFlow sums where autograd writes
    copy_buckets: int | None = None  # zfctl.copy_buckets (None: "auto")
    host_state: str = "exact"  # zfctl.host_state: "exact" or "compact"
    update_interval: int = 4  # S, steps per host window ("auto" is taken as 4)
    return_image: str = "early"  # zfctl.return_image: "early", "always" or "never"
    # zfctl.step_store: "off" / "q8" add pieces as they arrive; "auto" is "on" (the store)
    # unless the estimate's fallbacks change it (``zenflow.hardware.estimate.fallbacks``)
    step_store: str = "auto"
    clipping: bool = True  # gradient_clipping > 0: a step's pieces wait for its coefficient
    early_steps: int = 0  # zfctl.early.steps (0: no early phase)
    lora_rank: int = 8  # --engine lora: the adapters' rank (zfctl.lora.rank)
    # saving copies device tensors to the host, one storage at a time (cuda); sim's and the
    # CPU's tensors already live in host memory
    copies_on_save: bool = True

    @property
    def whole_grads(self) -> bool:
        """Whether the device holds whole gradients (no streaming, or micro-batches summed
        in them)."""
        return not self.stream_grads or (
            self.gradient_accumulation_steps > 1 and self.grad_accumulation == "device"
        )

    @property
    def host_sums(self) -> bool:
        """Micro-batches summed on the host in fp32."""
        return self.gradient_accumulation_steps > 1 and not self.whole_grads

    @property
    def _store_setting_applies(self) -> bool:
        """zfctl.step_store decides the layout: not with micro-batches summed on the host
        (their fp32 sum instead), nor on the CPU device (no pieces)."""
        return not self.host_sums and not self.cpu_device

    @property
    def adds_on_arrival(self) -> bool:
        """ZenFlow adds each piece as it arrives, through the ring (zfctl.step_store "off",
        or "q8"): no store of whole pieces."""
        return self.step_store in ("off", "q8") and self._store_setting_applies

    @property
    def store_q8(self) -> bool:
        """The pieces' 8-bit copies wait for the step's coefficient (zfctl.step_store "q8"
        with clipping; without it "q8" is "off")."""
        return self.step_store == "q8" and self.clipping and self._store_setting_applies

    @property
    def store_optional(self) -> bool:
        """The step store is on where nothing waits for a clipping coefficient: the run
        computes the same weights without it (``zenflow.hardware.estimate.fallbacks``)."""
        return self.store_kept and not self.clipping and self._store_setting_applies

    @property
    def store_window_clip(self) -> bool:
        """The step store is on and the run clips: without the store each window's host
        part would be clipped by its steps' smallest coefficient, a change of arithmetic the
        user chooses (preflight's fix, the estimate's sentence, tune-hw's choice)."""
        return self.store_kept and self.clipping and self._store_setting_applies

    @property
    def store_auto_q8(self) -> bool:
        """zfctl.step_store "auto" with clipping: the store where it fits, else its 8-bit
        copies (``zenflow.hardware.estimate.fallbacks``)."""
        return self.step_store == "auto" and self.store_window_clip

    @property
    def store_fixes(self) -> tuple[str, ...]:
        """With clipping, the ``zfctl.step_store`` settings that change how the host's part
        is clipped, named as fixes where the run does not fit (never taken by themselves),
        mildest first: "q8" where the store is set "on" ("auto" has tried it:
        ``zenflow.hardware.estimate.fallbacks``), then "off" (also where "q8" is set)."""
        if self.store_window_clip:
            return ("off",) if self.store_auto_q8 else ("q8", "off")
        return ("off",) if self.store_q8 else ()

    @property
    def store_kept(self) -> bool:
        """zfctl.step_store keeps the store: "on", or "auto" (the store where it fits)."""
        return self.step_store in ("on", "auto")

    @property
    def dtype_bytes(self) -> int:
        return 2 if self.bf16 else 4

    @property
    def compact(self) -> bool:
        return self.host_state == "compact"

    @property
    def link_bytes(self) -> int:
        """Bytes of one element crossing the link device->host: the training dtype, bf16 in
        the compact state even for an fp32 model (cast on the device before the copy)."""
        return 2 if self.compact else self.dtype_bytes

    @property
    def dtype(self) -> str:
        return "bf16" if self.bf16 else "fp32"

    def return_images(self, early: bool) -> bool:
        """Whether bf16 images of the host results exist (zfctl.return_image; a bf16 model
        on a separate device, one rank): the whole run (``early`` False: "always") or during
        the early phase only (``early`` True: "early" with zfctl.early on)."""
        if not self.bf16 or self.cpu_device or self.world_size > 1:
            return False
        if early:
            return self.return_image == "early" and self.early_steps > 0
        return self.return_image == "always"


def settings_from_config(config=None, **overrides: Any) -> Settings:
    """Settings from a zenflow Config (topk_ratio, bf16, overlap_step, pin_memory, micro-batch);
    keyword overrides that are not None win. Without a config: bf16, topk 0.1."""
    values: dict[str, Any] = {}
    if config is not None:
        # bf16 "auto" resolves on for a separate device (what the estimate is about)
        values["bf16"] = config.bf16 == "auto" or bool(config.bf16)
        values["pin_memory"] = bool(config.pin_memory)
        if config.train_micro_batch_size_per_gpu:
            values["micro_batch"] = int(config.train_micro_batch_size_per_gpu)
        values["gradient_accumulation_steps"] = int(config.gradient_accumulation_steps)
        values["grad_accumulation"] = config.engine.grad_accumulation
        values["stream_grads"] = config.engine.stream_grads in (True, "auto")
        if config.engine.copy_buckets != "auto":
            values["copy_buckets"] = int(config.engine.copy_buckets)
        values["host_state"] = getattr(config.engine, "host_state", "exact")
        values["lora_rank"] = int(config.engine.lora.rank)
        values["return_image"] = getattr(config.engine, "return_image", "early")
        values["step_store"] = getattr(config.engine, "step_store", "auto")
        values["clipping"] = float(config.gradient_clipping or 0) > 0
        values["early_steps"] = int(config.engine.early.steps)
        if config.zenflow is not None:
            values["topk_ratio"] = float(config.zenflow.topk_ratio)
            values["overlap_step"] = bool(config.zenflow.overlap_step)
            values["warmup"] = int(config.zenflow.full_warm_up_rounds) > 0
            if config.zenflow.update_interval != "auto":
                values["update_interval"] = int(config.zenflow.update_interval)
    values.update({k: v for k, v in overrides.items() if v is not None})
    if not 0 < values.get("topk_ratio", 0.1) <= 1:
        raise EstimateError(f"--topk-ratio must be in (0, 1], got {values['topk_ratio']}.")
    if values.get("host_state", "exact") not in HOST_STATES:
        raise EstimateError(f"--host-state {values['host_state']!r}: use exact or compact.")
    return Settings(**values)


@dataclass(frozen=True)
class Item:
    """One buffer an engine holds."""

    side: str  # "device" or "host"
    category: str  # one of DEVICE_CATEGORIES / HOST_CATEGORIES
    what: str
    bytes: int
    formula: str
    pinned: bool = False  # a host buffer that crosses the link (page-locked when pinning)


def activation_bytes(arch: ArchShape | None, s: Settings) -> tuple[int | None, str]:
    """Activation memory of one micro-batch (an estimate) and its formula.

    Transformer blocks, per token and hidden unit of one layer at 2-byte activations (k;
    scaled by dt/2):

    - GPT-2 and Llama-like layers (``ArchShape.family``), as transformers runs them with
      ``sdpa`` (flash attention: no s x s scores kept), measured on the simulated device's
      pool (``bench/activations.py``, docs/BENCHMARKS.md): attention 12 (q, k, v, its output
      and the output projection's input); GPT-2 two LayerNorms' inputs and outputs 8 and an
      MLP of width i whose six-op GELU keeps five i-wide tensors, 10*i/h (+2 for its two
      dropout masks, a byte each on a GPU, where dropout is on); Llama two RMSNorms with their
      fp32 copies 12 and SwiGLU's four i-wide tensors 8*i/h. The backward's transients add
      half a layer.
    - Any other layer: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
      Transformer Models"), k = 34 + 5*a*s/h.

    With activation checkpointing (``gradient_checkpointing``: transformers recomputes each
    layer in backward from its input) every layer keeps only its input, s*b*h*dt, and one
    layer's full activations exist at a time, while it is recomputed (GPT-2 and Llama: with
    its transients). Head: a causal LM's logits in the training dtype, their fp32 copy for
    the loss and its log-softmax, b*s*vocab*12 (measured: 11.3-12); a classifier's fp32
    logits and their gradient, b*num_labels*8.
    """
    if arch is None:
        return None, "unknown for this architecture (no hidden_size/heads/layers in its config)"
    b, seq, h, dt = s.micro_batch, s.seq_len, arch.hidden, s.dtype_bytes
    if arch.causal_lm:
        head, head_f = b * seq * arch.vocab * 12, "b*s*vocab*12"
    else:
        head, head_f = b * arch.num_labels * 4 * 2, "b*labels*8"
    k, k_f, transient = _layer_k(arch, seq)
    per_layer = seq * b * h * k * dt / 2
    extra = per_layer / 2 if transient else 0
    extra_f = f" + s*b*h*{k_f}*dt/4" if transient else ""
    if s.gradient_checkpointing:
        body = arch.layers * seq * b * h * dt + per_layer + extra
        formula = f"L*s*b*h*dt + s*b*h*{k_f}*dt/2{extra_f} (checkpointed) + {head_f}"
        return int(body + head), formula
    formula = f"L*s*b*h*{k_f}*dt/2{extra_f} + {head_f}"
    return int(arch.layers * per_layer + extra + head), formula


def activation_source(arch: ArchShape | None) -> str:
    """Where ``activation_bytes``'s layer term for ``arch`` comes from (the estimate's note)."""
    if arch is not None and arch.family in ("gpt2", "llama"):
        return ("transformers' layers with flash attention, measured on sim: "
                'docs/BENCHMARKS.md, "The activation term against the pool"')  # fmt: skip
    return "Korthikanti et al. 2022"


def _layer_k(arch: ArchShape, seq: int) -> tuple[float, str, bool]:
    """(k, its formula, whether the backward's transients are added) of one layer:
    ``activation_bytes``."""
    i_h = (arch.intermediate or 4 * arch.hidden) / arch.hidden
    if arch.family == "gpt2":
        masks = 2 if arch.dropout else 0
        return 20 + masks + 10 * i_h, f"({20 + masks}+10*i/h)", True
    if arch.family == "llama":
        return 24 + 8 * i_h, "(24+8*i/h)", True
    return 34 + 5 * arch.heads * seq / arch.hidden, "(34+5*a*s/h)", False


# --------------------------------------------------------------------------- the layout


class _Buffers:
    """The items laid out so far, in order, and the notation of the module docstring."""

    def __init__(self, census: ParamCensus, s: Settings) -> None:
        self.census, self.s = census, s
        self.items: list[Item] = []
        self.P, self.Pz, self.Pd = census.params, census.zenflow_params, census.dense_params
        self.dt, self.dn = s.dtype_bytes, s.dtype
        self.S, self.K = census.selected(s.topk_ratio)
        self.N = self.Pz - self.S
        self.B = census.bucket_elements
        self.fp32_state = 12 if s.bf16 else 8  # + fp32 master only when the weights are bf16
        self.dp = s.world_size > 1
        # ZenFlow's device copy buckets: the user's count ("auto": the engine's rule)
        self.copy_buckets = bucket_count(s.copy_buckets, self.dp, self.N, self.B)

    def dev(self, cat: str, what: str, n: int, formula: str) -> None:
        self.items.append(Item("device", cat, what, int(n), formula))

    def host(self, cat: str, what: str, n: int, formula: str, pinned: bool = False) -> None:
        self.items.append(Item("host", cat, what, int(n), formula, pinned))


def layout(census: ParamCensus, mode: str, s: Settings) -> list[Item]:
    """Every buffer the engine holds in ``mode``, with its bytes and formula.

    This is the single source of the formulas (ZENFLOW.md section 2b), one line per buffer.
    Activations are included on the device side when the architecture is known.
    """
    if mode not in ENGINE_MODES:
        raise EstimateError(f"engine {mode!r} is not one of {', '.join(ENGINE_MODES)}.")
    b = _Buffers(census, s)
    # Every engine: the model's weights in the training dtype.
    b.dev("weights", f"weights ({b.dn})", b.P * b.dt, f"P*{b.dt}")
    if mode == "device":
        _device_engine(b)
    elif mode == "offload":
        _offload_engine(b)
    elif mode == "lora":
        _lora_engine(b)
    else:
        _zenflow_engine(b)
    return _with_activations(b.items, census, s)


def _device_engine(b: _Buffers) -> None:
    """Plain mixed-precision AdamW, everything on the device."""
    P, dt, dn = b.P, b.dt, b.dn
    b.dev("grads", f"gradients ({dn})", P * dt, f"P*{dt}")
    if b.s.bf16:  # the fused step reads fp32 gradients, made one chunk at a time
        L = b.census.largest_numel
        b.dev("grads", "fp32 gradients, one chunk at the step",
              L * 4, "L*4")  # fmt: skip
    b.dev("optimizer", "exp_avg + exp_avg_sq (fp32)", P * 8, "P*8")
    if b.s.bf16:
        b.dev("optimizer", "master weights (fp32)", P * 4, "P*4")


def _lora_engine(b: _Buffers) -> None:
    """--engine lora: the base frozen in the training dtype (above), adapters of rank r on
    every projection peft's "all-linear" adapts and the head's trained copy (A = r x (in +
    out) summed, + the head), their gradients and mixed-precision AdamW on the device. The
    host holds nothing of the optimizer."""
    A, dt, dn, r = b.census.lora_params(b.s.lora_rank), b.dt, b.dn, b.s.lora_rank
    b.dev("weights", f"LoRA adapters (rank {r}) + the head's trained copy ({dn})", A * dt,
          f"A*{dt}")  # fmt: skip
    b.dev("grads", f"adapters' and head's gradients ({dn})", A * dt, f"A*{dt}")
    if b.s.bf16:  # as in _device_engine: fp32, one chunk at a time, at the step
        c = b.census  # the largest trainable tensor: the head, or one adapter's r x max(in, out)
        La = max([c.lora_head] + [r * max(i, o) for i, o in c.lora_linear])
        b.dev("grads", "fp32 gradients, one chunk at the step",
              La * 4, "La*4")  # fmt: skip
    b.dev("optimizer", "adapters' and head's exp_avg + exp_avg_sq (fp32)", A * 8, "A*8")
    if b.s.bf16:
        b.dev("optimizer", "adapters' and head's master weights (fp32)", A * 4, "A*4")


def _offload_engine(b: _Buffers) -> None:
    """ZeRO-Offload: the whole optimizer on the host."""
    census, s, P, dt, dn = b.census, b.s, b.P, b.dt, b.dn
    Lo = census.largest_numel
    if s.whole_grads:
        b.dev("grads", f"gradients ({dn}, whole)", P * dt, f"P*{dt}")
    else:
        b.dev("grads", f"the gradient being streamed (largest, {dn})", Lo * dt, f"L*{dt}")
    Bo = census.bucket_elements_all
    nb = bucket_count(s.copy_buckets, b.dp, P, Bo)
    b.dev("staging", f"copy buckets ({nb}, {dn})", nb * Bo * dt, f"{nb}*B*{dt}")
    b.host("master_moments", "master + exp_avg + exp_avg_sq (fp32)", P * 12, "P*12")
    if s.host_sums:  # micro-batches land in pinned staging, summed in fp32
        b.host("staging", f"device->host staging ({dn})", P * dt, f"P*{dt}", True)
        b.host("accumulators", "micro-batch gradient sums (fp32)", P * 4, "P*4")
    else:  # every step's gradient lands here before the CPU Adam reads it
        b.host("staging", f"gradient landing buffer ({dn})", P * dt, f"P*{dt}", True)
    if s.bf16:  # fp32: the master itself is copied back, no image needed
        b.host("staging", "bf16 image of the updated weights", P * 2, "P*2", True)


def _zenflow_engine(b: _Buffers) -> None:
    """ZenFlow: the selected columns on the device, the rest on the host (compact)."""
    _zenflow_device(b)
    _zenflow_host_state(b)
    if b.s.cpu_device:  # zero-copy: full-shape fp32 sums, 2 with overlap; nothing crosses
        slots = 2 if b.s.overlap_step else 1
        b.dev("optimizer", f"window sums, full shape (fp32, {slots} slot"
              f"{'s' * (slots > 1)}: the CPU device sums where autograd writes)",
              b.Pz * 4 * slots, f"Pz*4*{slots}")  # fmt: skip
        # the host step gathers one weight's window sum into a compact fp32 temporary
        big = max(b.census.nonselected(b.s.topk_ratio), default=0)
        b.host("accumulators", "one weight's window sum, gathered compact (fp32)", big * 4,
               "4*max(N per weight)")  # fmt: skip
        return
    _zenflow_host_link(b)


def _zenflow_device(b: _Buffers) -> None:
    """ZenFlow's device side: gradients, the selected columns' and dense params' state,
    the copy buckets."""
    census, s = b.census, b.s
    P, Pd, S, K, B, dt, dn = b.P, b.Pd, b.S, b.K, b.B, b.dt, b.dn
    Lz = census.largest_zenflow_numel
    if s.whole_grads:
        b.dev("grads", f"gradients ({dn}, whole)", P * dt, f"P*{dt}")
    else:
        b.dev("grads", f"always-important params' gradients ({dn})", Pd * dt, f"Pd*{dt}")
        b.dev("grads", f"the gradient being streamed (largest, {dn})", Lz * dt, f"L*{dt}")
    # the step's gradient of the selected columns, compact, until the optimizer step
    # (a CPU device reads the selected columns from the whole gradient instead)
    if not s.cpu_device:
        b.dev("grads", f"selected columns' gradient ({dn})", S * dt, f"S*{dt}")
    if not s.cpu_device:  # bf16: widened to fp32 batch by batch, in one scratch; both
        # dtypes: the per-column update's denominators (after a re-selection) there too
        scratch = max(census.largest_selected(s.topk_ratio), S // 64)
        what = "update" if s.bf16 else "per-column update's denominators"
        b.dev("grads", f"fp32 scratch of the selected columns' {what}", scratch * 4,
              "4*max(largest rows*k, S/64)")  # fmt: skip
    # selected columns and dense params update exactly in fp32 on the device
    sel_what = "master + moments (fp32)" if s.bf16 else "exp_avg + exp_avg_sq (fp32)"
    fp32_state = b.fp32_state
    b.dev("optimizer", f"selected columns: {sel_what}", S * fp32_state, f"S*{fp32_state}")
    b.dev("optimizer", f"dense params: {sel_what}", Pd * fp32_state, f"Pd*{fp32_state}")
    # an integer step per selected column: bias correction survives hand-overs
    b.dev("optimizer", "per-column step counts (int64)", K * 8, "8*sum(k)")
    if not s.cpu_device:
        nz = b.copy_buckets
        b.dev("staging", f"copy buckets ({nz}, {dn})", nz * B * dt, f"{nz}*B*{dt}")
        if (s.overlap_step and not b.dp) or s.bf16:
            # the host's fp32 master comes back into two fp32 buckets of its own (with
            # overlap during the window end's backward), cast to bf16 as it is scattered
            b.dev("staging", "return buckets (2, fp32: the host's master coming back)",
                  2 * B * 4, "2*B*4")  # fmt: skip
            if s.bf16:  # each returned piece is cast to bf16 there before its scatter
                b.dev("staging", "return cast bucket (bf16)", B * 2, "B*2")


def _zenflow_host_state(b: _Buffers) -> None:
    """ZenFlow's host state: the non-selected columns of each weight, compact, in the
    ``zfctl.host_state`` chosen. The master is pinned beside a separate device (the
    host->device return reads it)."""
    s, N = b.s, b.N
    cols = b.census.nonselected_columns(s.topk_ratio)
    b.host("master_moments", "master of the non-selected columns (fp32)", N * 4, "N*4",
           not s.cpu_device)  # fmt: skip
    if s.compact:
        scales = sum(8 * -(-n // Q8_BLOCK) for n in b.census.nonselected(s.topk_ratio))
        b.host("master_moments", "exp_avg + exp_avg_sq (8-bit codes)", N * 2, "N*2")
        b.host("master_moments", f"their scales (2 fp32 per {Q8_BLOCK} elements)", scales,
               f"8*ceil(N/{Q8_BLOCK})")  # fmt: skip
    else:
        b.host("master_moments", "exp_avg + exp_avg_sq (fp32)", N * 8, "N*8")
    b.host("master_moments", "step count per non-selected column (int64)", cols * 8,
           "8*sum(n-k)")  # fmt: skip


def _zenflow_host_link(b: _Buffers) -> None:
    """ZenFlow's host buffers beside a separate device: the window sum, the step's pieces
    waiting for its gate, and the pinned buffers of the link."""
    s, N, B = b.s, b.N, b.B
    sb, sdn = (2, "bf16") if s.compact else (4, "fp32")
    lb, ldn = s.link_bytes, "bf16" if s.link_bytes == 2 else "fp32"
    # one window sum: with overlap the next window's first write to a weight's sum
    # waits until the host step has read it (the worker goes in backward's order)
    b.host("accumulators", f"window sum of the non-selected columns ({sdn})", N * sb,
           f"N*{sb}")  # fmt: skip
    if s.host_sums:  # the micro-batches' sum, fp32 in both states
        b.host("accumulators", "micro-batch sum of the non-selected columns (fp32)", N * 4,
               "N*4")  # fmt: skip
    elif s.store_q8:  # each piece's 8-bit copy, until the step's coefficient corrects
        # the sum from it (zenflow.engine.zenflow.step_q8; not pinned: the host writes it)
        b.host("accumulators", f"{Q8_COPIES} of a step's pieces awaiting its "
               f"clipping (int8, an fp32 scale per {I8_BLOCK})", N + 4 * -(-N // I8_BLOCK),
               f"N+4*ceil(N/{I8_BLOCK})")  # fmt: skip
    elif not s.adds_on_arrival:
        # a piece is added with its step's clipping coefficient, known at the step's end:
        # until then the step's pieces wait in a store of their own, where the device
        # copies them (pinned, the link's dtype; zenflow.engine.accumulator.land)
        b.host("accumulators", f"step store: a step's pieces awaiting its clipping ({ldn})",
               N * lb, f"N*{lb}", True)  # fmt: skip
    # pinned: with micro-batches summed on the host or without a step store, a ring of
    # bucket-sized staging slots the pieces land in (given back by the accumulator); and
    # one reused read buffer for checkpoints and hand-overs
    if s.host_sums or s.adds_on_arrival:
        slots = max(RING_MIN_SLOTS, b.copy_buckets)
        b.host("staging", f"device->host staging ring ({slots} slots of B, {ldn})",
               slots * B * lb, f"{slots}*B*{lb}", True)  # fmt: skip
    b.host("staging", "read buffer (device->host reads)", READ_BUFFER_BYTES,
           f"{READ_BUFFER_BYTES >> 20} MiB", True)  # fmt: skip
    if s.return_images(early=False):  # the host step's bf16 image, read by the return
        b.host("accumulators", "return images of the non-selected columns (bf16, "
               'zfctl.return_image "always")', N * 2, "N*2", True)  # fmt: skip


def _with_activations(items: list[Item], census: ParamCensus, s: Settings) -> list[Item]:
    """``items`` plus the activations' estimate (when the architecture is known), device
    items first, then host (a stable sort)."""
    act, formula = activation_bytes(census.arch, s)
    if act is not None:
        items.append(Item("device", "activations", "activations (estimate)", act, formula))
    items.sort(key=lambda i: i.side != "device")
    return items
