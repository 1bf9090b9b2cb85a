"""Reading fairseq-train's ``--log-format json`` log: the loss curves and a run's verdict."""
from __future__ import annotations

import json
import math
import re

LOG_RE = re.compile(r"\| (train_inner|train|valid) \| (\{.*\})\s*$")


#: per-stack gradient norms of fairseq_admin_pos.models.monitoring, kept in the curves
GNORM_KEYS = ("enc_gnorm", "dec_gnorm", "emb_gnorm")
#: the monitor's encoder token cosine (collapse as it happens), kept in the curves too
CURVE_KEYS = GNORM_KEYS + ("enc_tok_cos",)


def gnorm_summary(curve, warmup: int) -> dict:
    """Mean of each logged per-stack gradient norm over the warmup updates and after them
    (``{key: [warmup mean, after mean]}``; keys the log lacks are left out)."""
    out = {}
    for k in GNORM_KEYS:
        early = [p[k] for p in curve["train"] if k in p and p["update"] <= warmup]
        late = [p[k] for p in curve["train"] if k in p and p["update"] > warmup]
        if early or late:
            out[k] = [round(sum(v) / len(v), 3) if v else None for v in (early, late)]
    return out


def parse_curve(text: str):
    curve = {"train": [], "valid": []}
    for line in text.splitlines():
        m = LOG_RE.search(line)
        if not m:
            continue
        tag, stats = m.group(1), json.loads(m.group(2))

        def num(key):
            try:
                return float(stats[key])
            except (KeyError, ValueError, TypeError):
                return float("nan")

        if tag == "train_inner":
            point = {"update": int(num("num_updates")), "loss": num("loss"),
                     "nll": num("nll_loss")}
            # the training monitor's per-stack gradient norms and encoder token cosine
            # (older logs without them: none)
            for k in CURVE_KEYS:
                if k in stats:
                    point[k] = num(k)
            curve["train"].append(point)
        elif tag == "valid":
            curve["valid"].append({
                "update": int(num("valid_num_updates")), "loss": num("valid_loss"),
                "nll": num("valid_nll_loss"), "ppl": num("valid_ppl"),
            })
    return curve


def classify(curve, crashed_nan: bool, unigram_bits: float, stuck_bits: float,
             diverge_bits: float):
    """(status, reason) of a run; see the module docstring."""
    train = [p for p in curve["train"]]
    valid = [p for p in curve["valid"]]
    values = [p["nll"] for p in train] + [p["nll"] for p in valid] + \
             [p["loss"] for p in train] + [p["loss"] for p in valid]
    if crashed_nan or any(not math.isfinite(v) for v in values):
        return "nan", "NaN/Inf loss or gradients (fairseq FloatingPointError)"
    if not train or not valid:
        return "error", "no train/valid statistics in the log"
    last, lowest = train[-1]["nll"], min(p["nll"] for p in train)
    if last > lowest + diverge_bits:
        return "diverged", (f"train nll {last:.2f} bits at update {train[-1]['update']} is "
                            f"> {diverge_bits} above its minimum {lowest:.2f}")
    best_valid = min(p["nll"] for p in valid)
    if best_valid > unigram_bits - stuck_bits:
        return "stuck", (f"best valid nll {best_valid:.2f} bits is not {stuck_bits} bits below "
                         f"the unigram entropy {unigram_bits:.2f}")
    return "trained", (f"best valid nll {best_valid:.2f} bits, "
                       f"{unigram_bits - best_valid:.2f} below the unigram entropy")
