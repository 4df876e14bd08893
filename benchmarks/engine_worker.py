"""One training run of one implementation on one rank; writes a JSON line of figures.

Launched by `benchmarks/engine_bench.py` through torchrun; not meant to be run by hand.
Implementations: ddp, fsdp2, ds1/ds2/ds3 (DeepSpeed ZeRO, DS_ACCELERATOR=cpu), zero1/2/3,
and zero3-reuse: stage 3 with DeepSpeed's default reuse distance (1e9 elements), which keeps
every unit gathered from forward into backward, as ds3 does by default. ds3-lean is
DeepSpeed ZeRO-3 built inside zero.Init, with smaller buckets and live-parameter limits
(`DEEPSPEED_LEAN`), for models that barely fit. zero3-bf16 and
fsdp2-bf16 compute in bf16 with fp32 masters (`compute_dtype="bf16"`; FSDP2's
`MixedPrecisionPolicy(param_dtype=bf16)`), gradients reduced in bf16 by both. A
"-unchecked" suffix turns stage 3's module-order check off (`verify_module_order=False`),
to measure what the check costs.
Every implementation trains the same GPT on the same batches with AdamW and global-norm
clipping at 1.0, so the step does the same work everywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.gpt import GPT, GPTConfig

# DeepSpeed's default stage3_max_reuse_distance (deepspeed/runtime/zero/config.py).
DEEPSPEED_REUSE_DISTANCE = 1_000_000_000
# ds3-lean: DeepSpeed ZeRO-3 tuned for a model that barely fits, as its docs advise when
# memory is short: the model built inside zero.Init, buckets of 5e7 elements instead of 5e8
# (the fp32 reduce bucket alone is 1.9 GiB per rank by default), and at most 1e8 parameters
# live or kept for reuse.
DEEPSPEED_LEAN = {
    "reduce_bucket_size": 50_000_000,
    "allgather_bucket_size": 50_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 100_000_000,
    "stage3_max_reuse_distance": 100_000_000,
}

SIZES = {
    # ~730M parameters: 24 layers, d=1536, vocab 16384, seq 128, untied head; run at
    # batch 1, where DDP's replicated model state (23 GB for two ranks) cannot fit here.
    "big": GPTConfig(
        vocab_size=16384, block_size=128, n_layer=24, n_head=12, n_embd=1536, tie_embeddings=False
    ),
    # ~82M parameters: 8 layers, d=768, vocab 16384, seq 128, untied head.
    "bench": GPTConfig(
        vocab_size=16384, block_size=128, n_layer=8, n_head=12, n_embd=768, tie_embeddings=False
    ),
    # The moonshot of benchmarks/offload_bench.py: d=2560, its layer count set at run time
    # from this machine's RAM (--layers), built on the meta device.
    "moon": GPTConfig(
        vocab_size=16384, block_size=128, n_layer=24, n_head=20, n_embd=2560, tie_embeddings=False
    ),
    "small": GPTConfig(
        vocab_size=8192, block_size=128, n_layer=4, n_head=8, n_embd=512, tie_embeddings=False
    ),
    "tiny": GPTConfig(
        vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64, tie_embeddings=False
    ),
}
CLIP = 1.0
LR = 1e-4
# Tensor-parallel rows ("-tp2": dp x tp 2): a Hugging Face Llama of the same width and
# depth as the GPT (GPT's fused qkv projection cannot be split by head), with the
# standard plan: attention q/k/v and MLP gate/up column-wise, o and down row-wise.
TENSOR_PARALLEL = 2
LLAMA_SIZES = {
    "bench": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, heads=12),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, heads=2),
}


class PeakRSS:
    """Samples this process's RSS every `period` seconds while running; keeps the peak,
    and with `keep` every (time.perf_counter(), rss) sample."""

    def __init__(self, period: float = 0.005, keep: bool = False) -> None:
        self.peak = 0
        self.samples: list[tuple[float, int]] = []
        self._period = period
        self._keep = keep
        self._stop = threading.Event()
        self._proc = psutil.Process()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = self._proc.memory_info().rss
            self.peak = max(self.peak, rss)
            if self._keep:
                self.samples.append((time.perf_counter(), rss))
            time.sleep(self._period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.is_meta:
            continue
        if hasattr(t, "to_local"):  # DTensor
            t = t.to_local()
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def reachable_tensors(obj, depth: int = 3):
    """Tensors reachable from an object's attributes (lists, dicts, nested objects)."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth == 0:
        return
    if isinstance(obj, dict):
        for v in obj.values():
            yield from reachable_tensors(v, depth - 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from reachable_tensors(v, depth - 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        for name, v in vars(obj).items():
            # DeepSpeed ZeRO-3 preallocates a 5e8-element fp32 reduce bucket (1.9 GiB of
            # address space, mostly never touched): left out here, its touched pages show
            # in the peak RSS column.
            if "ipg" not in name:
                yield from reachable_tensors(v, depth - 1)


def clip_over_meshes(params: list[torch.Tensor], max_norm: float) -> None:
    """Global-norm clipping for DTensors on several meshes (FSDP2 + tensor parallel: the
    plan's parameters on the 2-D mesh, the rest on the data mesh), which torch's
    clip_grad_norm_ refuses: each mesh's norm, then their total, as torchtitan does."""
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p)
    squares = [
        torch.nn.utils.get_total_norm([p.grad for p in ps], 2.0).full_tensor() ** 2
        for ps in by_mesh.values()
    ]
    total = torch.stack(squares).sum().sqrt()
    for ps in by_mesh.values():  # one mesh at a time: foreach ops refuse mixed meshes
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)


