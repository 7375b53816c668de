"""How much memory a peer needs on its training device and on the host, and which settings make it fit.

What each line counts (P parameters, S = 4·P bytes, one fp32 copy of the model; t tokens of a micro-batch):

- model parameters: 4·P (fp32 master weights, whatever the autocast precision);
- AdamW: two fp32 moments, 8·P, plus a 4-byte step count per parameter tensor;
- gradients: 4·P (fp32, accumulated over the micro-batches of a step);
- activations: what autograd saves, per token and decoder layer, counted on the presets with saved-tensor hooks
  (`activation_bytes`), plus backward temporaries and 16-bit copies of the weights under autocast;
- AdamW's step: on CUDA the foreach implementation allocates √v for every parameter at once (4·P; PyTorch's
  adamw.py), on CPU one tensor at a time;
- runtime: the device's fixed workspaces (measured on CPU; the CUDA context is assumed, not measured);
- outer state: the anchor θ_r and the outer momentum (where `outer.state_device` puts them), and the outer step's
  Δ and the gradient it sets;
- sync buffers (host): what the sync strategy keeps between rounds and what one round of it holds, counted from
  p2ptrain/sync/*.py (`sync_buffers`), the snapshot joiners download (net/state_sharing.py), data and process.

The peak is not the sum of the lines: activations, a full set of gradients and the outer step come at different
times. The formulas were fitted on CPU (tests/test_memory_plan.py, benchmarks/memory_plan.py); on a GPU, PyTorch's
caching allocator adds its own fragmentation on top.
"""

from __future__ import annotations

import dataclasses

import torch

from p2ptrain.choices import PRECISIONS, STATE_DEVICES
from p2ptrain.config import PeerConfig
from p2ptrain.data import BYTE_TOKENIZER
from p2ptrain.errors import ConfigError
from p2ptrain.maths.inner import autocast_dtype
from p2ptrain.maths.outer_optimizer import state_device_for
from p2ptrain.memory.buffers import Buffers, sync_buffers
from p2ptrain.memory.shape import ModelShape

