"""`state_dict_type="full"`: a checkpoint written as one torch file, as Lightning's and
Fabric's FSDP strategies write it, that `LightningModule.load_from_checkpoint`,
`torch.load(path, weights_only=True)` and a DDP run open like any other.

Every rank writes its own ranges of the file (`checkpoint/one_file_writer.py`): nothing
is gathered, no rank holds more than one piece. The optimizer state is kept whole, keyed
by parameter name as FSDP's full optimizer state is, and loads back into any world size
and stage (`checkpoint/one_file.py`).
"""

from __future__ import annotations

STATE_DICT_TYPES = ("sharded", "full")


def check_state_dict_type(value: str, entry: str) -> str:
    if value not in STATE_DICT_TYPES:
        raise ValueError(
            f"{entry}(state_dict_type={value!r}): use 'sharded' (a directory of each rank's "
            "shards, the default) or 'full' (one file, every rank writing its own part)."
        )
    return value
