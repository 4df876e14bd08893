"""What reading the model costs, by mechanism: the evidence for `.grad` and the
parameters' shapes at stages 2-3 (docs/architecture.md, "What user code reads").

Two parts, in one job:

1. **Padding**, computed from the layouts (no run): FSDP2's per-parameter dim-0 layout pads
   every parameter's first dimension to a multiple of the world size; this project's
   flat ranges pad each unit once, to a multiple of the world size.
2. **Reads after backward**, on 2 gloo ranks at 82M, each implementation in the same
   processes, turns alternating: DDP (plain `.grad`), FSDP2 per block (DTensor
   parameters and gradients: the candidate face) and ZeRO stage 3 (`ShardedGrad` over
   the flat shards). Timed: Lightning's `grad_norm` (one norm per parameter),
   `torch.nn.utils.clip_grad_norm_`, and one parameter's whole gradient (`.clone()`).
   For ours also the cost of putting the faces on `.grad` after each backward, and the
   largest transient memory a read took.

    python benchmarks/grad_face_bench.py [--size bench] [--turns 5]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.launch import torchrun  # noqa: E402


def dim0_padding(model, world: int) -> int:
    """Elements FSDP2's `fully_shard` pads: each parameter's dim 0 up to a multiple of
    `world` (a 0-d parameter becomes one element per rank)."""
    pad = 0
    for p in model.parameters():
        if p.dim() == 0:
            pad += world - 1
            continue
        rows = p.shape[0]
        pad += (math.ceil(rows / world) * world - rows) * (p.numel() // rows)
    return pad


def flat_padding(model, world: int) -> int:
    """Elements this project's flat layout pads at stage 3 on a GPT: one unit per block
    and the root unit for the rest, each padded once to a multiple of `world`
    (`UnitLayout.padded_numel`)."""
    sizes = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    sizes.append(sum(p.numel() for p in model.parameters()) - sum(sizes))
    return sum(math.ceil(n / world) * world - n for n in sizes)


def padding_rows(sizes: list[str], worlds: list[int]) -> list[dict]:

    from benchmarks import engine_worker as ew
    from examples.gpt import GPTConfig

    shapes = dict(ew.SIZES)
    # GPT-2 124M's own shapes: its vocabulary (50,257) is not a multiple of any world size.
    shapes["gpt2"] = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    rows = []
    for size in sizes:
        model, n = ew.make_model("zero3", shapes[size], meta=True)
        for world in worlds:
            rows.append(
                {
                    "size": size,
                    "params": n,
                    "world": world,
                    "dim0": dim0_padding(model, world),
                    "flat": flat_padding(model, world),
                }
            )
    return rows


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from lightning.pytorch.utilities import grad_norm

    from benchmarks import engine_worker as ew

    rank = ew.init_ranks("ddp")
    cfg = ew.SIZES[args.size]
    impls = ["ddp", "fsdp2", "zero3"]
    runs, modules = {}, {}
    for impl in impls:
        model, n_params = ew.make_model(impl, cfg)
        runs[impl] = ew.build(impl, model)
        modules[impl] = model
    data = torch.randint(
        cfg.vocab_size,
        (args.batch, cfg.block_size + 1),
        generator=torch.Generator().manual_seed(rank),
    )
    x, y = data[:, :-1], data[:, 1:]
    times = {impl: {"grad_norm": [], "clip": [], "clone": [], "backward": []} for impl in impls}
    zero = runs["zero3"][0]
    failures: dict[str, str] = {}
    for turn in range(args.turns + 1):
        order = impls if turn % 2 == 0 else impls[::-1]
        for impl in order:
            forward, backward, step, _ = runs[impl]
            model = modules[impl]
            dist.barrier()
            loss = forward(x, y)
            t0 = time.perf_counter()
            backward(loss)
            if impl == "zero3":
                zero.reducer.wait()
            t1 = time.perf_counter()
            try:
                norms = grad_norm(model, norm_type=2)
            except RuntimeError as e:  # FSDP2: its DTensor norms do not stack into a tensor
                failures[impl] = str(e).splitlines()[0]
                norms = {n: p.grad.norm().full_tensor() for n, p in model.named_parameters()}
            t2 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            t3 = time.perf_counter()
            whole = model.blocks[0].fc.weight.grad.clone()
            if hasattr(whole, "full_tensor"):
                whole = whole.full_tensor()
            t4 = time.perf_counter()
            assert len(norms) > 10 and whole.numel() > 0
            step()
            if turn:
                for key, value in zip(times[impl], (t2 - t1, t3 - t2, t4 - t3, t1 - t0)):
                    times[impl][key].append(value)
    # the faces' own cost: put on and taken off, as each synchronised backward does
    from zero_strategy.model_view.grad_face import GradFaces

    faces = GradFaces(zero.units, zero.grad_reads)
    t0 = time.perf_counter()
    for _ in range(20):
        faces.show()
        faces.hide()
    show = (time.perf_counter() - t0) / 20
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    if rank == 0:
        result = {
            "params": n_params,
            "ranks": dist.get_world_size(),
            "times": {
                impl: {
                    key: statistics.median(
                        max(r[impl][key][k] for r in everyone) for k in range(args.turns)
                    )
                    for key in times[impl]
                }
                for impl in impls
            },
            "show_hide_s": show,
            "grad_norm_failures": failures,
            "largest_read_bytes": zero.grad_reads.largest_read_bytes,
            "fc_weight_grad_bytes": modules["ddp"].blocks[0].fc.weight.numel() * 4,
            "n_params_tensors": len(list(modules["ddp"].parameters())),
        }
        Path(args.out).write_text(json.dumps(result))
    zero.close()
    dist.barrier()
    dist.destroy_process_group()


def report(reads: dict, padding: list[dict], size: str) -> str:
    lines = [
        "## Padding of the two layouts (elements; no run)",
        "",
        "| model | world | FSDP2 dim-0 per parameter | flat ranges per unit |",
        "|---|---|---|---|",
    ]
    for row in padding:
        lines.append(
            f"| {row['size']} ({row['params'] / 1e6:.0f}M) | {row['world']} | "
            f"{row['dim0']:,} ({100 * row['dim0'] / row['params']:.3f}%) | "
            f"{row['flat']:,} ({100 * row['flat'] / row['params']:.4f}%) |"
        )
    t = reads["times"]
    lines += [
        "",
        f"## Reads after backward, GPT {reads['params'] / 1e6:.0f}M ({size}), "
        f"{reads['ranks']} gloo ranks, {reads['n_params_tensors']} parameter tensors "
        "(median over turns, slower rank; ms)",
        "",
        "| impl | backward | Lightning grad_norm | clip_grad_norm_ | one weight's .grad.clone() |",
        "|---|---|---|---|---|",
    ]
    for impl, label in (
        ("ddp", "DDP"),
        ("fsdp2", "FSDP2 (DTensor)"),
        ("zero3", "zero3 (ShardedGrad)"),
    ):
        row = t[impl]
        lines.append(
            f"| {label} | {row['backward'] * 1e3:.0f} | {row['grad_norm'] * 1e3:.1f} | "
            f"{row['clip'] * 1e3:.1f} | {row['clone'] * 1e3:.1f} |"
        )
    for impl, error in reads["grad_norm_failures"].items():
        lines.append(
            f"\n{impl}: Lightning's `grad_norm` fails ({error!r}); timed instead: "
            "`{n: p.grad.norm().full_tensor() for n, p in model.named_parameters()}`."
        )
    lines += [
        "",
        f"- zero3: putting the faces on `.grad` and taking them off: "
        f"{reads['show_hide_s'] * 1e3:.2f} ms per backward.",
        f"- zero3: the largest memory a read took: {reads['largest_read_bytes']:,} bytes "
        f"(the `.clone()` of a weight whose gradient is {reads['fc_weight_grad_bytes']:,} bytes); "
        "norms and clipping take none.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="bench")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--output", default="", help="also write the report here")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    import tempfile

    padding = padding_rows(["bench", "big", "gpt2"], [2, 8, 64])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "reads.json"
        extra = ["--size", args.size, "--batch", str(args.batch), "--turns", str(args.turns)]
        run = torchrun(__file__, "--worker", "--out", str(out), *extra, nproc=2, check=False)
        if run.returncode:
            sys.exit(f"the ranks failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
        reads = json.loads(out.read_text())
    text = report(reads, padding, args.size)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