MIB, GIB = 2**20, 2**30
DEVICES = ("cpu", "cuda", "mps")
# fixed device memory beyond the tensors: on CPU, autograd's and oneDNN's workspaces (measured: 24 MiB, 12 MiB more
# under autocast); on CUDA/MPS, the context and library workspaces: an assumption, not measured (no GPU here)
RUNTIME_BYTES = {"cpu": 24 * MIB, "cuda": 512 * MIB, "mps": 512 * MIB}
AUTOCAST_RUNTIME_BYTES = 12 * MIB
PROCESS_BYTES = 600 * MIB  # the peer process (Python, torch, transformers, hivemind) and its p2pd, before any model
# what the advice may change, and what each change costs in speed (lower is cheaper): the outer state on the host
# costs two copies a round, bf16 is faster on GPUs, micro-batches lose a little throughput, checkpointing recomputes
# the forward (about a third more compute)
CHANGE_COST = {"state_device": 0.1, "precision": 0.5, "micro_batches": 1.0, "activation_checkpointing": 3.0}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The knobs that decide a peer's memory (data.*, inner.*, outer.state_device), validated here."""

    batch_size: int = 8  # samples per inner step (data.batch_size)
    seq_len: int = 128  # tokens per sample (data.seq_len)
    micro_batches: int = 1  # a step's batch is split into this many parts, gradients accumulated
    activation_checkpointing: bool = False  # keep only each decoder layer's input; recompute the rest
    precision: str = "auto"  # auto (bf16 autocast on CUDA, fp32 elsewhere) | fp32 | bf16 | fp16
    state_device: str = "auto"  # auto (host when training on an accelerator) | host | device

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.seq_len < 1:
            raise ConfigError(f"batch size and sequence length must be >= 1, got {self.batch_size}, {self.seq_len}")
        if not 1 <= self.micro_batches <= self.batch_size:
            raise ConfigError(f"micro-batches must be between 1 and the batch size {self.batch_size}, got "
                              f"{self.micro_batches}")
        if self.precision not in PRECISIONS or self.state_device not in STATE_DEVICES:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)} and state device one of "
                              f"{', '.join(STATE_DEVICES)}, got {self.precision!r}, {self.state_device!r}")

    @property
    def micro_batch_size(self) -> int:
        """Samples in the largest micro-batch."""
        return -(-self.batch_size // self.micro_batches)

    def autocast_16(self, device: str) -> bool:
        """Whether the forward runs in 16 bits (bf16 or fp16 autocast) on `device`."""
        return autocast_dtype(self.precision, torch.device(device)) is not None

    def state_on_device(self, device: str) -> bool:
        """Whether the outer state lives on the training device (else in host memory)."""
        model_device = torch.device(device)
        return state_device_for(model_device, self.state_device) == model_device

    def changes(self, other: Settings) -> dict[str, object]:
        """The fields `other` sets differently, by name."""
        return {f.name: getattr(other, f.name) for f in dataclasses.fields(self)
                if getattr(other, f.name) != getattr(self, f.name)}


def settings_of(config: PeerConfig) -> Settings:
    """The memory settings a peer's config holds."""
    inner = config.inner
    return Settings(config.data.batch_size, config.data.seq_len, inner.micro_batches, inner.activation_checkpointing,
                    inner.precision, config.outer.state_device)


# ---- activations ------------------------------------------------------------------------------------------------
def layer_bytes_per_token(shape: ModelShape, half: bool) -> int:
    """What one decoder layer saves for the backward, per token. fp32: the two RMSNorms' inputs and outputs, q, k,
    v (after rotary) and the attention output (8h + 2·kv), the gated MLP's gate, up, silu and product (4i), two
    norm scales. 16-bit autocast: the matmuls' inputs and outputs in 16 bits, the norms and residuals in fp32."""
    h, kv, i = shape.hidden, shape.kv_hidden, shape.intermediate
    if half:
        return 2 * (5 * h + 2 * kv + 5 * i) + 4 * 4 * h + 8
    return 4 * (8 * h + 2 * kv + 4 * i) + 8


def head_bytes_per_token(shape: ModelShape, half: bool) -> int:
    """The final norm, the loss's log-softmax of the logits (fp32 even under autocast: the 16-bit logits are freed
    once upcast), and the labels."""
    h, v = shape.hidden, shape.vocab
    return (4 * 2 * h + 2 * h + 4 * v if half else 4 * (3 * h + v)) + 20


def activation_bytes(shape: ModelShape, settings: Settings, device: str, checkpointing: bool | None = None,
                     half: bool | None = None) -> int:
    """Peak activation memory of one micro-batch's forward and backward (what autograd saves, the backward's
    temporaries, 16-bit weight copies under autocast); `checkpointing` and `half` override the settings'."""
    checkpointing = settings.activation_checkpointing if checkpointing is None else checkpointing
    half = settings.autocast_16(device) if half is None else half
    tokens = settings.micro_batch_size * settings.seq_len
    layer, head = layer_bytes_per_token(shape, half), head_bytes_per_token(shape, half)
    # eager attention keeps the scores and probabilities: heads × seq per token and layer, fp32 (softmax upcasts)
    scores = 8 * shape.heads * settings.seq_len if shape.eager_attention else 0
    loss_backward = 8 * shape.vocab  # the log-softmax's and the logits' gradients (fp32)
    if checkpointing:  # each layer's input (fp32), then one layer recomputed at a time during the backward
        saved = tokens * (4 * shape.hidden * shape.layers + head)
        backward = tokens * max(loss_backward, layer + scores)
    else:
        saved = tokens * (shape.layers * (layer + scores) + head)
        # fitted on the presets: the backward's widest moment (fp32: the MLP's or the loss's gradients; 16-bit: two
        # extra bytes per hidden unit and layer stay alive, from the casts' gradients)
        backward = tokens * (8 * shape.layers * shape.hidden + loss_backward if half
                             else 4 * max(2 * shape.vocab, 7 * shape.intermediate // 4))
    weights_16 = 2 * shape.matmul_parameters if half else 0
    return saved + backward + weights_16


# ---- the plan ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Line:
    """One row of the plan: bytes held on the training device and on the host at that row's own peak."""

    what: str
    device_bytes: int
    host_bytes: int
    note: str = ""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Every line, and the peaks (not their sum: activations, gradients and the outer step do not coincide)."""

    shape: ModelShape
    settings: Settings
    device: str
    lines: tuple[Line, ...]
    training_bytes: int  # device peak of training: model, AdamW, gradients, activations, runtime, outer state there
    device_bytes: int  # device peak, the outer step included
    host_bytes: int  # host peak (on a CPU device: what the host needs beside the device's share)

    @property
    def total_bytes(self) -> int:
        """Both together: what one machine needs when the device is its CPU."""
        return self.device_bytes + self.host_bytes

    def line(self, what: str) -> Line:
        return next(line for line in self.lines if line.what.startswith(what))


def model_state_bytes(shape: ModelShape) -> dict[str, int]:
    """Parameters, AdamW state and gradients, in bytes: exactly what the tensors of an InnerTrainer hold."""
    return {"parameters": 4 * shape.parameters, "optimizer": 8 * shape.parameters + 4 * shape.tensors,
            "gradients": 4 * shape.parameters}


def plan_memory(shape: ModelShape, settings: Settings, device: str, config: PeerConfig | None = None,
                peers: int = 4) -> MemoryPlan:
    """The memory plan of a peer training `shape` with `settings` on `device` (cpu, cuda or mps); `config` gives
    the sync strategy and data (defaults otherwise), `peers` the peers of an all-reduce round."""
    if device not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    config = config if config is not None else PeerConfig()
    states = model_state_bytes(shape)
    half = settings.autocast_16(device)
    activations = activation_bytes(shape, settings, device)
    runtime = RUNTIME_BYTES[device] + (AUTOCAST_RUNTIME_BYTES if half and device == "cpu" else 0)
    step_temporaries = 4 * (shape.parameters if device == "cuda" else 2 * shape.largest_tensor)  # foreach on CUDA
    model_bytes = states["parameters"]
    with_momentum = config.sync.outer_momentum(config.outer.momentum) > 0
    momentum = with_momentum and config.sync.mode != "gasloc"  # GASLoC's is its previous iterate, a sync buffer
    outer_kept = model_bytes * (2 if momentum else 1)
    on_device = settings.state_on_device(device)
    buffers: Buffers = sync_buffers(config.sync, peers, with_momentum)
    data = _data_bytes(config)
    lines = (
        Line("model parameters (fp32)", model_bytes, 0),
        Line("AdamW moments (2 × fp32)", states["optimizer"], 0),
        Line("gradients (fp32)", states["gradients"], 0,
             "kept across micro-batches" if settings.micro_batches > 1 else ""),
        Line("activations", activations, 0, _activation_note(settings, half)),
        Line("AdamW step temporaries", step_temporaries, 0,
             "foreach on CUDA: a copy of the moments' root" if device == "cuda" else "per tensor"),
        Line("runtime workspaces", runtime, 0, "measured" if device == "cpu" else "CUDA context: assumed"),
        Line("outer state (anchor" + (" + momentum)" if momentum else ")"), outer_kept * on_device,
             outer_kept * (not on_device), "on the device" if on_device else "on the host"),
        Line("outer step (Δ, its gradient)", model_bytes * (1 + on_device), model_bytes * (not on_device),
             "after the inner phase"),
        *_host_lines(config, buffers, model_bytes, data),
    )
    base = model_bytes + states["optimizer"] + runtime + outer_kept * on_device
    grads_alive = states["gradients"] if settings.micro_batches > 1 else (
        states["gradients"] // 2 if settings.activation_checkpointing else 0)
    training = base + max(activations + grads_alive, states["gradients"] + step_temporaries)
    outer_step = base + model_bytes * (1 + on_device)
    host = PROCESS_BYTES + data + int(model_bytes * (buffers.kept + buffers.snapshot + max(
        buffers.round, not on_device))) + outer_kept * (not on_device)
    return MemoryPlan(shape, settings, device, lines, training, max(training, outer_step), host)


def _host_lines(config: PeerConfig, buffers: Buffers, model_bytes: int, data: int) -> tuple[Line, ...]:
    """The host's own lines: sync buffers, the snapshot for joiners, data, the process."""
    return (
        Line(f"sync buffers kept ({config.sync.mode})", 0, int(buffers.kept * model_bytes), buffers.kept_note),
        Line("sync buffers in a round", 0, int(buffers.round * model_bytes), buffers.round_note),
        Line("snapshot for joiners", 0, int(buffers.snapshot * model_bytes), "anchor + outer-sync state"),
        Line("data (one piece + validation)", 0, data, "approximate"),
        Line("process (Python, torch, hivemind, p2pd)", 0, PROCESS_BYTES, "imports: 0.4 GiB measured; approximate"),
    )


def _activation_note(settings: Settings, half: bool) -> str:
    tokens = f"{settings.micro_batch_size} × {settings.seq_len} tokens"
    return f"{tokens}, {'16-bit' if half else 'fp32'}" + (", checkpointed" if settings.activation_checkpointing
                                                          else "")


def _data_bytes(config: PeerConfig) -> int:
    """One piece (data.py) as its text while it is tokenized and as its int32 tokens, and the validation set, a share
    of one piece, as int64 (bytes tokenizer: one token per byte; a subword tokenizer: about one per four)."""
    data = config.data
    tokens_per_byte = 1.0 if data.tokenizer == BYTE_TOKENIZER else 0.25
    return int(data.piece_bytes * (1 + 4 * tokens_per_byte + data.val_fraction * (1 + 8 * tokens_per_byte)))


# ---- does it fit, and what would make it fit --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Fit:
    """The verdict for one device size: whether the plan fits, else the cheapest settings that do (or None)."""

    capacity_bytes: int
    fits: bool
    needed_bytes: int
    floor_bytes: int  # what no setting lowers: parameters, AdamW state and step, gradients, runtime
    advice: dict[str, object] | None = None  # settings to change (name → value); None: nothing fits
    advised_bytes: int = 0  # the device peak with the advice


def fit(plan: MemoryPlan, capacity_bytes: int, config: PeerConfig | None = None, peers: int = 4) -> Fit:
    """Whether `plan` fits a device of `capacity_bytes` (on CPU: device and host share it); if not, the cheapest
    change of precision, micro-batches, activation checkpointing and outer-state placement that does."""
    if capacity_bytes <= 0:
        raise ConfigError(f"device memory must be > 0, got {capacity_bytes} bytes")
    needed = _needed(plan)
    floor = sum(model_state_bytes(plan.shape).values()) + plan.line("runtime").device_bytes + plan.line(
        "AdamW step").device_bytes
    if needed <= capacity_bytes:
        return Fit(capacity_bytes, True, needed, floor)
    best: tuple[float, int, Settings, int] | None = None
    for candidate in _candidates(plan.settings, plan.device):
        peak = _needed(plan_memory(plan.shape, candidate, plan.device, config, peers))
        if peak <= capacity_bytes:
            cost = sum(CHANGE_COST[name] for name in plan.settings.changes(candidate))
            key = (cost, candidate.micro_batches, candidate, peak)
            if best is None or key[:2] < best[:2]:
                best = key
    if best is None:
        return Fit(capacity_bytes, False, needed, floor)
    return Fit(capacity_bytes, False, needed, floor, plan.settings.changes(best[2]), best[3])


def _needed(plan: MemoryPlan) -> int:
    return plan.total_bytes if plan.device == "cpu" else plan.device_bytes


def _candidates(settings: Settings, device: str) -> list[Settings]:
    """Every combination the advice may choose from (micro-batches: the divisors of the batch, upwards)."""
    divisors = [m for m in range(settings.micro_batches, settings.batch_size + 1) if settings.batch_size % m == 0]
    precisions = {settings.precision, "bf16"} if not settings.autocast_16(device) else {settings.precision}
    places = {settings.state_device} | ({"host"} if device != "cpu" else set())
    return [dataclasses.replace(settings, precision=p, micro_batches=m, activation_checkpointing=c, state_device=s)
            for p in sorted(precisions) for m in divisors for c in sorted({settings.activation_checkpointing, True})
            for s in sorted(places)]

