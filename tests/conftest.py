import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

# Without a GPU the Triton kernels are tested under Triton's interpreter. Triton decides
# interpreted-or-compiled when each @triton.jit function (its own library included) is
# defined, so the switch must be on before anything imports triton (Lightning and
# transformers may, through torch's compiler stack).
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
