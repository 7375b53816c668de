"""`p2ptrain plan` and `p2ptrain peer --plan`: a peer's memory plan (memory/plan.py) for its model and one or
more device sizes, as a table or JSON, with what fits and the settings that would make it fit."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from p2ptrain.config import PeerConfig
from p2ptrain.errors import UserError
from p2ptrain.memory.plan import GIB, MIB, MemoryPlan, Settings, activation_bytes, fit, plan_memory, settings_of
from p2ptrain.memory.shape import ModelShape, model_shape
from p2ptrain.models import PRESETS


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What to plan for: device sizes in GiB (empty: this machine's device), host size, peers of a round."""

    gpu_gb: tuple[float, ...] = ()  # GPUs to plan for (their memory as printed on the card: GiB)
    device: str = "auto"  # without gpu_gb: this machine's device (auto | cpu | cuda | mps)
    host_gb: float | None = None  # host memory; None: this machine's
    peers: int = 4  # peers in an all-reduce round (diloco; factored's Mix2 groups are sync.mix2_group_size)

    def __post_init__(self) -> None:
        for flag, gb in [("--gpu-gb", gb) for gb in self.gpu_gb] + [("--host-gb", self.host_gb)]:
            if gb is not None and not 0 < gb < 2**20:
                raise UserError(f"{flag} must be a memory size in GB (GiB) above 0, got {gb:g}")
        if self.peers < 1:
            raise UserError(f"--peers must be >= 1, got {self.peers}")


def vocab_size_for(config: PeerConfig) -> int:
    """The tokenizer's vocabulary, which a preset's embeddings follow (other models bring their own)."""
    from p2ptrain.data import BYTE_TOKENIZER, build_tokenizer

    tokenizer = config.data.tokenizer
    if config.model.name in PRESETS and tokenizer != BYTE_TOKENIZER and not Path(tokenizer).expanduser().exists():
        raise UserError(f"the plan of a preset needs its tokenizer's vocabulary without downloading: make "
                        f"data.tokenizer {tokenizer!r} a local directory")
    return build_tokenizer(config.data).vocab_size


def local_device(name: str) -> tuple[str, int]:
    """(device type, memory in bytes) of this machine's `name` device; CPU and MPS: the physical memory."""
    from p2ptrain.device import resolve_device

    device = resolve_device(name).type
    if device == "cuda":
        import torch

        return device, int(torch.cuda.get_device_properties(0).total_memory)
    return device, host_memory_bytes()


def host_memory_bytes() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def plan_report(config: PeerConfig, settings: Settings, request: PlanRequest) -> dict[str, Any]:
    """The plan for every device size of `request`, as one JSON-able dict (what `--json` prints)."""
    shape = model_shape(config.model, vocab_size_for(config))
    if request.gpu_gb:
        devices = [("cuda", int(gb * GIB)) for gb in request.gpu_gb]
    else:
        devices = [local_device(request.device)]
    host = int(request.host_gb * GIB) if request.host_gb is not None else host_memory_bytes()
    plans = {kind: plan_memory(shape, settings, kind, config, request.peers) for kind in {k for k, _ in devices}}
    fits = [(kind, fit(plans[kind], capacity, config, request.peers)) for kind, capacity in devices]
    return {
        "model": dataclasses.asdict(shape),
        "settings": dataclasses.asdict(settings),
        "sync": {"mode": config.sync.mode, "peers": request.peers, "gossip_peers": config.sync.gossip_peers},
        "plans": {kind: _plan_dict(plan) for kind, plan in plans.items()},
        "activations": {kind: activation_grid(shape, settings, kind) for kind in plans},
        "fits": [dict(dataclasses.asdict(f), device=kind) for kind, f in fits],
        "host": {"capacity_bytes": host, "needed_bytes": max(p.host_bytes for p in plans.values()),
                 "fits": max(p.host_bytes for p in plans.values()) <= host},
    }


def _plan_dict(plan: MemoryPlan) -> dict[str, Any]:
    return {"lines": [dataclasses.asdict(line) for line in plan.lines], "training_bytes": plan.training_bytes,
            "device_bytes": plan.device_bytes, "host_bytes": plan.host_bytes}


def activation_grid(shape: ModelShape, settings: Settings, device: str) -> dict[str, dict[str, int]]:
    """Activation bytes of one micro-batch by precision (fp32, 16-bit) and checkpointing (off, on)."""
    return {precision: {ckpt: activation_bytes(shape, settings, device, checkpointing=ckpt == "checkpointing",
                                               half=precision == "16-bit")
                        for ckpt in ("no checkpointing", "checkpointing")} for precision in ("fp32", "16-bit")}