def plain_torch_step_and_state(model: torch.nn.Module, meshes: int = 1):
    """DDP and FSDP2: torch's AdamW and clip_grad_norm_ (DTensor-aware for FSDP2; over
    several meshes with tensor parallelism)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step():
        if meshes > 1:
            clip_over_meshes(list(model.parameters()), CLIP)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=False)

    def state():
        params = list(model.parameters())
        return unique_bytes([*params, *(p.grad for p in params), *reachable_tensors(opt.state)])

    return step, state


def offload_of(impl: str) -> str:
    """The optimizer-state tier an implementation name asks for: "-cpu", "-disk" (ours) or
    "-nvme" (DeepSpeed's name for its disk tier) at its end (before "+params"); "none"
    otherwise."""
    base = impl.removesuffix("+params")
    for tier in ("cpu", "disk", "nvme"):
        if base.endswith(f"-{tier}"):
            return tier
    return "none"


def params_offloaded(impl: str) -> bool:
    """ "+params" at the end: stage 3's parameters on the same tier as the optimizer's."""
    return impl.endswith("+params")


def offload_dir() -> str:
    """Where the disk tiers write (`$OFFLOAD_DIR`, set by benchmarks/offload_bench.py)."""
    return os.environ.get("OFFLOAD_DIR", "/tmp")


def deepspeed_config(impl: str) -> dict:
    zero = {"stage": int(impl[2])}
    if impl.endswith("-lean"):
        zero.update(DEEPSPEED_LEAN)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": zero,
    }
    tier = offload_of(impl)
    if tier != "none":
        zero["offload_optimizer"] = {"device": tier, "nvme_path": offload_dir()}
        config["zero_force_ds_cpu_optimizer"] = False  # the same torch AdamW as everyone
    if params_offloaded(impl):
        zero["offload_param"] = {"device": tier, "nvme_path": offload_dir()}
    return config


def tensor_parallel(impl: str) -> bool:
    return impl.endswith("-tp2")


def data_parallel_mesh_and_plan(model: torch.nn.Module):
    """The (data, tensor) mesh, and the Llama plan applied on its tensor dimension."""
    from torch.distributed.device_mesh import init_device_mesh

    from examples.tensor_parallel_plan import apply_llama_plan

    world = dist.get_world_size()
    mesh = init_device_mesh(
        "cpu", (world // TENSOR_PARALLEL, TENSOR_PARALLEL), mesh_dim_names=("data", "tensor")
    )
    apply_llama_plan(model, mesh["tensor"])
    return mesh


def make_llama(size: str, cfg: GPTConfig) -> torch.nn.Module:
    import transformers

    shape = dict(LLAMA_SIZES[size])
    heads = shape.pop("heads")
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.block_size,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        tie_word_embeddings=False,
        **shape,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def make_model(impl: str, cfg: GPTConfig, meta: bool = False) -> tuple[torch.nn.Module, int]:
    """The model (seed 0) and its parameter count. ds3-lean builds it inside
    `deepspeed.zero.Init`, as DeepSpeed advises for models that barely fit: each rank then
    never holds the whole model. With `meta` (ours only) it is built on the meta device
    and the engine materialises each rank's shard, one unit at a time."""
    torch.manual_seed(0)
    if impl == "ds3-lean":
        import deepspeed

        with deepspeed.zero.Init(config_dict_or_path=deepspeed_config(impl)):
            model = GPT(cfg)
        return model, sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    if meta and impl.startswith("zero"):
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    return model, sum(p.numel() for p in model.parameters())


def build_tensor_parallel(impl: str, model: torch.nn.Module):
    """dp x tp 2: ours at stage 1 or 3 over the data dimension, or FSDP2 over it as
    Lightning's ModelParallelStrategy recipe applies it (fully_shard per block and the
    root on the data mesh, after the plan)."""
    mesh = data_parallel_mesh_and_plan(model)

    def forward(x, y):
        return model(input_ids=x, labels=y).loss

    if impl == "fsdp2-tp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["data"])
        fully_shard(model, mesh=mesh["data"])
        return (forward, lambda loss: loss.backward(), *plain_torch_step_and_state(model, 2))
    from zero_strategy import ZeroConfig, ZeroEngine

    engine = ZeroEngine(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR),
        ZeroConfig(stage=int(impl[4]), gradient_clipping=CLIP),
        device_mesh=mesh,
    )
    return forward, engine.backward, *zero_step_and_state(engine)


