"""Peak host memory of loading a pretrained checkpoint into a stage-3 model on 2 ranks:
built on the meta device and loaded by shards (each rank reads its own ranges) against
the stock way (`from_pretrained` on every rank, then the strategy shards it).

    python benchmarks/pretrained_memory.py            # 0.94B Llama, 1.9 GB bf16 checkpoint
    python benchmarks/pretrained_memory.py --layers 2 # smaller, quicker

Each way runs in fresh processes (torchrun); peaks are the kernel's VmHWM, reset between
phases. "Loading's rise": ours, the peak while `load_pretrained` runs over the RSS of the
engine already built (its shard of the parameters, and of the gradients, which a stage-3
engine holds from the start: 2 x model / world); stock, the peak of `from_pretrained`
over the RSS before it. Against the bound 1.1 x (model bytes / world + largest tensor).
"Peak rise, all": from before building the model to the end, engine included.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 1 << 20


def _config(layers: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5504,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    """The peak RSS since the last `_reset_peak()` (VmHWM)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets the peak RSS to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def write_checkpoint(path: Path, layers: int) -> dict:
    import torch
    import transformers

    if not (path / "model.safetensors.index.json").exists():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(_config(layers)).to(torch.bfloat16)
        model.save_pretrained(path, max_shard_size="500MB")  # bf16, as Hub checkpoints are
        del model
    from safetensors import safe_open

    sizes = []
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                sizes.append(f.get_slice(key).get_shape())
    numels = [int(torch.tensor(s).prod()) if s else 1 for s in sizes]
    # The model as the ranks hold it: fp32 (the checkpoint is half of it, in bf16).
    return {
        "checkpoint_bytes": 2 * sum(numels),
        "model_bytes": 4 * sum(numels),
        "largest_tensor_bytes": 4 * max(numels),
    }


def worker(way: str, path: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    from zero_strategy import ZeroConfig, ZeroEngine, init_on_meta

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = transformers.AutoConfig.from_pretrained(path)
    dist.barrier()
    _reset_peak()
    before = _rss()
    if way == "ours":  # built on meta, sharded, then each rank reads its ranges
        with init_on_meta():
            model = transformers.LlamaForCausalLM(config)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=3))
        built = _rss()
        _reset_peak()
        read = engine.load_pretrained(path)["elements_read"]
        load_peak = _peak()
    else:  # the whole model on every rank, then sharded
        model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
        load_peak = _peak()
        read = sum(p.numel() for p in model.parameters())  # every rank reads everything
        engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=3))
        built = _rss()
    held = engine.memory_report()
    figures = {
        "rank": rank,
        "rss_before": before,
        "rss_engine_built": built,
        "load_peak": load_peak,
        # ours: what loading adds on top of the sharded engine; stock: the load itself
        "load_rise": load_peak - (built if way == "ours" else before),
        "peak": max(load_peak, _peak()),
        "rss_after": _rss(),
        "elements_read": read,
        "engine_state": held["total"],
        "held": held,
    }
    figures["rise"] = figures["peak"] - before
    Path(out, f"{way}_{rank}.json").write_text(json.dumps(figures))
    engine.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "zero_pretrained"))
    parser.add_argument("--worker", nargs=3, metavar=("WAY", "PATH", "OUT"))
    args = parser.parse_args()
    if args.worker:
        return worker(*args.worker)
    path = Path(args.dir) / f"llama_{args.layers}l"
    sizes = write_checkpoint(path, args.layers)
    world = 2
    bound = 1.1 * (sizes["model_bytes"] / world + sizes["largest_tensor_bytes"])
    with tempfile.TemporaryDirectory() as out:
        for way in ("ours", "stock"):
            launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}"]
            subprocess.run(
                [*launch, __file__, "--worker", way, str(path), out],
                check=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        rows = {
            way: [json.loads(Path(out, f"{way}_{r}.json").read_text()) for r in range(world)]
            for way in ("ours", "stock")
        }
    print(
        f"checkpoint {path}: {sizes['checkpoint_bytes'] / MiB:.0f} MiB bf16, model "
        f"{sizes['model_bytes'] / MiB:.0f} MiB fp32, largest tensor "
        f"{sizes['largest_tensor_bytes'] / MiB:.0f} MiB; {world} ranks; bound 1.1 x "
        f"(model / world + largest) = {bound / MiB:.0f} MiB"
    )
    print(
        "| way | rank | RSS before (MiB) | engine state (MiB) | loading's rise (MiB) | "
        "/ bound | peak rise, all (MiB) | elements read |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for way, ranks in rows.items():
        for r in ranks:
            print(
                f"| {way} | {r['rank']} | {r['rss_before'] / MiB:.0f} | "
                f"{r['engine_state'] / MiB:.0f} | {r['load_rise'] / MiB:.0f} | "
                f"{r['load_rise'] / bound:.2f} | {r['rise'] / MiB:.0f} | {r['elements_read']:,} |"
            )
    print(json.dumps({"sizes": sizes, "bound": bound, "rows": rows}))


if __name__ == "__main__":
    main()