# ---- the table ---------------------------------------------------------------------------------------------------
def size(nbytes: float) -> str:
    if nbytes == 0:
        return "-"
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


def render(report: dict[str, Any]) -> str:
    """The report as a readable table (one plan per device type, then the verdict for each device size)."""
    shape, s = report["model"], report["settings"]
    out = [f"model {shape['name']} ({shape['architecture']}): {shape['parameters']:,} parameters, "
           f"{shape['layers']} layers, hidden {shape['hidden']}, MLP {shape['intermediate']}, vocab {shape['vocab']}",
           f"batch {s['batch_size']} × {s['seq_len']} tokens in {s['micro_batches']} micro-batch(es), precision "
           f"{s['precision']} (auto: bf16 on CUDA, fp32 elsewhere), checkpointing "
           f"{'on' if s['activation_checkpointing'] else 'off'}, outer state {s['state_device']}, sync "
           f"{report['sync']['mode']} ({_sync_scope(report['sync'])})"]
    for kind, plan in report["plans"].items():
        out += ["", f"{'on ' + kind:<42}{'device':>11}{'host':>11}  note"]
        out += [f"  {line['what']:<40}{size(line['device_bytes']):>11}{size(line['host_bytes']):>11}  {line['note']}"
                for line in plan["lines"]]
        out.append(f"  {'peak (the lines do not all coincide)':<40}{size(plan['device_bytes']):>11}"
                   f"{size(plan['host_bytes']):>11}" + ("  one memory on CPU: " + size(
                       plan['device_bytes'] + plan['host_bytes']) if kind == "cpu" else ""))
        grid = report["activations"][kind]
        out.append(f"  activations of one micro-batch{'':<11}{'fp32':>11}{'16-bit':>11}")
        out += [f"    {ckpt:<38}{size(grid['fp32'][ckpt]):>11}{size(grid['16-bit'][ckpt]):>11}"
                for ckpt in ("no checkpointing", "checkpointing")]
    out.append("")
    out += [verdict(f) for f in report["fits"]]
    host = report["host"]
    if set(report["plans"]) == {"cpu"}:  # the device is the host: its verdict counted both
        return "\n".join(out)
    out.append(f"host {size(host['capacity_bytes'])}: " + (
        "fits" if host["fits"] else f"does NOT fit ({size(host['needed_bytes'])} needed): fewer --peers per round "
                                    f"or a smaller sync.grad_codec (fp16) lower the sync buffers"))
    return "\n".join(out)


def _sync_scope(sync: dict[str, Any]) -> str:
    """Whom a peer's round buffers are for: GASLoC mixes with its partners whatever the swarm's size."""
    if sync["mode"] == "gasloc":
        return f"{sync['gossip_peers']} partner(s) a round"
    return f"{sync['peers']} peers per round"


def verdict(f: dict[str, Any]) -> str:
    where = f"{f['device']} {size(f['capacity_bytes'])}"
    if f["fits"]:
        return f"{where}: fits ({size(f['needed_bytes'])} at the peak)"
    if f["advice"] is None:
        return (f"{where}: does NOT fit ({size(f['needed_bytes'])}), not even with bf16, activation checkpointing, "
                f"one sample per micro-batch and the outer state on the host (parameters, AdamW, its step and "
                f"gradients in fp32 and the runtime alone: {size(f['floor_bytes'])})")
    changes = ", ".join(f"{_key(k)}: {str(v).lower()}" for k, v in f["advice"].items())
    return f"{where}: does NOT fit ({size(f['needed_bytes'])}); fits with {changes} ({size(f['advised_bytes'])})"


def _key(name: str) -> str:
    return f"outer.{name}" if name == "state_device" else f"inner.{name}"


def local_misfit(config: PeerConfig) -> str | None:
    """None when this peer's plan fits its device here (or cannot be made without a download); else the verdict,
    with the settings that would make it fit, as `plan` prints it."""
    try:
        report = plan_report(config, settings_of(config), PlanRequest(device=config.run.device))
    except UserError:  # a hub model or tokenizer not cached yet: the peer downloads it, the plan never does
        return None
    misfits = [f for f in report["fits"] if not f["fits"]]
    return verdict(misfits[0]) if misfits else None


def plan_text(config: PeerConfig, settings: Settings, request: PlanRequest, as_json: bool = False) -> str:
    report = plan_report(config, settings, request)
    return json.dumps(report, indent=2) if as_json else render(report)


def override_settings(settings: Settings, values: dict[str, Any]) -> Settings:
    """`settings` with the flags that were given (None: keep the config's)."""
    return dataclasses.replace(settings, **{k: v for k, v in values.items() if v is not None})

