"""Where the benchmark scripts put their JSON results."""
from __future__ import annotations

import json
import os


def write_json(out_dir: str, name: str, data) -> str:
    """Write ``data`` to ``out_dir/name`` (creating the folder); returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return path
