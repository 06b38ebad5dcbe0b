"""The run's loss curve as a PNG: training loss (averaged over logging windows) and held-out loss against
tokens seen, drawn with matplotlib's file-only backend (no display needed)."""

from __future__ import annotations

from pathlib import Path


def plot_losses(train: list[dict], heldout: list[dict], out: Path, title: str) -> None:
    """train / heldout: the run log's points ({tokens, loss}); out: the PNG to write."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        axes.plot([p["tokens"] / 1e6 for p in train], [p["loss"] for p in train], label="training loss", lw=1)
    axes.plot([p["tokens"] / 1e6 for p in heldout], [p["loss"] for p in heldout], "o-", label="held-out loss", ms=4)
    axes.set_xlabel("tokens seen (millions)")
    axes.set_ylabel("cross-entropy (nats per token)")
    axes.set_title(title, fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)
