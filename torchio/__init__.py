"""torchio: PyTorch data loading and checkpointing on a ucfs mount.

    from torchio import UCVolumeDataset, DataLoader, UCVolumeWriter, UCVolumeReader, export_table

- `UCVolumeDataset`: the files under a volume directory, sharded over (rank, worker), copied once
  to a host-local cache, yielded as local paths; resumable mid-epoch.
- `DataLoader`: torch's DataLoader with defaults for the mount, fetch-ahead, exact resume and
  timing of how long each batch waited for data.
- `UCVolumeWriter` / `UCVolumeReader`: `torch.distributed.checkpoint` storage whose ``.metadata``
  appears in the store only after every shard of every rank is committed.
- `export_table`: a Delta table or any Arrow data written into a volume as Parquet files of a target
  size and published whole, for `datasets` / pyarrow to load (see `torchio.tables`).

Names are imported on first use, so ``import torchio`` stays cheap (torch.distributed.checkpoint
is loaded only by a script that checkpoints, pyarrow only by one that exports). torchio uses the
mount through ordinary file calls and imports nothing of ucfs's file system; ucfs never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["UCVolumeDataset", "DataLoader", "UCVolumeWriter", "UCVolumeReader", "export_table"]

_WHERE = {
    "UCVolumeDataset": ".dataset",
    "DataLoader": ".loader",
    "UCVolumeWriter": ".dcp",
    "UCVolumeReader": ".dcp",
    "export_table": ".tables",
}

# Optional packages, and the extra of pyproject.toml that installs each.
_EXTRAS = {"pyarrow": "tables", "deltalake": "tables", "torch": "torch", "numpy": "torch"}

if TYPE_CHECKING:
    from .dataset import UCVolumeDataset
    from .dcp import UCVolumeReader, UCVolumeWriter
    from .loader import DataLoader
    from .tables import export_table


def __getattr__(name: str):
    if name in _WHERE:
        try:
            module = importlib.import_module(_WHERE[name], __name__)
        except ModuleNotFoundError as e:
            if e.name in _EXTRAS:
                raise ModuleNotFoundError(f"torchio.{name} needs {e.name}, which is not installed: "
                                          f"pip install 'ucfs[{_EXTRAS[e.name]}]'", name=e.name) from e
            raise
        value = getattr(module, name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'torchio' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
