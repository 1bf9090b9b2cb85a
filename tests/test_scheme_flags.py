"""The scheme table (fairseq_admin_pos/scheme_flags.py): one name, one model, read by
``make demo``, the depth study, ``fairseq-admin-analyze`` and the recipes."""
from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from fairseq_cli_utils import REPO, env
from fairseq_admin_pos import scheme_flags
from fairseq_admin_pos.scheme_flags import SCHEMES, TABLE, SchemeNameError

ADMIN = ["--admin-init", "closed-form", "--admin-omega", "parameter"]
ADMIN_PAPER = ["--admin-init", "profile", "--admin-profile-mode", "clinic", "--admin-omega",
               "parameter", "--optimizer", "radam", "--radam-early-steps", "skip"]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "fairseq_admin_pos.scheme_flags", *args],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=60)


def test_demo_and_study_schemes_keep_their_flags():
    """The depth study names its runs after these flags and the demo records them: written
    out here, in order, so that a change to the table shows."""
    assert list(SCHEMES.items()) == [
        ("post-ln", ["--admin-init", "none"]),
        ("pre-ln", ["--admin-init", "none", "--encoder-normalize-before",
                    "--decoder-normalize-before"]),
        ("admin", ADMIN),
        ("admin-paper", ADMIN_PAPER),
        ("deepnorm", ["--admin-residual", "deepnorm"]),
    ]
    # the study's eval-mode profile and the rivals, as benchmarks/depthstudy/plan.py has them
    assert TABLE["admin-profile"].flags == ["--admin-init", "profile", "--admin-profile-mode",
                                            "eval", "--admin-omega", "parameter"]
    assert TABLE["pre-ln-dyt"].flags == SCHEMES["pre-ln"] + ["--admin-norm", "dyt"]
    assert TABLE["mix-ln-dyt"].flags == ["--admin-residual", "mix-ln", "--admin-norm", "dyt"]


def test_optimizer_flags_over_the_default():
    """A scheme's own optimizer flags come first and win; Adam's defaults fill in the rest."""
    assert scheme_flags.optimizer_flags("admin") == list(scheme_flags.DEFAULT_OPTIMIZER)
    assert scheme_flags.optimizer_flags("admin-paper") == [
        "--optimizer", "radam", "--radam-early-steps", "skip", "--adam-betas", "(0.9, 0.98)",
        "--clip-norm", "0.0"]
    assert scheme_flags.optimizer_flags("post-ln-paper") == \
        scheme_flags.optimizer_flags("admin-paper")
    assert scheme_flags.optimizer_flags("kasai") == [
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "25.0"]
    assert scheme_flags.train_flags("pre-ln") == SCHEMES["pre-ln"] + list(
        scheme_flags.DEFAULT_OPTIMIZER)


def test_unknown_names_are_one_line():
    with pytest.raises(SchemeNameError) as info:
        scheme_flags.scheme("admin-closed-form", ["post-ln", "admin"], "SCHEME")
    assert str(info.value) == ("SCHEME 'admin-closed-form' is not valid (admin-closed-form is "
                               "now called admin); valid choices: post-ln admin")
    with pytest.raises(SchemeNameError, match="^scheme 'rezero' is not valid; valid choices: "
                                              "post-ln admin$"):
        scheme_flags.scheme("rezero", ["post-ln", "admin"])
    with pytest.raises(SchemeNameError, match="unknown scheme names among the choices: nope"):
        scheme_flags.scheme("admin", ["admin", "nope"])


def test_command_line_prints_shell_words_and_refuses_in_one_line():
    out = cli("admin-paper")
    assert out.returncode == 0, out.stderr
    assert shlex.split(out.stdout) == scheme_flags.train_flags("admin-paper")
    assert "'(0.9, 0.98)'" in out.stdout  # quoted for the shell
    assert shlex.split(cli("--part", "model", "admin").stdout) == ADMIN
    assert shlex.split(cli("--part", "optimizer", "kasai").stdout)[-2:] == ["--clip-norm", "25.0"]
    model, optimizer = cli("--part", "lines", "admin-paper").stdout.splitlines()
    assert shlex.split(model) == list(TABLE["admin-paper"].model)
    assert shlex.split(optimizer) == scheme_flags.optimizer_flags("admin-paper")
    bad = cli("--setting", "SCHEME", "--choices", "post-ln admin admin-paper", "kasai")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == ("error: SCHEME 'kasai' is not valid; valid choices: post-ln admin "
                          "admin-paper\n")
    listing = cli("--list").stdout.splitlines()
    assert [line.split()[0] for line in listing[::2]] == list(TABLE)


def test_importing_the_table_imports_neither_torch_nor_fairseq():
    code = ("import sys, fairseq_admin_pos.scheme_flags, fairseq_admin_pos.cli.demo; "
            "print(sorted(m for m in ('torch', 'fairseq') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(), capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_tools_read_the_table():
    from fairseq_admin_pos.cli import analyze, demo
    from fairseq_admin_pos.cli.analysis import variants

    assert analyze.VARIANTS is variants.VARIANTS

    assert demo.SCHEMES is SCHEMES
    args = demo.build_parser().parse_args(["--scheme", "admin-paper"])
    cmd = [str(c) for c in demo.train_command(args, "BIN", "SAVE")]
    at = cmd.index("--admin-init")
    assert cmd[at:at + len(ADMIN_PAPER)] == ADMIN_PAPER
    assert cmd.count("--optimizer") == 1
    args = demo.build_parser().parse_args([])
    assert args.scheme == "admin"
    cmd = [str(c) for c in demo.train_command(args, "BIN", "SAVE")]
    assert cmd[cmd.index("--optimizer") + 1] == "adam" and " ".join(ADMIN) in " ".join(cmd)
    for name, variant in variants.VARIANTS.items():
        assert variant.model_args == TABLE[name].model, name
        assert variant.label == TABLE[name].label
        assert (variant.prepare is not None) == name.startswith(("admin-paper", "admin-profile"))
    assert variants.DEFAULT_VARIANTS == ("post-ln", "pre-ln", "admin", "admin-profile")
    assert "admin-closed-form" not in variants.VARIANTS


@pytest.mark.parametrize("name", list(TABLE))
def test_every_scheme_is_a_valid_model(tiny_data, name):
    """Each scheme's flags, with its optimizer over Adam's defaults, pass fairseq-train's
    parser and the plugin's checks, and build the model they name."""
    import model_utils
    from fairseq_admin_pos.models.flags import check_flags

    args = model_utils.parse(tiny_data, "admin_transformer_tiny",
                             scheme_flags.train_flags(name))
    check_flags(args)
    model = model_utils.build(tiny_data, "admin_transformer_tiny",
                              scheme_flags.train_flags(name))[0]
    settings = model.admin_settings
    s = TABLE[name]
    for flag in ("--admin-residual", "--admin-init"):
        if flag in s.model:
            assert settings[flag[2:].replace("-", "_")] == s.model[s.model.index(flag) + 1]
    # Admin's omega is a trainable vector in every scheme where it applies
    assert settings["admin_omega"] == ("parameter" if settings["admin_init"] != "none"
                                       else "buffer")
    assert args.optimizer == ("radam" if "radam" in s.optimizer else "adam")
