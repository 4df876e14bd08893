"""The GPU check of the fused kernels: one script, under 5 minutes on one H200.

    python benchmarks/gpu_check.py            # on a machine with a CUDA GPU
    python benchmarks/gpu_check.py --smoke    # anywhere: CPU, Triton interpreter, tiny sizes

It (1) runs tests/test_kernels.py with the kernels compiled, (2) trains the small GPT with
the engine at world size 1 on CUDA, through an NCCL process group and the fused AdamW step,
and through Trainer(strategy="zero3", accelerator="cuda"), and compares the losses with
the same runs on CPU, (2b) trains it with each block compiled against eager (losses,
step times, the compiling first step), and (3) measures achieved bandwidth of
the fused AdamW over 1B parameters of ragged shards (bytes read + written), against torch's
AdamW(fused=True) on the same tensors and against the device's copy bandwidth, and of the
MoE permute. Targets: AdamW >= 85% of copy bandwidth and >= 1.1x torch fused; permute >=
70% of copy bandwidth. Correctness failures exit non-zero; the targets are reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from zero_strategy import kernels  # noqa: E402


# ----------------------------------------------------------------------------- timing
def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds per call, after warm-up calls (compilation, allocator)."""
    for _ in range(2 if device.type == "cuda" else 0):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() * 4 / seconds  # read + write


# ----------------------------------------------------------------------------- (1) tests
def run_kernel_tests() -> bool:
    env = dict(os.environ)
    if torch.cuda.is_available():
        env.pop("TRITON_INTERPRET", None)  # compiled, not interpreted
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(ROOT / "tests" / "test_kernels.py"),
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    tail = (result.stdout + result.stderr).strip().splitlines()[-1:]
    print(
        f"kernel tests ({'compiled' if 'TRITON_INTERPRET' not in env else 'interpreted'}):", *tail
    )
    return result.returncode == 0


# ----------------------------------------------------------------------------- (2) training
@contextlib.contextmanager
def world_of_one(device: torch.device, tmp: str):
    """A one-rank process group (NCCL beside gloo on CUDA) for the block, then destroyed."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    store = dist.FileStore(os.path.join(tmp, "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def timed_steps(engine, cfg, device: torch.device, steps: int) -> tuple[list[float], list[float]]:
    """The engine's losses and step times over `steps` batches of 8 sequences (seed 1)."""
    g = torch.Generator().manual_seed(1)
    losses, times = [], []
    for _ in range(steps):
        data = torch.randint(cfg.vocab_size, (8, cfg.block_size + 1), generator=g)
        x, y = data[:, :-1].to(device), data[:, 1:].to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())  # waits for the device
        times.append(time.perf_counter() - start)
    return losses, times


def train_losses(device: torch.device, steps: int) -> tuple[list[float], int]:
    """Losses of the small GPT at stage 3, and how many fused-kernel steps the engine took."""
    from examples.gpt import GPT, GPTConfig, decay_groups
    from zero_strategy import ZeroConfig, ZeroEngine

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(decay_groups(model), lr=1e-3, betas=(0.9, 0.95))
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=3, gradient_clipping=1.0))
    losses, _ = timed_steps(engine, cfg, device, steps)
    return losses, engine.fused_step.launches


