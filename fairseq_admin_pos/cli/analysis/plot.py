"""The depth study's figure in ``fairseq-admin-analyze``: ``output_change.png``, depth
against output change on log-log axes, encoder and decoder side by side (matplotlib, Agg,
imported only when a figure is drawn)."""
from __future__ import annotations

from typing import Sequence

from .depth import Result, mean_changes
from .variants import VARIANTS


def plot(results: Sequence[Result], path: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = mean_changes(results)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, which, name in ((axes[0], 0, "encoder output"), (axes[1], 1, "decoder output")):
        for variant, by_depth in means.items():
            depths = sorted(by_depth)
            label = VARIANTS[variant].label if variant in VARIANTS else variant
            ys = [by_depth[n][which] for n in depths]
            if not any(y > 0 for y in ys):  # log axis: list it, e.g. ReZero (identity at init)
                ax.plot([], [], ls="none", marker="x", color="black",
                        label=f"{label}: 0 at every N")
                continue
            ax.plot(depths, ys, marker="o", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(sorted({r.encoder_layers for r in results}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.minorticks_off()
        ax.set_xlabel("encoder layers N" + (" (= decoder layers)" if all(
            r.encoder_layers == r.decoder_layers for r in results) else ""))
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(r"$|F(x,W)-F(x,W+\delta)|^2 / |F(x,W)|^2$")
    fig.suptitle(title, fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    if len(labels) <= 5:
        axes[0].legend(fontsize=8)
        fig.tight_layout()
    else:  # with the rivals (--variants all) a legend inside would hide curves
        fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
