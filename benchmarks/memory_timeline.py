"""One training step's memory against time, by kind: this engine's stage 3 beside FSDP2.

    python benchmarks/memory_timeline.py --size big --png docs/memory_timeline.png
    python benchmarks/memory_timeline.py --size tiny        # a quick smoke run

Each implementation runs on `--nproc` ranks (2 by default; gloo, one thread each) for `--warmup` steps, then one
recorded step. Rank 0 records:
- RSS, sampled every 2 ms;
- activations: the bytes autograd saved for backward and still holds (a saved-tensor hook,
  each storage once, parameters excluded);
- for this engine, every kind of `memory_report()` at each change
  (`reset_memory_peaks(record_timeline=True)`): model state, gathered units, gradient
  buffers in flight, pooled memory;
- the phase boundaries (forward, backward, step).
FSDP2 on CPU has no allocator statistics, so beside its RSS only its model state (constant)
and its activations are drawn. What RSS holds above the stacked kinds is the process
itself (torch, gloo: its RSS before the model was built, drawn as "process") and
allocator slack (freed memory the allocator has not returned).

Prints, for each implementation, the breakdown at the moment of its peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import weakref
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

MiB = 2**20
KINDS = ("model_state", "gathered_parameters", "comm_buffers", "pooled", "activations")


class SavedActivations:
    """Bytes autograd holds for backward, over time: each saved tensor's storage is
    counted once while any saved tensor on it is alive; parameters are left out."""

    def __init__(self, model) -> None:
        self.model = model
        self.events: list[tuple[float, int]] = []
        self._live: dict[int, list] = {}  # storage pointer -> [refcount, nbytes]
        self._bytes = 0

    def _param_storages(self) -> set[int]:
        out = set()
        for p in self.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            out.add(local.untyped_storage().data_ptr())
        return out

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[key]
            self._bytes -= entry[1]
            self.events.append((time.perf_counter(), self._bytes))

    def pack(self, tensor):
        import torch

        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return tensor
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self._param_storages():
            return tensor
        entry = self._live.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self._bytes += entry[1]
            self.events.append((time.perf_counter(), self._bytes))
        entry[0] += 1
        holder = _Holder(tensor)
        weakref.finalize(holder, self._release, key)
        return holder

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _Holder) else packed


class _Holder:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor) -> None:
        self.tensor = tensor


def worker(args) -> None:
    import psutil
    import torch

    from benchmarks.engine_worker import SIZES, PeakRSS, build, init_ranks
    from examples.gpt import GPT

    rank = init_ranks(args.impl)
    process_rss = psutil.Process().memory_info().rss
    cfg = SIZES[args.size]
    torch.manual_seed(0)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    forward, backward, step, state_bytes = build(args.impl, model)
    g = torch.Generator().manual_seed(rank)
    data = torch.randint(cfg.vocab_size, (args.batch, cfg.block_size + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    for _ in range(args.warmup):
        backward(forward(x, y))
        step()
    if args.trim:  # does handing freed heap memory back before the step change its peak?
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    model_state = state_bytes()
    engine = forward if args.impl.startswith("zero") else None
    saved = SavedActivations(model)
    torch.distributed.barrier()
    with PeakRSS(period=0.002, keep=True) as rss:
        if engine is not None:
            engine.reset_memory_peaks(record_timeline=True)
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            loss = forward(x, y)
        t1 = time.perf_counter()
        backward(loss)
        del loss
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        time.sleep(0.05)
    result = {
        "impl": args.impl,
        "size": args.size,
        "params": n_params,
        "t0": t0,
        "phases": {"forward": [t0, t1], "backward": [t1, t2], "step": [t2, t3]},
        "rss": rss.samples,
        "process_rss": process_rss,
        "model_state": model_state,
        "activations": saved.events,
        "engine": [] if engine is None else engine.memory_timeline(),
        "peaks": {} if engine is None else engine.memory_report(),
        "world": torch.distributed.get_world_size(),
        "unit_bytes": [] if engine is None else [u.layout.padded_numel * 4 for u in engine.units],
    }
    Path(args.out, f"{args.impl}.rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _at(events: list, t: float, default=0):
    """The last event value at or before time t."""
    value = default
    for when, v in events:
        if when > t:
            break
        value = v
    return value


def kinds_at(res: dict, t: float) -> dict[str, int]:
    out = {"activations": _at(res["activations"], t)}
    if res["engine"]:
        held = _at(res["engine"], t, res["engine"][0][1])
        out["model_state"] = sum(
            held[k] for k in ("parameters", "master_params", "gradients", "optimizer_state")
        )
        for k in ("gathered_parameters", "comm_buffers", "pooled"):
            out[k] = held[k]
    else:
        out["model_state"] = res["model_state"]
    return out


def breakdown_at_peak(res: dict) -> dict[str, float]:
    t_peak, peak = max(res["rss"], key=lambda s: s[1])
    kinds = kinds_at(res, t_peak)
    counted = sum(kinds.values()) + res["process_rss"]
    phase = next((p for p, (a, b) in res["phases"].items() if a <= t_peak <= b), "after")
    return {
        "phase": phase,
        "peak_rss": peak / MiB,
        "process": res["process_rss"] / MiB,
        **{k: v / MiB for k, v in kinds.items()},
        "slack": (peak - counted) / MiB,
    }


def tensor_peak(res: dict) -> dict[str, float]:
    """This engine: the most tensor bytes held at once (its own kinds plus activations,
    at every recorded change), against the target of issue 19: the model-state formula
    plus the two largest units gathered plus the activations' peak, within 5%."""
    events = sorted(
        [(t, "engine", held) for t, held in res["engine"]]
        + [(t, "activations", b) for t, b in res["activations"]],
        key=lambda e: e[0],
    )
    held, act, best = res["engine"][0][1], 0, 0
    for _, kind, value in events:
        if kind == "engine":
            held = value
        else:
            act = value
        best = max(best, held["total"] + act)
    formula = 16 * res["params"] / res["world"]
    units = sorted(res["unit_bytes"], reverse=True)[:2]
    act_peak = max((b for _, b in res["activations"]), default=0)
    budget = formula + sum(units) + act_peak
    return {
        "peak_tensor_bytes": best / MiB,
        "formula": formula / MiB,
        "two_largest_units": sum(units) / MiB,
        "activations_peak": act_peak / MiB,
        "budget": budget / MiB,
        "ratio": best / budget,
    }


