"""Two "nodes" on one machine, joined by a slow link, for multi-node runs without a cluster.

    sudo python scripts/two_nodes.py [--rate 1gbit] [--delay 0.5ms] [--nproc-per-node 2] \\
        -- script.py [script args]

Two Linux network namespaces, each a node with its own address, joined by a veth pair;
the link shaped with `tc` in both directions (a token-bucket rate, `tbf`, and a netem
delay where the kernel has `sch_netem`; the run says which were applied). `torchrun
--nnodes 2 --rdzv-backend c10d` runs in each namespace, node 0 hosting the rendezvous on
its own address. Gloo is bound to the veth (`GLOO_SOCKET_IFNAME`), so traffic between the
nodes crosses the shaped link and goes only between the namespaces' own addresses, while
ranks of one node talk inside their namespace. Everything is torn down on exit, on
failure too. Needs root (these machines and CI run as root); `unavailable()` says why
not, for tests to skip with.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path


class NamespacesUnavailable(RuntimeError):
    """Network namespaces, a veth pair or tc could not be set up here."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise NamespacesUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def _tc(namespace: str, *args: str) -> bool:
    cmd = ["ip", "netns", "exec", namespace, "tc", "qdisc", *args]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def unavailable() -> str | None:
    """Why two namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        with TwoNodes(rate=None, delay=None):
            pass
    except NamespacesUnavailable as error:
        return str(error)
    return None


@dataclass
class TwoNodes(contextlib.AbstractContextManager):
    """Two namespaces joined by a shaped veth pair, for the life of the `with` block."""

    rate: str | None = "1gbit"  # per direction; None: unshaped
    delay: str | None = "0.5ms"  # one way; None: none
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    shaping: list[str] = field(default_factory=list)  # what was applied, for reports

    def __post_init__(self) -> None:
        self.namespaces = (f"zs{self.tag}a", f"zs{self.tag}b")
        self.interfaces = (f"zv{self.tag}a", f"zv{self.tag}b")
        subnet = 16 + int(self.tag, 16) % 200  # a /24 of 10.231.0.0/16 per harness
        self.addresses = (f"10.231.{subnet}.1", f"10.231.{subnet}.2")

    def __enter__(self) -> TwoNodes:
        try:
            self._set_up()
        except BaseException:
            self._tear_down()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._tear_down()

    def _set_up(self) -> None:
        for namespace in self.namespaces:
            _ip("netns", "add", namespace)
        _ip("link", "add", self.interfaces[0], "type", "veth", "peer", "name", self.interfaces[1])
        for namespace, interface, address in zip(self.namespaces, self.interfaces, self.addresses):
            _ip("link", "set", interface, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            _ip("-n", namespace, "link", "set", interface, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
        self.shaping = self._shape()

    def _shape(self) -> list[str]:
        """Rate and delay on both ends: netem when the kernel has it (delay and rate in
        one qdisc), else a token bucket for the rate alone."""
        if self.rate is None and self.delay is None:
            return []
        applied = []
        for namespace, interface in zip(self.namespaces, self.interfaces):
            netem = ["netem"] + (["delay", self.delay] if self.delay else [])
            netem += ["rate", self.rate] if self.rate else []
            if _tc(namespace, "add", "dev", interface, "root", *netem):
                applied.append(f"{interface}: netem {' '.join(netem[1:])}")
                continue
            if self.rate and _tc(
                namespace, "add", "dev", interface, "root", "tbf", "rate", self.rate,
                "burst", "256kb", "latency", "100ms",
            ):  # fmt: skip
                applied.append(f"{interface}: tbf rate {self.rate} (no sch_netem: no delay)")
            elif self.rate:
                raise NamespacesUnavailable(f"tc could not shape {interface} to {self.rate}")
        return applied

    def _tear_down(self) -> None:
        for namespace in self.namespaces:  # the veth goes with its namespace
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)

    def run(
        self,
        argv: list[str],
        nproc_per_node: int = 1,
        env: dict[str, str] | None = None,
        timeout: float = 600,
        logs: Path | None = None,
        port: int = 29400,
    ) -> list[int]:
        """`torchrun --nnodes 2` of `argv` (a script and its arguments) in both nodes at
        once; each node's return code (None where it ran past `timeout`, then killed)."""
        procs = []
        with contextlib.ExitStack() as files:
            for node, argv_node in enumerate(self._commands(argv, nproc_per_node, port)):
                node_env = {
                    **os.environ,
                    **(env or {}),
                    "GLOO_SOCKET_IFNAME": self.interfaces[node],
                    "ZERO_NODE_LINK": ";".join(self.shaping) or "unshaped",
                }
                out = (
                    files.enter_context(open(logs / f"node{node}.log", "w"))
                    if logs
                    else subprocess.DEVNULL
                )
                procs.append(
                    subprocess.Popen(argv_node, env=node_env, stdout=out, stderr=subprocess.STDOUT)
                )
            codes = []
            for proc in procs:
                try:
                    codes.append(proc.wait(timeout=timeout))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    codes.append(None)
        return codes

    def _commands(self, argv: list[str], nproc_per_node: int, port: int) -> list[list[str]]:
        commands = []
        for node, (namespace, address) in enumerate(zip(self.namespaces, self.addresses)):
            cmd = [
                "ip", "netns", "exec", namespace,
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2",
                "--nproc-per-node", str(nproc_per_node),
                "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{self.addresses[0]}:{port}",
                "--rdzv-id", f"zs{self.tag}",
                "--rdzv-conf", f"is_host={int(node == 0)}",
                "--local-addr", address,
                *argv,
            ]  # fmt: skip
            commands.append(cmd)
        return commands


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1gbit", help="tc rate per direction ('none': unshaped)")
    parser.add_argument("--delay", default="0.5ms", help="one-way delay ('none': none)")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--logs", type=Path, help="each node's output here (default: shown)")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- script.py [args]")
    args = parser.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        parser.error("name the script to run after --")
    none = {"none", ""}
    rate = None if args.rate.lower() in none else args.rate
    delay = None if args.delay.lower() in none else args.delay
    with TwoNodes(rate=rate, delay=delay) as nodes:
        print(f"nodes {nodes.addresses}, link: {'; '.join(nodes.shaping) or 'unshaped'}")
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
        codes = nodes.run(argv, args.nproc_per_node, timeout=args.timeout, logs=args.logs)
    print(f"node return codes: {codes}")
    sys.exit(0 if codes == [0, 0] else 1)


if __name__ == "__main__":
    main()
