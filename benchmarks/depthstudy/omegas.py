"""Omegas of a run at initialisation, and the omega files of ``plan.OMEGA_VARIANTS``.

A variant's omegas start from the run's own Clinic profile: ``fairseq-train`` of admin-paper at
the same depth and seed, stopped after one update, with ``--admin-profile-path`` writing the
measured profile (the package's JSON; the profiling pass is the first training forward, so
these are exactly the omegas admin-paper trains from). The variant's rule (per stack, with
``closed`` admin-torch's O(logn) value ``sqrt((N+1)/ln(N+1) - 1)`` for the stack's N residual
sub-layers) gives new omegas, written to a profile file with the same settings, which the
training run reads through ``--admin-profile-path``.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Dict, List


def closed_form(n_sublayers: int) -> float:
    """admin-torch's O(logn) omega: ``sqrt((N+1)/ln(N+1) - 1)`` (its ``calculate_init``)."""
    n = n_sublayers
    return math.sqrt((n + 1) / math.log(n + 1) - 1)


def sublayer_counts(enc_layers: int, dec_layers: int) -> Dict[str, int]:
    return {"encoder": 2 * enc_layers, "decoder": 3 * dec_layers}


def variant_omegas(variant: str, profile: Dict[str, List[float]]) -> Dict[str, List[float]]:
    """The variant's omegas per stack from the measured ``profile`` (see plan.OMEGA_VARIANTS)."""
    out = {}
    for stack, values in profile.items():
        closed = closed_form(len(values))
        if variant == "admin-paper-floor":
            new = [max(v, closed) for v in values]
        elif variant == "admin-paper-closed-bottom":
            k = len(values) // 4
            new = [closed] * k + list(values[k:])
        elif variant == "admin-paper-max":
            new = [max(values)] * len(values)
        elif variant == "admin-paper-enc":
            new = list(values) if stack == "encoder" else [closed] * len(values)
        elif variant == "admin-paper-dec":
            new = list(values) if stack == "decoder" else [closed] * len(values)
        else:
            raise ValueError(f"unknown omega variant {variant!r}")
        out[stack] = [float(v) for v in new]
    return out


def write_variant_file(variant: str, measured: Path, dest: Path) -> Dict[str, List[float]]:
    """Read the measured profile file, write the variant's (same settings, the rule noted)."""
    data = json.loads(measured.read_text())
    omegas = variant_omegas(variant, data["omegas"])
    data["omegas"] = omegas
    data.pop("variances", None)  # they describe the measured omegas, not these
    data["settings"] = dict(data["settings"], study_omega_variant=variant)
    dest.write_text(json.dumps(data, indent=1) + "\n")
    return omegas


_PROFILE_LINE = re.compile(r"admin profile: (encoder|decoder) omegas ([0-9. ]+)")


def init_omegas(scheme_flags: List[str], log_text: str, enc_layers: int, dec_layers: int,
                profile_file: Path | None = None) -> Dict[str, List[float]]:
    """Each sub-layer's omega at initialisation: a file the run read, else the profile the
    run's log prints, else the closed form (``--admin-init closed-form``), else {}."""
    if profile_file is not None and profile_file.is_file():
        return {s: [round(v, 4) for v in vals]
                for s, vals in json.loads(profile_file.read_text())["omegas"].items()}
    logged = {m.group(1): [float(x) for x in m.group(2).split()]
              for m in _PROFILE_LINE.finditer(log_text)}
    if logged:
        return logged
    flags = " ".join(scheme_flags)
    if "--admin-init closed-form" in flags and "--admin-output-change-scale" not in flags:
        return {s: [round(closed_form(n), 4)] * n
                for s, n in sublayer_counts(enc_layers, dec_layers).items()}
    return {}
