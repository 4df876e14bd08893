"""Runs across two "nodes" (scripts/two_nodes.py: two network namespaces joined by a
shaped veth, `torchrun --nnodes 2 --rdzv-backend c10d`) train as one process does on the
union of their batches, at stages 1-3; and the harness leaves nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from training import rel_l2, train_reference

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import two_nodes  # noqa: E402

WORKER = str(ROOT / "tests" / "two_nodes_worker.py")
STEPS, ACCUM, CLIP = 4, 2, 0.5  # as two_nodes_worker.py trains

WHY_NOT = two_nodes.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no two nodes here: {WHY_NOT}")


@pytest.fixture(scope="module")
def reference():
    return train_reference(STEPS, ACCUM, CLIP)


def _across_two_nodes(tmp_path: Path, stage: int, per_node: int) -> dict:
    out = tmp_path / "out"
    with two_nodes.TwoNodes(rate="1gbit", delay="0.5ms") as nodes:
        codes = nodes.run(
            [WORKER, str(out), str(stage), str(STEPS)], per_node, timeout=300, logs=tmp_path
        )
        namespaces = nodes.namespaces
    logs = "\n".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("node*.log")))
    assert codes == [0, 0], logs
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in left for name in namespaces)  # torn down
    run = json.loads((out / "run.json").read_text())
    run["state"] = load_file(str(out / "state.safetensors"))
    return run


@pytest.mark.parametrize(("stage", "per_node"), [(1, 1), (2, 1), (3, 1), (3, 2)])
def test_two_nodes_train_as_one_process(tmp_path, reference, stage, per_node):
    ref_losses, ref_state = reference
    run = _across_two_nodes(tmp_path, stage, per_node)
    assert run["world"] == 2 * per_node
    assert run["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert run["state"].keys() == ref_state.keys()
    assert rel_l2(run["state"], ref_state) < 1e-5


def test_a_failed_set_up_leaves_no_namespace():
    """A set-up that fails part way (here: an address already taken by the first pair)
    tears down what it made."""
    with two_nodes.TwoNodes(rate=None, delay=None) as first:
        second = two_nodes.TwoNodes(rate=None, delay=None, tag=first.tag)  # same names
        with pytest.raises(two_nodes.NamespacesUnavailable), second:
            pass
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in left for name in first.namespaces)
