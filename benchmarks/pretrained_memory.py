"""Peak host memory of loading a pretrained checkpoint into a stage-3 model on 2 ranks:
built on the meta device and loaded by shards (each rank reads its own ranges) against
the stock way (`from_pretrained` on every rank, then the strategy shards it).

    python benchmarks/pretrained_memory.py            # ~2.1 GB fp32 Llama, written once
    python benchmarks/pretrained_memory.py --layers 2 # smaller, quicker

Each way runs in fresh processes (torchrun), so each rank's peak RSS (ru_maxrss) is its
own. The figure is the rise of the peak over the RSS just before loading, against the
bound 1.1 x (model bytes / world + largest tensor).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_checkpoint(path: Path, layers: int) -> dict:
    import torch
    import transformers

    if not (path / "model.safetensors.index.json").exists():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(_config(layers))
        model.save_pretrained(path, max_shard_size="500MB")
        del model
    from safetensors import safe_open

    sizes = []
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                sizes.append(f.get_slice(key).get_shape())
    numels = [int(torch.tensor(s).prod()) if s else 1 for s in sizes]
    return {"model_bytes": 4 * sum(numels), "largest_tensor_bytes": 4 * max(numels)}


def worker(way: str, path: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    from zero_strategy import ZeroConfig, ZeroEngine, init_on_meta

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    before = _rss()
    if way == "ours":
        with init_on_meta():
            model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(path))
        engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=3))
        read = engine.load_pretrained(path)["elements_read"]
    else:
        model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
        engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=3))
        read = sum(p.numel() for p in model.parameters())  # every rank reads everything
    peak = _peak()
    figures = {
        "rank": rank,
        "rss_before": before,
        "peak": peak,
        "rise": peak - before,
        "rss_after": _rss(),
        "elements_read": read,
        "held": engine.memory_report()["total"],
    }
    Path(out, f"{way}_{rank}.json").write_text(json.dumps(figures))
    engine.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
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
        f"checkpoint {path}: {sizes['model_bytes'] / MiB:.0f} MiB fp32, largest tensor "
        f"{sizes['largest_tensor_bytes'] / MiB:.0f} MiB; {world} ranks; bound 1.1 x "
        f"(model / world + largest) = {bound / MiB:.0f} MiB"
    )
    print(
        "| way | rank | RSS before (MiB) | peak (MiB) | rise (MiB) | rise / bound | elements read |"
    )
    print("|---|---|---|---|---|---|---|")
    for way, ranks in rows.items():
        for r in ranks:
            print(
                f"| {way} | {r['rank']} | {r['rss_before'] / MiB:.0f} | {r['peak'] / MiB:.0f} | "
                f"{r['rise'] / MiB:.0f} | {r['rise'] / bound:.2f} | {r['elements_read']:,} |"
            )
    print(json.dumps({"sizes": sizes, "bound": bound, "rows": rows}))


if __name__ == "__main__":
    main()
