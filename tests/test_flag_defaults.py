"""The defaults are the recommendation: ``fairseq-train --arch admin_transformer`` (and every
preset) with no scheme flag trains the scheme called ``admin`` everywhere else (closed-form
omegas, each a trainable vector), through the command a user types; where Admin's omega does
not apply (Post-LN, Pre-LN, the rivals) nothing changes: stock Post-LN stays stock."""
from __future__ import annotations

import pytest
import torch

import model_utils
from fairseq_cli_utils import TINY_MODEL, USER_DIR, generate, hypotheses, load_checkpoint, run
from fairseq_admin_pos.admin import calculate_init
from fairseq_admin_pos.scheme_flags import SCHEMES

# one update of SGD at learning rate 0: the checkpoint holds the initial weights exactly
FROZEN = ["--cpu", "--seed", "5", "--optimizer", "sgd", "--lr", "0", "--max-tokens", "400",
          "--max-update", "1", "--no-progress-bar", "--num-workers", "0",
          "--disable-validation", "--no-epoch-checkpoints",
          "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"]
# the preset's depth (12L-2L) at a test width
NARROW = ["--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
          "--encoder-attention-heads", "2", "--decoder-embed-dim", "32",
          "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2"]


def initial_state(data, save, arch, extra):
    run("fairseq_cli.train", [data, "--user-dir", USER_DIR, "--arch", arch, *FROZEN,
                              "--save-dir", save, *extra])
    return load_checkpoint(save / "checkpoint_last.pt")


@pytest.mark.parametrize("arch,size,layers", [
    ("admin_transformer", TINY_MODEL, (2, 2)),
    ("admin_transformer_wmt_en_de_12l_2l", NARROW, (12, 2)),
])
def test_no_scheme_flags_is_the_admin_scheme(tiny_data, tmp_path, arch, size, layers):
    default = initial_state(tiny_data, tmp_path / "default", arch, size)
    explicit = initial_state(tiny_data, tmp_path / "admin", arch, size + SCHEMES["admin"])
    a, b = default["model"], explicit["model"]
    assert a.keys() == b.keys()
    for key, value in a.items():
        if torch.is_tensor(value):
            assert value.shape == b[key].shape and torch.equal(value, b[key]), key
        else:
            assert value == b[key], key
    assert a["_extra_state"]["admin_init"] == "closed-form"
    assert a["_extra_state"]["admin_omega"] == "parameter"
    assert default["cfg"]["model"].admin_omega == "parameter"
    # the omegas: one trainable vector per sub-layer, filled with the closed form of its stack
    for stack, n, per_layer in (("encoder", layers[0], 2), ("decoder", layers[1], 3)):
        omegas = [v for k, v in a.items() if k.startswith(stack + ".") and k.endswith(".omega")]
        assert len(omegas) == n * per_layer
        expected = calculate_init(n * per_layer)  # omega itself (admin-torch's name)
        for w in omegas:
            assert w.shape == (32,)
            assert torch.allclose(w, torch.full_like(w, expected), rtol=0, atol=1e-6)


def test_where_omega_does_not_apply_nothing_changed(tiny_data):
    """--admin-init none (Post-LN, Pre-LN) and the rivals keep the fixed omega: stock Post-LN
    has the stock transformer's parameters and no trainable omega."""
    for extra in (SCHEMES["post-ln"], SCHEMES["pre-ln"], SCHEMES["deepnorm"],
                  ["--admin-residual", "peri-ln"]):
        model, _, args = model_utils.build(tiny_data, "admin_transformer_tiny", extra)
        assert args.admin_omega == "buffer", extra
        assert not [n for n, _ in model.named_parameters() if n.endswith(".omega")], extra
    post, _, _ = model_utils.build(tiny_data, "admin_transformer", TINY_MODEL + SCHEMES["post-ln"])
    stock, _, _ = model_utils.build(tiny_data, "transformer", TINY_MODEL)
    assert dict(post.named_parameters()).keys() == dict(stock.named_parameters()).keys()
    profiled = model_utils.parse(tiny_data, "admin_transformer_tiny", ["--admin-init", "profile"])
    assert profiled.admin_omega == "parameter"


def test_a_fixed_omega_checkpoint_still_loads(tiny_data, tmp_path):
    """A checkpoint trained with --admin-omega buffer (the earlier default) records it:
    fairseq-generate translates it with its scalar omegas, a resume with the same flag
    continues it, and a resume without the flag is one line naming --admin-omega."""
    save = tmp_path / "buffer"
    common = [tiny_data, "--user-dir", USER_DIR, "--arch", "admin_transformer", *TINY_MODEL,
              "--cpu", "--seed", "3", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens",
              "400", "--no-progress-bar", "--num-workers", "0", "--disable-validation",
              "--save-dir", save]
    run("fairseq_cli.train", common + ["--admin-omega", "buffer", "--max-update", "2"])
    state = load_checkpoint(save / "checkpoint_last.pt")["model"]
    assert state["_extra_state"]["admin_omega"] == "buffer"
    assert state["encoder.layers.0.self_attn_residual.omega"].shape == (1,)
    out = generate(tiny_data, save / "checkpoint_last.pt")
    assert len(hypotheses(out.stdout)) == 24
    resumed = run("fairseq_cli.train", common + ["--admin-omega", "buffer", "--max-update", "3"])
    assert "num_updates 3" in resumed.stdout + resumed.stderr
    refused = run("fairseq_cli.train", common + ["--max-update", "4"], check=False)
    assert refused.returncode == 2
    assert "--admin-omega: checkpoint 'buffer', flags 'parameter'" in refused.stderr.splitlines()[-1]


def test_every_registered_architecture_defaults_to_the_admin_scheme(tiny_data):
    from fairseq.models import ARCH_MODEL_INV_REGISTRY

    archs = ARCH_MODEL_INV_REGISTRY["admin_transformer"]
    assert len(archs) >= 16 and "admin_transformer_wmt_en_de_18l_18l" in archs
    for arch in archs:
        args = model_utils.parse(tiny_data, arch)
        assert (args.admin_residual, args.admin_init, args.admin_omega) == \
            ("admin", "closed-form", "parameter"), arch
