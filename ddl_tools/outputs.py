"""Writing results: JSON and figures, each file complete or absent (a reader, or a rerun after a crash, never sees
half of one)."""

import json
import os
from dataclasses import asdict

import torch


def write_json(path, obj):
    """Atomically (a temporary file, then a rename): a reader never sees half a file, e.g. a study's result.json."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)


def _json_default(obj):
    if isinstance(obj, torch.dtype):
        return str(obj)
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    return str(obj)


def save_figure(fig, path):
    """Every figure of the project: tight layout, 120 dpi PNG, closed afterwards (no pyplot state left behind)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["save_figure", "write_json"]
