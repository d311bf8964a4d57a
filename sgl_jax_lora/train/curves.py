"""Training curves on disk: a CSV of (step, value) and, when matplotlib is installed, a PNG plot.

Flow: the training CLI (loss per step) and scripts/rl_lora.py (mean reward per step) call `save_curve` at the end.
"""

from __future__ import annotations

import csv
import logging

logger = logging.getLogger(__name__)


def save_curve(path_stem: str, name: str, values: list[float]) -> list[str]:
    """Write {path_stem}.csv (columns step,{name}) and {path_stem}.png; -> the files written."""
    with open(path_stem + ".csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", name])
        writer.writerows((step, value) for step, value in enumerate(values, 1))
    written = [path_stem + ".csv"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: wrote %s.csv only (pip install matplotlib for the PNG)", path_stem)
        return written
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(range(1, len(values) + 1), values)
    axes.set_xlabel("step")
    axes.set_ylabel(name)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path_stem + ".png", dpi=100)
    plt.close(figure)
    return written + [path_stem + ".png"]