def check_state_paths(device: torch.device, tmp: str) -> tuple[bool, str]:
    """On `device` at stage 3: a checkpoint written and read back into a differently
    initialised engine, `model.state_dict()` against the masters, and a model whose
    blocks start with frozen layers (kept gathered until backward leaves them)."""
    from examples.gpt import GPT, GPTConfig
    from zero_strategy import ZeroConfig, ZeroEngine

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)

    def engine_for(seed: int, freeze: bool = False) -> ZeroEngine:
        torch.manual_seed(seed)
        model = GPT(cfg).to(device)
        if freeze:
            for block in model.blocks:
                block.ln1.requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        return ZeroEngine(model, torch.optim.AdamW(params, lr=1e-3), ZeroConfig(stage=3))

    data = torch.randint(cfg.vocab_size, (4, cfg.block_size + 1), generator=torch.Generator())
    x, y = data[:, :-1].to(device), data[:, 1:].to(device)
    trained = engine_for(0, freeze=True)
    for _ in range(2):
        trained.backward(trained(x, y))
        trained.step()
        trained.zero_grad()
    trained.save_checkpoint(os.path.join(tmp, "ckpt"))
    masters = trained.full_state_dict()
    module_state = trained.module.state_dict()
    restored = engine_for(1, freeze=True)
    restored.load_checkpoint(os.path.join(tmp, "ckpt"))
    loaded = restored.full_state_dict()
    same = all(torch.equal(loaded[k], v) for k, v in masters.items())
    views = all(torch.equal(module_state[k].cpu(), v) for k, v in masters.items())
    return same and views, (
        f"stage 3 on {device.type}: frozen-first-layer training, checkpoint round trip "
        f"{'exact' if same else 'DIFFERS'}, state_dict() {'equals' if views else 'DIFFERS from'} "
        "the masters"
    )


def check_training(device: torch.device, steps: int) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as tmp, world_of_one(device, tmp):
        with kernels.use_backend("auto" if device.type == "cuda" else "triton"):
            got, fused_calls = train_losses(device, steps)
            state_ok, state_line = check_state_paths(device, tmp)
        with kernels.use_backend("reference"):
            ref, _ = train_losses(torch.device("cpu"), steps)
    print(state_line)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    ok = worst < 1e-3 and fused_calls > 0 and state_ok
    return ok, (
        f"engine stage 3 on {device.type} ({'nccl' if device.type == 'cuda' else 'gloo'}, "
        f"fused AdamW calls {fused_calls}) vs CPU over {steps} steps: worst relative loss "
        f"difference {worst:.2e} (first {got[0]:.4f}/{ref[0]:.4f}, last {got[-1]:.4f}/{ref[-1]:.4f})"
    )


def check_compiled(device: torch.device, steps: int) -> tuple[bool, str]:
    """The small GPT at stage 3, world 1, eager and with each block compiled (inductor on
    CUDA; aot_eager in the CPU smoke run, which checks the path, not the speed): losses
    equal, median step times after the first two steps, and the first step (it compiles)."""
    from examples.gpt import GPT, GPTConfig
    from zero_strategy import ZeroConfig, ZeroEngine

    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
    backend = "inductor" if device.type == "cuda" else "aot_eager"

    def run(compiled: bool) -> tuple[list[float], float, float]:
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        if compiled:
            for block in model.blocks:
                block.compile(backend=backend)
        engine = ZeroEngine(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3), ZeroConfig(stage=3)
        )
        losses, times = timed_steps(engine, cfg, device, steps)
        return losses, times[0], statistics.median(times[2:] or times)

    with tempfile.TemporaryDirectory() as tmp, world_of_one(device, tmp):
        eager, eager_first, eager_step = run(False)
        compiled, first, step = run(True)
    worst = max(abs(a - b) / abs(b) for a, b in zip(compiled, eager))
    ok = worst < 1e-3
    return ok, (
        f"compiled blocks ({backend}) at stage 3 on {device.type}: worst relative loss "
        f"difference {worst:.2e} against eager; step {step * 1e3:.1f} ms vs eager "
        f"{eager_step * 1e3:.1f} ms ({eager_step / step:.2f}x); first step {first:.1f} s "
        f"(compiling) vs eager {eager_first:.1f} s"
    )


