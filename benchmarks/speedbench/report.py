"""The Markdown tables of ``speed_vs_stock.py``: one per dtype and depth, ratios side by side."""
from __future__ import annotations

from typing import Dict, List, Optional


def _fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b in (None, 0) else a / b


def table(rows: List[Dict], cuda: bool) -> List[str]:
    """One depth of one dtype: a row per variant, ratios against stock."""
    stock = next(r for r in rows if r["variant"] == "stock")
    head = ["variant", "step ms", "words/s", "x stock", "MFU", "aten ops/step",
            "host reads/step"]
    if cuda:
        head += ["launches/step", "kernels/step", "syncs/step"]
    head += ["peak MiB", "gen sent/s", "gen x stock"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["variant"], _fmt(r["step_ms"], ".1f"), _fmt(r["words_per_s"], ",.0f"),
                 _fmt(_ratio(r["words_per_s"], stock["words_per_s"]), ".3f"),
                 _fmt(100 * r["mfu"], ".2f") + "%", str(r["aten_ops"]), str(r["host_reads"])]
        if cuda:
            cells += [str(r["launches"]), str(r["kernels"]), str(r["syncs"])]
        cells += [_fmt(r["peak_mib"], ".1f"), _fmt(r["gen_sent_per_s"], ".1f"),
                  _fmt(_ratio(r["gen_sent_per_s"], stock["gen_sent_per_s"]), ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def targets(rows: List[Dict]) -> List[str]:
    """The issue's ratios: admin / stock and admin / the faster of B2T and ResiDual (words/s)
    and aten ops per step admin / stock; the LayerNorm placements and DyT / stock, and DyT
    against Pre-LN with LayerNorm."""
    by = {r["variant"]: r for r in rows}
    out = []
    if "admin" in by:
        a = by["admin"]
        out.append(f"admin / stock: words/s {a['words_per_s'] / by['stock']['words_per_s']:.3f}, "
                   f"aten ops/step {a['aten_ops'] / by['stock']['aten_ops']:.3f}")
        rivals = [by[v]["words_per_s"] for v in ("b2t", "resi-dual") if v in by]
        if rivals:
            out.append(f"admin / max(b2t, resi-dual): words/s "
                       f"{a['words_per_s'] / max(rivals):.3f}")
        if "admin-compiled" in by:
            c = by["admin-compiled"]
            out.append(f"admin-compiled / admin: words/s {c['words_per_s'] / a['words_per_s']:.3f}"
                       f"; MFU {100 * a['mfu']:.2f}% -> {100 * c['mfu']:.2f}%")
    # the LayerNorm placements and DyT against stock, DyT against its LayerNorm twin
    for v in ("pre-ln", "peri-ln", "mix-ln", "pre-ln-dyt"):
        if v in by:
            out.append(f"{v} / stock: words/s "
                       f"{by[v]['words_per_s'] / by['stock']['words_per_s']:.3f}")
    if "pre-ln-dyt" in by and "pre-ln" in by:
        out.append(f"pre-ln-dyt / pre-ln (DyT's cost over LayerNorm): words/s "
                   f"{by['pre-ln-dyt']['words_per_s'] / by['pre-ln']['words_per_s']:.3f}")
    return out


def markdown(summary: Dict) -> str:
    hw = summary["hardware"]
    cuda = summary["device"] == "cuda"
    s = summary["settings"]
    where = (f"{hw['gpu']} (CUDA {hw['cuda']})" if cuda else
             f"{hw['cpu']}, {hw['cores']} cores, {s['threads']} thread(s)")
    lines = [f"## speed_vs_stock: {where}, torch {hw['torch']}, Python {hw['python']}", "",
             f"d={s['dim']}, FFN {4 * s['dim']}, {s['heads']} heads, max-tokens "
             f"{s['max_tokens']}, {s['warmup']} warm-up + {s['steps']} timed steps per variant "
             "(medians), same batches for all."]
    for res in summary["results"]:
        lines.append(f"Matrix rate measured ({res['dtype']}, {res['matmul_size']}^2 matmul): "
                     f"{res['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s.")
    for res in summary["results"]:
        depths = sorted({r["layers"] for r in res["rows"]})
        for depth in depths:
            rows = [r for r in res["rows"] if r["layers"] == depth]
            stock = rows[0]
            lines += ["", f"### {depth}L-{depth}L {res['dtype']} ({stock['tflop_per_step']:.3f} "
                      f"TFLOP and {stock['tokens_per_step']:.0f} target tokens per step, median)",
                      ""]
            lines += table(rows, cuda)
            lines += [""] + targets(rows)
    return "\n".join(lines)
