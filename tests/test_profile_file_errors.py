"""Every ``--admin-profile-path`` file error (and RAdam's setting errors) through
``fairseq-train`` as a user meets it: one ``fairseq-train: error: --admin-profile-path
FILE: ...`` line on stderr, exit status 2,
no traceback, found before training (no update logged), and nothing left behind (no save
directory, no ``crash.pt``).

The file is read and checked when fairseq builds the model, after fairseq made the save
directory: the flag-error patch (fairseq_admin_pos/fairseq_fixes/flag_errors.py) removes it
again. Each case is a file a user can really have: a truncated JSON, a profile of another
depth, NaN or negative omegas (a diverged measurement), a profile measured with other
settings, and a malformed Transformer-Clinic ``profile.ratio.init``.
"""
from __future__ import annotations

import json

import pytest

from fairseq_cli_utils import TINY_MODEL, assert_one_line_error, files_under, train
from fairseq_admin_pos import profiling

PROFILE = ["--admin-init", "profile"]
# TINY_MODEL: 2 encoder layers (4 omegas), 2 decoder layers (6 omegas)
ENC, DEC = [1.0, 1.5, 1.7, 1.9], [1.0, 1.2, 1.3, 1.4, 1.5, 1.6]


def _json(omegas=None, settings=None) -> str:
    return json.dumps({"format": profiling.PROFILE_FORMAT, "version": 2,
                       "omegas": omegas or {"encoder": ENC, "decoder": DEC},
                       "settings": settings or {}})


# (file name, file text, extra flags, the message after "<file>: ")
CASES = {
    "broken-json": (
        "p.json", _json()[:40], [],
        "invalid JSON ({})"),  # filled with json's own message for the same text
    "omega-count": (
        "p.json", _json({"encoder": ENC[:2], "decoder": DEC}), [],
        "the admin profile has 2 encoder and 6 decoder omegas but the model has 4 encoder "
        "(2 layers) and 6 decoder (2 layers) residual sub-layers (one omega per sub-layer: 2 "
        "per encoder layer, 3 per decoder layer). Use a profile measured for this "
        "architecture, or another --admin-profile-path to measure a new one."),
    "nan-omega": (
        "p.json", _json({"encoder": [1.0, float("nan"), 1.2, 1.3], "decoder": DEC}), [],
        "encoder omega 2 is nan; every omega must be a positive finite number (a profile "
        "with NaN, infinite, zero or negative omegas comes from a diverged or broken "
        "measurement: measure it again)"),
    "negative-omega": (
        "p.json", _json({"encoder": ENC, "decoder": [1.0, -1.2, 1.3, 1.4, 1.5, 1.6]}), [],
        "decoder omega 2 is -1.2; every omega must be a positive finite number (a profile "
        "with NaN, infinite, zero or negative omegas comes from a diverged or broken "
        "measurement: measure it again)"),
    "other-settings": (
        "p.json", _json(settings={"encoder_embed_dim": 999}), [],
        None),  # the message lists the differing setting; checked by substring below
    "malformed-clinic": (
        "profile.ratio.init", "1 1.0\n2 1.4\n3 x\n", [],
        "line 3 is '3 x'; a Transformer-Clinic profile has lines 'index value' and a "
        "fairseq_admin_pos profile is JSON"),
}


@pytest.mark.parametrize("name,text,extra,message", list(CASES.values()), ids=list(CASES))
def test_profile_file_error_is_one_line_before_training(tiny_data, tmp_path, name, text,
                                                         extra, message):
    path = tmp_path / name
    path.write_text(text)
    save = tmp_path / "ck"
    proc = train(tiny_data, save, "admin_transformer",
                 TINY_MODEL + PROFILE + ["--admin-profile-path", path] + extra, check=False)
    prefix = f"--admin-profile-path {path}: "
    if message == "invalid JSON ({})":
        with pytest.raises(json.JSONDecodeError) as e:
            json.loads(text)
        message = message.format(e.value)
    if message is None:
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"fairseq-train: error: {prefix}"), proc.stderr[-3000:]
        assert "--encoder-embed-dim: file 999, flags 32" in last
        message = last[len("fairseq-train: error: ") + len(prefix):]
    assert_one_line_error(proc, "fairseq-train", prefix + message)
    assert "train_inner" not in proc.stdout + proc.stderr  # not a single update
    assert not save.exists(), files_under(save)  # made by fairseq, removed again
    assert [p.name for p in tmp_path.rglob("crash.pt")] == []
    assert path.read_text() == text  # the user's file is left as it was


# the optimizer's own checks (fairseq builds it after the model): the same one line
OPTIMIZER_CASES = {
    "radam-negative-eps": (["--adam-eps", "-1"], "--adam-eps must be a finite number >= 0; "
                                                 "got -1.0"),
    "radam-negative-weight-decay": (["--weight-decay", "-0.5"],
                                    "--weight-decay must be a finite number >= 0; got -0.5"),
}


@pytest.mark.parametrize("extra,message", list(OPTIMIZER_CASES.values()),
                         ids=list(OPTIMIZER_CASES))
def test_radam_setting_error_is_one_line_before_training(tiny_data, tmp_path, extra, message):
    save = tmp_path / "ck"
    proc = train(tiny_data, save, "admin_transformer",
                 TINY_MODEL + ["--optimizer", "radam"] + extra, check=False)
    assert_one_line_error(proc, "fairseq-train", message)
    assert "train_inner" not in proc.stdout + proc.stderr
    assert not save.exists(), files_under(save)