def plot(results: dict[str, dict], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), sharey=True)
    axes = list(axes) if len(results) > 1 else [axes]
    colors = dict(
        process="#bbbbbb",
        model_state="#4c72b0",
        gathered_parameters="#55a868",
        comm_buffers="#c44e52",
        pooled="#8172b2",
        activations="#ccb974",
    )
    for ax, (impl, res) in zip(axes, results.items()):
        t0 = res["t0"]
        times = [t for t, _ in res["rss"]]
        layers = {"process": [res["process_rss"] / MiB] * len(times)}
        per_time = [kinds_at(res, t) for t in times]
        for k in KINDS:
            if k in per_time[0]:
                layers[k] = [p[k] / MiB for p in per_time]
        xs = [t - t0 for t in times]
        ax.stackplot(
            xs,
            *layers.values(),
            labels=list(layers),
            colors=[colors[k] for k in layers],
            alpha=0.85,
        )
        ax.plot(xs, [r / MiB for _, r in res["rss"]], color="black", lw=1.2, label="RSS")
        for name, (a, b) in res["phases"].items():
            ax.axvline(a - t0, color="grey", ls=":", lw=0.8)
            ax.text((a + b) / 2 - t0, 0.02, name, transform=ax.get_xaxis_transform(), ha="center")
        title = f"this engine, {impl}" if impl.startswith("zero") else impl.upper()
        ax.set_title(
            f"{title}: {res['params'] / 1e6:.0f}M params, rank 0 of {res['world']}", fontsize=10
        )
        ax.set_xlabel("seconds into the step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("MiB")
    axes[0].legend(loc="center right", fontsize=8)  # the panel with every kind
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impl", default="")
    parser.add_argument("--impls", default="zero3,fsdp2")
    parser.add_argument("--size", default="big")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (one core each)")
    parser.add_argument(
        "--trim", action="store_true", help="glibc's malloc_trim(0) before the recorded step"
    )
    parser.add_argument("--out", default="")
    parser.add_argument("--png", default="")
    parser.add_argument("--json", default="", help="write the recorded figures here")
    parser.add_argument("--from-json", default="", help="print and plot a recorded run")
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    from benchmarks.launch import torchrun

    results = {}
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
    with tempfile.TemporaryDirectory() as out:
        for impl in [] if args.from_json else args.impls.split(","):
            proc = torchrun(
                __file__,
                "--impl",
                impl,
                "--size",
                args.size,
                "--batch",
                str(args.batch),
                "--warmup",
                str(args.warmup),
                *(["--trim"] if args.trim else []),
                "--out",
                out,
                nproc=args.nproc,
                check=False,
            )
            if proc.returncode:
                print(f"{impl}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            results[impl] = json.loads(Path(out, f"{impl}.rank0.json").read_text())
            if args.json:  # kept as each run ends: a later failure loses nothing
                Path(args.json).write_text(json.dumps(results))
    for impl, res in results.items():
        b = breakdown_at_peak(res)
        print(f"\n{impl} ({res['params'] / 1e6:.0f}M params): peak RSS at {b['phase']}")
        for k, v in b.items():
            if k != "phase":
                print(f"  {k:20s} {v:9.1f} MiB")
        if res["peaks"]:
            peaks = {k: v / MiB for k, v in res["peaks"].items() if k.startswith("peak_")}
            print(
                "  engine peaks (MiB): " + ", ".join(f"{k[5:]} {v:.1f}" for k, v in peaks.items())
            )
            units = sorted(res["unit_bytes"], reverse=True)
            block = min(units)
            rest = peaks["peak_gathered_parameters"] * MiB - units[0]
            print(
                f"  gathered at once at most: the largest unit ({units[0] / MiB:.1f} MiB) and "
                f"{rest / block:.1f} units of {block / MiB:.1f} MiB"
            )
            target = tensor_peak(res)
            print(
                "  tensor bytes at their peak {peak_tensor_bytes:.1f} MiB against model state "
                "{formula:.1f} + two largest units {two_largest_units:.1f} + activations "
                "{activations_peak:.1f} = {budget:.1f} MiB: {ratio:.3f}x".format(**target)
            )
    if args.png and results:
        plot(results, args.png)
        print(f"wrote {args.png}")
    if args.json:
        Path(args.json).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
