"""The study's figures: loss curves, omegas per sub-layer, and the deep-shallow cells' deployed
speed against BLEU."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .common import parse_depth
from .omegas import closed_form
from .report import (_row_order, _study_order, curve_path, depth_order, recipe_label,
                     study_title)


SCHEME_COLORS = {"post-ln": "tab:red", "pre-ln": "tab:blue", "admin": "tab:green",
                 "admin-profile": "tab:purple", "admin-paper": "tab:purple",
                 "deepnorm": "tab:orange", "admin-radam": "lime", "admin-profile-radam": "violet",
                 "admin-paper-adam": "indigo", "admin-paper-floor": "tab:olive",
                 "admin-paper-closed-bottom": "tab:cyan", "admin-paper-max": "tab:brown",
                 "admin-paper-enc": "tab:pink", "admin-paper-dec": "tab:gray", "b2t": "gold",
                 "resi-dual": "teal"}


def plotted_study(rows) -> str:
    """The study the loss figure shows: the one with the most rows, the newest on a tie.

    A side study of a few runs (the 2400-update rows at lr 1e-3, warmup 2000) must not replace
    the main grid's curves just because its recipe sorts first.
    """
    counts = Counter(r["study"] for r in rows)
    return min(counts, key=lambda s: (-counts[s], _study_order(s)))


def write_plot(rows, out: Path, path: Path, published: Path) -> None:
    """Loss curves of the main study (plotted_study), one panel per depth (rows whose curve
    file is here)."""
    import logging

    import matplotlib

    # importing fairseq (for the --admin-init check) leaves the root logger at DEBUG
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if curve_path(out, r, published) is not None]
    if not rows:
        return
    study = plotted_study(rows)
    groups = {}
    for r in rows:
        if r["study"] == study:
            groups.setdefault(r["depth"], []).append(r)
    keys = sorted(groups, key=depth_order)
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4.5), squeeze=False)
    colors = SCHEME_COLORS
    pos_colors = {"sinusoidal": "tab:green", "scaled-sinusoidal": "tab:olive",
                  "scaled-sinusoidal-seed": "tab:brown", "learned": "tab:cyan"}
    for ax, k in zip(axes[0], keys):
        ent = None
        first_seed = {}
        by_pos = len({r["positions"] for r in groups[k]}) > 1
        for r in sorted(groups[k], key=_row_order):
            name = r["positions"] if by_pos else recipe_label(r)
            # later seeds: same colour, lighter, so the variants stay readable
            alpha = 1.0 if first_seed.setdefault(name, r["seed"]) == r["seed"] else 0.4
            curve = json.loads(curve_path(out, r, published).read_text())
            c = (pos_colors if by_pos else colors).get(name if by_pos else r["scheme"], "black")
            ls = ":" if not by_pos and name != r["scheme"] else "-"  # another lr / warmup
            label = f"{name} s{r['seed']} ({r['status']}, BLEU {r['bleu'] or '-'})"
            ax.plot([p["update"] for p in curve["train"]], [p["nll"] for p in curve["train"]],
                    color=c, lw=1.1, ls=ls, alpha=alpha, label=label)
            ax.plot([p["update"] for p in curve["valid"]], [p["nll"] for p in curve["valid"]],
                    color=c, ls="--", marker="o", ms=3, alpha=alpha)
            ent = float(r["unigram_entropy_bits"])
        if ent is not None:
            ax.axhline(ent, color="gray", lw=0.8, ls=":", label="unigram entropy")
        ax.set_title(f"{k}; {study_title([r for r in rows if r['study'] == study])}"
                     + ("\n(Admin, position variants)" if by_pos else ""), fontsize=9)
        ax.set_xlabel("update")
        ax.set_ylabel("nll (bits/token): train solid, valid dashed")
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_omega_plot(rows, path: Path, depth: str = "24L-3L") -> bool:
    """Omega against sub-layer index at ``depth``, one line per omega source (the first seed
    of each scheme with recorded omegas): at initialisation solid, after the last update
    dashed; encoder and decoder in two panels. False (nothing drawn) without such rows."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = {}
    for r in sorted(rows, key=_row_order):
        if r["depth"] == depth and r.get("init_omegas") and r["positions"] == "sinusoidal":
            chosen.setdefault((r["scheme"], r["lr"], r["warmup"]), r)
    if not chosen:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 1]})
    cmap = plt.get_cmap("tab20")
    for i, ((scheme, lr, warmup), r) in enumerate(chosen.items()):
        init = json.loads(r["init_omegas"])
        final = json.loads(r["final_omegas"]) if r.get("final_omegas") else {}
        label = f"{recipe_label(r)} s{r['seed']} (BLEU {r['bleu'] or '-'})"
        for ax, stack in zip(axes, ("encoder", "decoder")):
            if stack in init:
                ax.plot(range(1, len(init[stack]) + 1), init[stack], color=cmap(i % 20),
                        lw=1.2, label=label if stack == "encoder" else None)
            if stack in final:
                ax.plot(range(1, len(final[stack]) + 1), final[stack], color=cmap(i % 20),
                        lw=1.0, ls="--")
    enc, dec = parse_depth(depth)
    for ax, stack, n in zip(axes, ("encoder", "decoder"), (2 * enc, 3 * dec)):
        ax.axhline(closed_form(n), color="gray", ls=":", lw=1.0,
                   label=f"closed form O(logn), N={n}: {closed_form(n):.3f}")
        ax.set_title(f"{depth} {stack}: omega per sub-layer\n(solid: initial; dashed: final, "
                     "mean of the vector)", fontsize=9)
        ax.legend(fontsize=6)
        ax.set_xlabel("residual sub-layer (execution order)")
        ax.set_ylabel("omega")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_speed_quality_plot(points, path: Path, xlabel: str) -> bool:
    """The deep-shallow cells as a picture: one point per scheme x shape (``points``: dicts with
    scheme, shape, x = deployed sentences/s, y = mean BLEU, yerr = its sample std over seeds,
    n = seeds, exported = False where the speed is the plugin's), x on a log scale. False
    (nothing drawn) without points."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not points:
        return False
    fig, ax = plt.subplots(figsize=(8, 5.5))
    seen = set()
    for p in points:
        c = SCHEME_COLORS.get(p["scheme"], "black")
        label = p["scheme"] if p["scheme"] not in seen else None
        seen.add(p["scheme"])
        ax.errorbar([p["x"]], [p["y"]], yerr=[p["yerr"]], fmt="o" if p["exported"] else "s",
                    color=c, mfc=c if p["exported"] else "white", capsize=3, label=label)
        ax.annotate(f"{p['shape']} (n={p['n']})", (p["x"], p["y"]), fontsize=7,
                    xytext=(4, 4), textcoords="offset points", color=c)
    if not all(p["exported"] for p in points):
        ax.plot([], [], "s", mfc="white", color="gray",
                label="plugin speed (scheme not exportable)")
    ax.set_xscale("log")
    ax.set_xlabel(f"deployed sentences/s ({xlabel}; log scale)")
    ax.set_ylabel("sacreBLEU test2016, mean over seeds (+- sample std)")
    ax.set_title("Deep encoder, shallow decoder at the demo schedule (lr 2e-3, warmup 400, "
                 "700 updates): speed against quality", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