def zero_step_and_state(engine):
    """This engine's step (then zero_grad) and its model-state bytes."""

    def step():
        engine.step()
        engine.zero_grad()

    def state():
        r = engine.memory_report()
        return r["parameters"] + r["master_params"] + r["gradients"] + r["optimizer_state"]

    return step, state


def compiled(impl: str) -> bool:
    """`-compiled`: DDP compiled whole (its DDPOptimizer splits the graph at its
    buckets), the sharded ones per block before sharding (torchtitan's recipe)."""
    return impl.endswith("-compiled")


def build(impl: str, model: torch.nn.Module):
    """Returns (forward, backward, step, model_state_bytes) for the implementation."""
    if compiled(impl):
        impl = impl.removesuffix("-compiled")
        if impl != "ddp":
            for block in model.blocks:
                block.compile()
        forward, *rest = build(impl, model)
        return (torch.compile(forward) if impl == "ddp" else forward), *rest
    bf16 = "-bf16" in impl  # zero2-bf16, zero2-bf16-disk
    if tensor_parallel(impl):
        return build_tensor_parallel(impl, model)
    if impl in ("ddp", "fsdp2", "fsdp2-bf16"):
        if impl == "ddp":
            runner = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
            for block in model.blocks:
                fully_shard(block, mp_policy=policy)
            runner = fully_shard(model, mp_policy=policy)
        return (runner, lambda loss: loss.backward(), *plain_torch_step_and_state(model))
    if impl.startswith("ds"):
        import deepspeed

        cfg = deepspeed_config(impl)
        engine, opt, _, _ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR), config=cfg
        )

        def state():
            params = list(engine.module.parameters())
            return unique_bytes(
                [
                    *(getattr(p, "ds_tensor", p) for p in params),
                    *(p.grad for p in params),
                    *reachable_tensors(opt.state if hasattr(opt, "state") else {}),
                    *reachable_tensors(opt),
                ]
            )

        return engine, engine.backward, engine.step, state
    if impl.startswith("zero"):
        from zero_strategy import ZeroConfig, ZeroEngine

        tier = offload_of(impl)
        engine = ZeroEngine(
            model,
            torch.optim.AdamW(model.parameters(), lr=LR),
            ZeroConfig(
                stage=int(impl[4]),
                gradient_clipping=CLIP,
                max_reuse_distance=DEEPSPEED_REUSE_DISTANCE if impl.endswith("-reuse") else 0,
                compute_dtype="bf16" if bf16 else "fp32",
                offload_optimizer=tier,
                offload_params=tier if params_offloaded(impl) else "none",
                offload_dir=offload_dir() if tier == "disk" else None,
                verify_module_order=not impl.endswith("-unchecked"),
            ),
        )
        return engine, engine.backward, *zero_step_and_state(engine)
    raise SystemExit(f"unknown implementation {impl}")


