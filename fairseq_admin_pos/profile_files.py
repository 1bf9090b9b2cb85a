"""Admin profile files: the package's JSON and Transformer-Clinic's ``profile.ratio.init``
(pure Python and torch, no fairseq).

* :func:`save_profile` writes JSON (format ``fairseq_admin_pos.admin_profile``, version 2)
  atomically: the omegas per stack, the measured variances (from the moments of
  :mod:`fairseq_admin_pos.profiling`, when given) and the settings they were measured with;
* :func:`load_profile` reads that (version 1, written before the profiling modes existed,
  was measured in eval mode and is read as such) or a Clinic ``profile.ratio.init`` (lines
  ``index value``: encoder ``1..2N`` then decoder ``1..3M``, the index restarting at 1 for
  the decoder; :func:`parse_clinic_profile`), checking every omega (positive, finite);
* :func:`check_profile_counts` and :func:`compare_settings` turn a profile of another depth
  or of other settings into an error that names the file and every difference.

Every problem is a :class:`~fairseq_admin_pos.errors.ProfileFileError` whose one-line message
starts with the file; the fairseq glue prefixes the flag (``--admin-profile-path``).
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from fairseq_admin_pos.errors import ProfileFileError
from fairseq_admin_pos.profile_stats import COUNT, SHORTCUT, variances_from_moments

PROFILE_FORMAT = "fairseq_admin_pos.admin_profile"
PROFILE_VERSION = 2
#: the versions :func:`load_profile` reads (1: before the modes; measured in eval mode)
READABLE_VERSIONS = (1, 2)


def save_profile(
    path: str,
    omegas: Mapping[str, Sequence[float]],
    settings: Mapping[str, object],
    moments: Optional[Mapping[str, torch.Tensor]] = None,
) -> None:
    """Write a JSON profile atomically (temporary file in the same folder, then rename), so a
    reader never sees half a file and concurrent writers leave one complete file."""
    data = {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "omegas": {k: [float(v) for v in vals] for k, vals in omegas.items()},
        "settings": dict(settings),
    }
    if moments is not None:
        stats = {}
        for name, m in moments.items():
            vx, vf = variances_from_moments(m)
            stats[name] = {
                "shortcut_variance": vx,
                "branch_variance": vf,
                "counted_elements": [float(c) for c in m[:, SHORTCUT, COUNT].tolist()],
            }
        data["variances"] = stats
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def parse_clinic_profile(text: str, path: str = "<text>") -> Dict[str, List[float]]:
    """Transformer-Clinic's ``profile.ratio.init``: lines ``index value``, encoder indices
    ``1..2N`` then decoder indices ``1..3M`` (the index restarts at 1 for the decoder)."""
    segments: List[List[float]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            index_f, value = float(parts[0]), float(parts[1])
        except ValueError:
            raise ProfileFileError(
                f"{path}: line {lineno} is {line.strip()!r}; a Transformer-Clinic profile has "
                "lines 'index value' and a fairseq_admin_pos profile is JSON"
            ) from None
        index = int(index_f)
        if index != index_f or index < 1:
            raise ProfileFileError(f"{path}: line {lineno}: index {parts[0]!r} is not a positive integer")
        if not math.isfinite(value) or value <= 0:
            raise ProfileFileError(f"{path}: line {lineno}: omega {parts[1]!r} is not a positive finite number")
        if index == 1:
            segments.append([])
        elif not segments or index != len(segments[-1]) + 1:
            expected = len(segments[-1]) + 1 if segments else 1
            raise ProfileFileError(
                f"{path}: line {lineno}: index {index} where {expected} was expected (encoder "
                "indices 1..2N then decoder indices 1..3M)"
            )
        segments[-1].append(value)
    if len(segments) != 2:
        raise ProfileFileError(
            f"{path}: found {len(segments)} index run(s) starting at 1; a Transformer-Clinic "
            "profile has two (encoder 1..2N, then decoder 1..3M)"
        )
    return {"encoder": segments[0], "decoder": segments[1]}


def _check_omega_values(path: str, omegas: object) -> Dict[str, List[float]]:
    """``{stack: [positive finite floats]}`` or a :class:`ProfileFileError` naming the entry."""
    if not isinstance(omegas, dict) or not omegas:
        raise ProfileFileError(
            f"{path}: 'omegas' must map stack names (encoder, decoder) to lists of omegas; "
            f"got {type(omegas).__name__}"
        )
    out = {}
    for stack, values in omegas.items():
        if not isinstance(values, list):
            raise ProfileFileError(f"{path}: omegas[{stack!r}] must be a list of numbers")
        for i, v in enumerate(values):
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not ok or not math.isfinite(v) or v <= 0:
                raise ProfileFileError(
                    f"{path}: {stack} omega {i + 1} is {v!r}; every omega must be a positive "
                    "finite number (a profile with NaN, infinite, zero or negative omegas "
                    "comes from a diverged or broken measurement: measure it again)"
                )
        out[stack] = [float(v) for v in values]
    return out


def load_profile(path: str) -> Tuple[Dict[str, List[float]], Dict[str, object], str]:
    """Read ``(omegas per stack, settings, kind)``; ``kind`` is ``"json"`` or ``"clinic"``.

    Every omega is checked (positive and finite). The settings of a version-1 JSON file
    (written before the profiling modes existed) are completed with what that code did:
    ``admin_profile_mode = "eval"`` and ``admin_profile_include_padding`` from its
    ``include_padding``. A Clinic file has no settings (``{}``).
    """
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ProfileFileError(f"{path}: cannot read the admin profile ({e})") from None
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileFileError(f"{path}: invalid JSON ({e})") from None
        if data.get("format") != PROFILE_FORMAT:
            raise ProfileFileError(
                f"{path}: JSON with format {data.get('format')!r}; expected {PROFILE_FORMAT!r}"
            )
        version = data.get("version")
        if version not in READABLE_VERSIONS:
            raise ProfileFileError(
                f"{path}: profile version {version!r}; this code reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}"
            )
        omegas = _check_omega_values(path, data.get("omegas"))
        settings = data.get("settings", {})
        if not isinstance(settings, dict):
            raise ProfileFileError(f"{path}: 'settings' must be an object")
        settings = dict(settings)
        if version == 1:  # the code of version 1 profiled in eval mode only
            settings.setdefault("admin_profile_mode", "eval")
            if "include_padding" in settings:
                settings.setdefault("admin_profile_include_padding",
                                    bool(settings.pop("include_padding")))
        return omegas, settings, "json"
    return parse_clinic_profile(text, path), {}, "clinic"


def compare_settings(
    path: str,
    file_settings: Mapping[str, object],
    model_settings: Mapping[str, object],
    keys: Sequence[str],
) -> None:
    """Raise :class:`ProfileFileError` listing every key of ``keys`` whose value in the
    profile file differs from the model's (``--flag: file X, flags Y``; keys are argument
    names, so the flag is ``--`` + the key with dashes). A key the file does not record
    (an older file) is not compared."""
    diffs = [
        f"--{k.replace('_', '-')}: file {file_settings[k]!r}, flags {model_settings.get(k)!r}"
        for k in keys
        if k in file_settings and file_settings[k] != model_settings.get(k)
    ]
    if diffs:
        raise ProfileFileError(
            f"{path}: the admin profile was measured with other settings than the flags "
            "given (" + "; ".join(diffs) + "). Use a profile measured with these settings, "
            "or another --admin-profile-path to measure a new one."
        )


def check_profile_counts(
    path: str,
    omegas: Mapping[str, Sequence[float]],
    expected: Mapping[str, int],
    layers: Optional[Mapping[str, int]] = None,
) -> None:
    """Raise :class:`ProfileFileError` naming the file and both sets of counts when the
    profile's number of omegas per stack differs from the model's residual sub-layers."""
    got = {k: len(omegas.get(k, [])) for k in expected}
    extra = sorted(set(omegas) - set(expected))
    if got == dict(expected) and not extra:
        return
    have = " and ".join(f"{n} {k}" for k, n in got.items())
    want = " and ".join(
        f"{n} {k}" + (f" ({layers[k]} layers)" if layers and k in layers else "")
        for k, n in expected.items()
    )
    msg = (
        f"{path}: the admin profile has {have} omegas but the model has {want} residual "
        "sub-layers (one omega per sub-layer: 2 per encoder layer, 3 per decoder layer)"
    )
    if extra:
        msg += f"; unknown stacks in the file: {', '.join(extra)}"
    raise ProfileFileError(
        msg + ". Use a profile measured for this architecture, or another "
        "--admin-profile-path to measure a new one."
    )