def check_lightning(cuda: bool) -> tuple[bool, str]:
    """Trainer(strategy="zero3", accelerator="cuda", devices=1) against the same run on
    CPU (tests/launched_fit.py, each in a fresh process)."""
    losses = {}
    for accelerator in dict.fromkeys(("cuda" if cuda else "cpu", "cpu")):
        with tempfile.TemporaryDirectory() as out:
            cmd = [
                sys.executable,
                str(ROOT / "tests" / "launched_fit.py"),
                out,
                "--devices",
                "1",
                "--accelerator",
                accelerator,
            ]
            env = dict(os.environ, ZERO_STRATEGY_KERNELS="auto")
            result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            report = Path(out, "rank0.json")
            if result.returncode or not report.exists():
                tail = (result.stdout + result.stderr)[-3000:]
                return False, f"Lightning on {accelerator} failed:\n{tail}"
            losses[accelerator] = json.loads(report.read_text())["losses"]
    got, ref = losses["cuda" if cuda else "cpu"], losses["cpu"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    where = "cuda" if cuda else "cpu"
    return worst < 1e-3, (
        f'Trainer(strategy="zero3", accelerator="{where}", devices=1) vs CPU: worst relative '
        f"loss difference {worst:.2e} over {len(got)} micro-batches"
    )


def check_cpu_offload(device: torch.device, steps: int, width: int) -> tuple[bool, str, dict]:
    """A GPT on one device (stage 3 asked for; one process trains unsharded) with
    offload_optimizer="cpu" (masters, gradient shards and the
    AdamW state in page-locked host memory, the step on the CPU, the compute copies sent
    back) against the same run without offload: losses within 1e-3, the median step time
    of each, and the bytes the offload moves per step (gradients to the host, weights
    back) over that step time, beside pinned `copy_` bandwidth each way."""
    from examples.gpt import GPT, GPTConfig, decay_groups
    from zero_strategy import ZeroConfig, ZeroEngine

    cfg = GPTConfig(vocab_size=1024, block_size=128, n_layer=4, n_head=8, n_embd=width)
    results = {}
    with tempfile.TemporaryDirectory() as tmp, world_of_one(device, tmp):
        for tier in ("none", "cpu", "cpu+params"):
            torch.manual_seed(0)
            model = GPT(cfg).to(device)
            optimizer = torch.optim.AdamW(decay_groups(model), lr=1e-3)
            config = ZeroConfig(
                stage=3,
                gradient_clipping=1.0,
                offload_optimizer=tier.removesuffix("+params"),
                offload_params="cpu" if tier.endswith("+params") else "none",
                # unit buffers: the reduced gradients go to the host through the
                # page-locked landings (per-parameter reductions copy them directly)
                overlap_comm=not tier.endswith("+params"),
            )
            engine = ZeroEngine(model, optimizer, config)
            losses, times = timed_steps(engine, cfg, device, steps)
            report = engine.memory_report()
            params = sum(u.layout.numel for u in engine.units)
            engine.release_module()
            results[tier] = (losses, statistics.median(times[1:] or times), report)
    (ref, t_ref, _), (got, t_off, report) = results["none"], results["cpu"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    with_params, t_params, params_report = results["cpu+params"]
    worst_params = max(abs(a - b) / abs(b) for a, b in zip(with_params, ref))
    moved = params * 4 * 2  # fp32 gradients to the host, fp32 masters into the copies back
    host = {"d2h": 0.0, "h2d": 0.0}
    if device.type == "cuda":
        n = 1 << 28  # 1 GiB of fp32
        pinned = torch.empty(n, dtype=torch.float32, pin_memory=True)
        on_device = torch.empty(n, dtype=torch.float32, device=device)
        host["h2d"] = n * 4 / timed(lambda: on_device.copy_(pinned, non_blocking=True), device, 5)
        host["d2h"] = n * 4 / timed(lambda: pinned.copy_(on_device, non_blocking=True), device, 5)
    on_host = report.get("host_total", 0)
    figures = {
        "step_none": t_ref,
        "step_cpu": t_off,
        "moved_per_step": moved,
        "achieved": moved / t_off,
        "pinned_h2d": host["h2d"],
        "pinned_d2h": host["d2h"],
        "host_total": on_host,
        "device_total": report["total"],
        "step_params": t_params,
    }
    params_on_host = params_report.get("host_parameters", 0)
    ok = worst < 1e-3 and worst_params < 1e-3
    ok = ok and (device.type != "cuda" or (on_host > 0 and params_on_host > 0))
    return (
        ok,
        (
            f"offload_optimizer='cpu', world 1 ({params / 1e6:.1f}M params) vs none: worst "
            f"relative loss difference {worst:.2e} over {steps} steps; host memory "
            f"{on_host / 2**20:.0f} MiB, device {report['total'] / 2**20:.0f} MiB; with "
            f"offload_params='cpu' (stage 3 kept) {worst_params:.2e}, parameters on the "
            f"host {params_on_host / 2**20:.0f} MiB"
        ),
        figures,
    )


# ----------------------------------------------------------------------------- (3) bandwidth
def ragged_sizes(total: int, pieces: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(pieces, generator=g) + 0.05
    sizes = (weights / weights.sum() * total).long().clamp(min=1)
    sizes[-1] += total - int(sizes.sum())
    return sizes.tolist()


def bench_adamw(device: torch.device, numel: int, pieces: int, repeats: int) -> dict[str, float]:
    sizes = ragged_sizes(numel, pieces)
    params = [torch.randn(n, device=device) for n in sizes]
    grads = [torch.randn(n, device=device) * 1e-3 for n in sizes]
    exp_avgs = [torch.zeros(n, device=device) for n in sizes]
    exp_avg_sqs = [torch.zeros(n, device=device) for n in sizes]
    copies = [torch.empty(n, device=device, dtype=torch.bfloat16) for n in sizes]
    step = torch.zeros((), device=device)
    forced = "auto" if device.type == "cuda" else "triton"

    def ours(with_copy: bool):
        def run():
            with kernels.use_backend(forced):
                kernels.fused_adamw_(
                    params,
                    grads,
                    exp_avgs,
                    exp_avg_sqs,
                    step=step,
                    lr=1e-4,
                    weight_decay=0.1,
                    compute_copies=copies if with_copy else None,
                )

        return run

    wrapped = [torch.nn.Parameter(p, requires_grad=True) for p in params]
    for w, g in zip(wrapped, grads):
        w.grad = g
    torch_fused = torch.optim.AdamW(wrapped, lr=1e-4, weight_decay=0.1, fused=True)
    t_ours = timed(ours(False), device, repeats)
    t_copy = timed(ours(True), device, repeats)
    t_torch = timed(torch_fused.step, device, repeats)
    bytes_step = 28 * numel  # read p, g, m, v; write p, m, v (fp32)
    return {
        "ours": bytes_step / t_ours,
        "ours_bf16_copy": (bytes_step + 2 * numel) / t_copy,
        "torch_fused": bytes_step / t_torch,
        "t_ours": t_ours,
        "t_torch": t_torch,
    }


def bench_permute(
    device: torch.device, tokens: int, hidden: int, k: int, experts: int, repeats: int
) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    logits = torch.randn(tokens, experts, device=device)
    forced = "auto" if device.type == "cuda" else "triton"
    with kernels.use_backend(forced):
        _, index = kernels.topk_route(logits, k)
        plan = kernels.plan_dispatch(index, experts)

    def run():
        with kernels.use_backend(forced):
            kernels.permute(x, plan)

    seconds = timed(run, device, repeats)
    return 2 * tokens * k * hidden * x.element_size() / seconds  # each row read and written


# ----------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, Triton interpreter, tiny sizes (checks the script itself)",
    )
    parser.add_argument(
        "--no-kernel-tests",
        action="store_true",
        help="skip step (1), e.g. when the test suite runs the smoke check",
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        print("No CUDA device: rerun with TRITON_INTERPRET=1 and --smoke.")
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    sizes = dict(
        adam=1_000_000_000,
        pieces=257,
        copy=4 << 30,
        tokens=65536,
        hidden=4096,
        k=2,
        experts=64,
        repeats=10,
        steps=20,
        width=1024,
    )
    if not cuda:
        sizes = dict(
            adam=20_000,
            pieces=5,
            copy=8 << 20,
            tokens=64,
            hidden=32,
            k=2,
            experts=8,
            repeats=1,
            steps=3,
            width=64,
        )
    ok = run_kernel_tests() if not args.no_kernel_tests else True
    trained, line = check_training(device, sizes["steps"])
    print(line)
    lightning_ok, line = check_lightning(cuda)
    print(line)
    # New, never run on a GPU before: a failure must not cost the other figures (each
    # check's process group is destroyed on the way out, by world_of_one).
    try:
        offload_ok, line, offload = check_cpu_offload(device, sizes["steps"], sizes["width"])
    except Exception:
        offload_ok, offload = False, {}
        line = "CPU offload check FAILED:\n" + traceback.format_exc()[-3000:]
    print(line)
    try:
        compiled_ok, line = check_compiled(device, max(sizes["steps"], 4))
    except Exception:
        compiled_ok = False
        line = "compiled check FAILED:\n" + traceback.format_exc()[-3000:]
    print(line)
    ok = ok and trained and lightning_ok and offload_ok and compiled_ok
    copy_bw = copy_bandwidth(device, sizes["copy"], sizes["repeats"])
    adam = bench_adamw(device, sizes["adam"], sizes["pieces"], sizes["repeats"])
    permute_bw = bench_permute(
        device, sizes["tokens"], sizes["hidden"], sizes["k"], sizes["experts"], sizes["repeats"]
    )
    print(f"\n| measurement ({device.type}) | GB/s | of copy bandwidth | target |")
    print("|---|---|---|---|")
    print(f"| copy (read + write) | {copy_bw / 1e9:.0f} | 100% | - |")
    rows = [
        (
            f"fused AdamW, {sizes['adam'] / 1e9:g}B params, {sizes['pieces']} ragged shards",
            adam["ours"],
            ">= 85%, >= 1.1x torch fused",
        ),
        ("fused AdamW + bf16 compute copy", adam["ours_bf16_copy"], "-"),
        ("torch AdamW(fused=True), same tensors", adam["torch_fused"], "-"),
        (
            f"MoE permute, {sizes['tokens']} tokens x {sizes['hidden']}, top-{sizes['k']}",
            permute_bw,
            ">= 70%",
        ),
    ]
    for name, bw, target in rows:
        print(f"| {name} | {bw / 1e9:.0f} | {bw / copy_bw:.0%} | {target} |")
    print(
        "\n| CPU offload (world 1, offload_optimizer='cpu') | value |\n|---|---|"
        if offload
        else "\nCPU offload: no figures (the check failed, above)"
    )
    if offload:
        print_offload(offload)
    print(
        f"\nfused AdamW step {adam['t_ours'] * 1e3:.2f} ms vs torch fused "
        f"{adam['t_torch'] * 1e3:.2f} ms: {adam['t_torch'] / adam['t_ours']:.2f}x"
    )
    print("correctness:", "ok" if ok else "FAILED")
    return 0 if ok else 1


def print_offload(offload: dict) -> None:
    print(
        f"| step time, no offload / offload (s) | {offload['step_none']:.3f} / "
        f"{offload['step_cpu']:.3f} ({offload['step_cpu'] / offload['step_none']:.2f}x) |\n"
        f"| step time with offload_params='cpu' too (s) | {offload['step_params']:.3f} |\n"
        f"| host<->device bytes per step (GB) | {offload['moved_per_step'] / 1e9:.2f} |\n"
        f"| those bytes over the offload step (GB/s) | {offload['achieved'] / 1e9:.1f} |\n"
        f"| pinned copy_ host->device / device->host (GB/s) | "
        f"{offload['pinned_h2d'] / 1e9:.1f} / {offload['pinned_d2h'] / 1e9:.1f} |"
    )


if __name__ == "__main__":
    sys.exit(main())
