"""The torchio tests count the GETs the mount makes, so UCVolumeDataset copies through the mount here
unless a test asks for direct fills from the store (tests/torch/test_direct.py does, with explicit
``direct=True`` and credentials). Set before any rank or worker process starts, so they inherit it."""

import os

os.environ.setdefault("UCFS_TORCHIO_DIRECT", "0")
