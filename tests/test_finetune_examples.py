"""The fine-tuning examples run as their docstrings say (torchrun, 2 CPU processes), end
cleanly, and save what they promise: a LoRA adapter that PEFT loads, an SFT model that
`from_pretrained` loads."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(script: str, out: Path) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    cmd += [str(ROOT / "examples" / script), "--steps", "6", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "terminate called" not in done.stderr
    return done.stdout


def test_lora_example_saves_an_adapter_peft_loads(tmp_path):
    pytest.importorskip("peft", reason="PEFT is an optional extra: pip install peft")
    out = _torchrun("finetune_lora.py", tmp_path)
    assert "adapter saved" in out and "loaded: PeftModel" in out
    assert (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size > 0


def test_sft_example_saves_a_model_from_pretrained_loads(tmp_path):
    pytest.importorskip("trl", reason="TRL is an optional extra: pip install trl")
    transformers = pytest.importorskip("transformers")
    out = _torchrun("finetune_sft.py", tmp_path)
    assert "model saved" in out
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert sum(p.numel() for p in model.parameters()) > 0