def worker_arguments(*extra: tuple[str, dict]) -> argparse.Namespace:
    """The arguments every benchmark worker takes (plus `extra` (flag, kwargs) pairs)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", required=True)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", required=True)
    for flag, kwargs in extra:
        parser.add_argument(flag, **kwargs)
    return parser.parse_args()


def init_ranks(impl: str) -> int:
    """One thread per rank, and the process group DeepSpeed or torch expects; the rank."""
    torch.set_num_threads(1)
    if impl.startswith("ds"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    return dist.get_rank()


def finish_rank(out: str, impl: str, rank: int, result: dict) -> None:
    """Write this rank's figures where `launch.run_ranks` reads them, then leave the
    process group cleanly (every rank together)."""
    Path(out, f"{impl}.rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def io_bytes() -> tuple[int, int]:
    """Bytes this process has read from and written to storage (Linux /proc/self/io)."""
    try:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    except OSError:
        return 0, 0
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def main() -> None:
    args = worker_arguments(
        ("--size", {"default": "bench", "choices": sorted(SIZES)}),
        ("--layers", {"type": int, "default": 0, "help": "override the size's layer count"}),
        ("--meta", {"action": "store_true", "help": "ours: build on meta, shard on creation"}),
    )
    rank = init_ranks(args.impl)
    cfg = SIZES[args.size]
    if args.layers:
        cfg = dataclasses.replace(cfg, n_layer=args.layers)
    if tensor_parallel(args.impl):
        model = make_llama(args.size, cfg)
        n_params = sum(p.numel() for p in model.parameters())
    else:
        model, n_params = make_model(args.impl, cfg, meta=args.meta)
    forward, backward, step, state_bytes = build(args.impl, model)
    # Tensor-parallel ranks of one data-parallel rank read the same batch.
    g = torch.Generator().manual_seed(
        rank // TENSOR_PARALLEL if tensor_parallel(args.impl) else rank
    )
    data = torch.randint(cfg.vocab_size, (args.batch, cfg.block_size + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]

    times, phases, losses, model_state, io = [], [], [], 0, []
    with PeakRSS() as rss:
        for i in range(args.warmup + args.steps):
            dist.barrier()
            io_before = io_bytes()
            t0 = time.perf_counter()
            loss = forward(x, y)
            t1 = time.perf_counter()
            backward(loss)
            t2 = time.perf_counter()
            if i == args.warmup - 1:
                model_state = state_bytes()
            t2b = time.perf_counter()
            step()
            t3 = time.perf_counter()
            losses.append(loss.item())
            if i == 0:  # a compiled impl's first step compiles
                first_step_s = t3 - t0
            if i >= args.warmup:
                times.append(t3 - t0 - (t2b - t2))
                phases.append((t1 - t0, t2 - t1, t3 - t2b))
                io.append([after - before for after, before in zip(io_bytes(), io_before)])
    result = {
        "impl": args.impl,
        "rank": rank,
        "params": n_params,
        "median_step_s": statistics.median(times),
        "first_step_s": first_step_s,
        "step_times": times,
        "phase_medians_s": {
            k: statistics.median(p[i] for p in phases)
            for i, k in enumerate(("forward", "backward", "step"))
        },
        "peak_rss_mib": rss.peak / 2**20,
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "model_state_mib": model_state / 2**20,
        "losses": losses,
        # Storage read and written per measured step (median), and the step phase's time.
        "io_read_per_step": statistics.median(r for r, _ in io),
        "io_write_per_step": statistics.median(w for _, w in io),
    }
    finish_rank(args.out, args.impl, rank, result)


if __name__ == "__main__":
    main()
