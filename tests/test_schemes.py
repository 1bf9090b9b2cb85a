"""DeepNorm and ReZero as ``--admin-residual`` choices: constants against the papers'
formulas, the initialisation, each scheme's behaviour at initialisation, flag errors, and
training + generation through fairseq's command-line tools."""
import math
import re

import pytest
import torch
import torch.nn.functional as F

from fairseq_admin_pos.schemes import (
    RESIDUAL_SCHEMES,
    Float32OmegaResidual,
    ReZeroResidual,
    deepnorm_constants,
    deepnorm_init_,
    xavier_normal_gain_,
)
from fairseq_cli_utils import (
    TINY_MODEL,
    USER_DIR,
    generate,
    hypotheses,
    load_model_state,
    run,
    train_losses,
)
from model_utils import SMALL, assert_incremental_matches_full, build, residuals, sample_batch


# --------------------------------------------------------------------------------------- #
# DeepNorm constants
# --------------------------------------------------------------------------------------- #
def paper_deepnorm(n: int, m: int):
    """DeepNet Table 1 (encoder-decoder), written literally: N^4 M under a 16th root."""
    enc_root = math.pow(math.pow(n, 4) * m, 1.0 / 16.0)
    return (0.81 * enc_root, 0.87 * math.pow(math.pow(n, 4) * m, -1.0 / 16.0),
            math.pow(3 * m, 0.25), math.pow(12 * m, -0.25))


@pytest.mark.parametrize("n,m", [(1, 1), (2, 3), (6, 6), (12, 12), (18, 18), (60, 12),
                                 (100, 100), (1000, 1000)])
def test_deepnorm_constants_match_formulas(n, m):
    got = deepnorm_constants(n, m)
    for g, want in zip(got, paper_deepnorm(n, m)):
        assert g == pytest.approx(want, rel=1e-12)
    assert got.encoder_alpha > 0 and 0 < got.decoder_beta <= 12 ** -0.25


def test_deepnorm_constants_hand_values():
    # by hand: 6L-6L: 6^(5/16) = 1.750541..., 18^(1/4) = 2.05977..., 72^(-1/4) = 0.34329...
    c = deepnorm_constants(6, 6)
    assert c.encoder_alpha == pytest.approx(0.81 * 1.750541, abs=1e-5)
    assert c.encoder_beta == pytest.approx(0.87 / 1.750541, abs=1e-5)
    assert c.decoder_alpha == pytest.approx(2.059767, abs=1e-5)
    assert c.decoder_beta == pytest.approx(0.343295, abs=1e-5)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "6", None])
def test_deepnorm_constants_reject_bad_layer_counts(bad):
    with pytest.raises(ValueError, match="encoder_layers must be a positive int"):
        deepnorm_constants(bad, 6)
    with pytest.raises(ValueError, match="decoder_layers must be a positive int"):
        deepnorm_constants(6, bad)


def test_xavier_normal_gain_statistics_and_errors():
    torch.manual_seed(0)
    w = torch.empty(256, 128)
    xavier_normal_gain_(w, 0.3)
    want = 0.3 * math.sqrt(2.0 / (256 + 128))
    assert w.std().item() == pytest.approx(want, rel=0.03)
    assert abs(w.mean().item()) < 3 * want / math.sqrt(w.numel())
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="gain must be a positive finite number"):
            xavier_normal_gain_(w, bad)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        xavier_normal_gain_(torch.empty(5), 1.0)
    with pytest.raises(ValueError, match="has none of the attentions"):
        deepnorm_init_(torch.nn.ReLU(), 0.5)


# --------------------------------------------------------------------------------------- #
# the model with each scheme
# --------------------------------------------------------------------------------------- #
WIDE = [  # wide enough that the empirical std of a weight matrix is within a few percent
    "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128", "--encoder-attention-heads", "2",
    "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "128", "--decoder-attention-heads", "2",
]


def _xavier_std(weight, gain):
    fan_out, fan_in = weight.shape
    return gain * math.sqrt(2.0 / (fan_in + fan_out))


@pytest.mark.parametrize("enc,dec", [(2, 1), (4, 3)])
def test_deepnorm_model_alpha_and_beta(tiny_data, enc, dec):
    model, _, args = build(tiny_data, "admin_transformer", WIDE + [
        "--encoder-layers", enc, "--decoder-layers", dec, "--admin-residual", "deepnorm"])
    assert args.admin_init == "none"  # DeepNorm's default: Admin's omega unused
    want = paper_deepnorm(enc, dec)
    for stack, alpha, beta in ((model.encoder, want[0], want[1]), (model.decoder, want[2], want[3])):
        mods = residuals(stack)
        assert len(mods) == (2 * enc if stack is model.encoder else 3 * dec)
        for mod in mods:
            assert isinstance(mod, Float32OmegaResidual) and not mod.as_parameter
            assert mod.omega.dtype == torch.float32
            assert mod.omega.item() == pytest.approx(alpha, rel=1e-6)
        # pool the weights of one kind over the stack: std = gain * sqrt(2 / (fan_in + fan_out))
        for attn_name in ("self_attn", "encoder_attn"):
            attns = [getattr(l, attn_name) for l in stack.layers if getattr(l, attn_name, None) is not None]
            if not attns:
                continue
            for proj, gain in (("q_proj", 1.0), ("k_proj", 1.0), ("v_proj", beta), ("out_proj", beta)):
                ws = [getattr(a, proj).weight for a in attns]
                got = torch.cat([w.detach().reshape(-1) for w in ws]).std().item()
                assert got == pytest.approx(_xavier_std(ws[0], gain), rel=0.06), (attn_name, proj)
        for fc in ("fc1", "fc2"):
            ws = [getattr(l, fc).weight for l in stack.layers]
            got = torch.cat([w.detach().reshape(-1) for w in ws]).std().item()
            assert got == pytest.approx(_xavier_std(ws[0], beta), rel=0.06), fc
        # biases as fairseq left them: attention output bias 0
        assert all(l.self_attn.out_proj.bias.abs().max() == 0 for l in stack.layers)


@pytest.mark.parametrize("scheme", ["rezero", "rezero-post-ln"])
def test_rezero_residuals_start_at_zero(tiny_data, scheme):
    model, _, _ = build(tiny_data, "admin_transformer", SMALL + [
        "--encoder-layers", "2", "--decoder-layers", "2", "--admin-residual", scheme])
    for stack, n in ((model.encoder, 4), (model.decoder, 6)):
        mods = residuals(stack)
        assert len(mods) == n and all(isinstance(m, ReZeroResidual) for m in mods)
        assert all(m.alpha.shape == (1,) and m.alpha.item() == 0.0 for m in mods)
        lns = [type(getattr(l, name)).__name__ for l in stack.layers
               for name in ("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")
               if getattr(l, name, None) is not None]
        assert set(lns) == ({"Identity"} if scheme == "rezero" else {"LayerNorm"})
    names = [k for k in model.state_dict() if "layer_norm" in k]
    assert (not names) == (scheme == "rezero")


def _embedding_output(stack, tokens):
    """Independent embedding output: sqrt(d) * E[tokens] + positions (time-major)."""
    d = stack.embed_tokens.embedding_dim
    x = math.sqrt(d) * stack.embed_tokens.weight[tokens] + stack.embed_positions(tokens)
    return x.transpose(0, 1)


def _layer_norm_chain(x, times):
    for _ in range(times):  # LN with weight 1, bias 0 (fairseq's init), eps 1e-5
        x = F.layer_norm(x, x.shape[-1:], eps=1e-5)
    return x


@pytest.mark.parametrize("scheme", ["rezero", "rezero-post-ln"])
def test_rezero_stacks_are_identity_at_init(tiny_data, scheme):
    """ReZero's claim: at initialisation every layer is the identity, so without LayerNorm
    the encoder output *is* the embedding output, and the decoder features are the target
    embedding output; with Post-LN each sub-layer is only its LayerNorm."""
    model, task, _ = build(tiny_data, "admin_transformer", SMALL + [
        "--encoder-layers", "3", "--decoder-layers", "2", "--admin-residual", scheme])
    model.eval()
    src, lengths, prev = sample_batch(task, bsz=3, src_len=7, tgt_len=5)
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=lengths)
        feats, _ = model.decoder(prev, encoder_out=enc, features_only=True)
        emb_src = _embedding_output(model.encoder, src)
        emb_tgt = _embedding_output(model.decoder, prev).transpose(0, 1)
    if scheme == "rezero":
        torch.testing.assert_close(enc["encoder_out"][0], emb_src, rtol=0, atol=1e-6)
        torch.testing.assert_close(feats, emb_tgt, rtol=0, atol=1e-6)
    else:
        torch.testing.assert_close(enc["encoder_out"][0], _layer_norm_chain(emb_src, 6),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(feats, _layer_norm_chain(emb_tgt, 6), rtol=1e-5, atol=1e-5)


def test_rezero_first_gradient_reaches_only_the_decoder_scalars(tiny_data):
    """With every a = 0 the branch weights get no gradient at the first step, only the
    decoder's scalars do; the encoder is reached through the decoder's encoder attention,
    whose a is 0 too, so it gets no gradient at all until that a moves."""
    model, task, _ = build(tiny_data, "admin_transformer", SMALL + [
        "--encoder-layers", "2", "--decoder-layers", "2", "--admin-residual", "rezero",
        "--dropout", "0"])
    src, lengths, prev = sample_batch(task)
    model(src, lengths, prev)[0].logsumexp(-1).sum().backward()
    for stack in (model.encoder, model.decoder):
        for layer in stack.layers:
            assert layer.fc1.weight.grad.abs().max() == 0
            assert layer.self_attn.v_proj.weight.grad.abs().max() == 0
    assert all(m.alpha.grad.abs().item() > 0 for m in residuals(model.decoder))
    assert all(m.alpha.grad.abs().item() == 0 for m in residuals(model.encoder))
    assert model.encoder.embed_tokens.weight.grad is None or \
        model.decoder.embed_tokens.weight.grad.abs().max() > 0


MID = [  # width 32: at 16 the Post-LN ratios are too noisy to compare with 4 seeds
    "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64", "--encoder-attention-heads", "2",
    "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2",
]


def _output_change(data, extra, layers, seeds=4, eps=1e-2):
    """Independent of the analysis tool: mean over seeds of |F(W+d) - F(W)|^2 / |F(W)|^2,
    F = decoder features of an L-L model in eval mode, d ~ N(0, eps^2) on every weight
    (a fixed-size step, as Adam takes)."""
    out = []
    for seed in range(seeds):
        model, task, _ = build(data, "admin_transformer", MID + [
            "--encoder-layers", layers, "--decoder-layers", layers, "--dropout", "0", *extra],
            seed=seed)
        model.eval()
        src, lengths, prev = sample_batch(task, bsz=4, src_len=8, tgt_len=6, seed=seed)
        with torch.no_grad():
            f0 = model(src, lengths, prev, features_only=True)[0]
            g = torch.Generator().manual_seed(100 + seed)
            for p in model.parameters():
                p.add_(eps * torch.randn(p.shape, generator=g))
            f1 = model(src, lengths, prev, features_only=True)[0]
        out.append(((f1 - f0).pow(2).sum() / f0.pow(2).sum()).item())
    return sum(out) / len(out)


def test_output_change_growth_with_depth(tiny_data):
    """From 2 to 18 layers per stack (9x): Post-LN's output change grows about with depth
    (Liu et al. 2020; measured 7.1x with these seeds), DeepNorm's stays far below depth
    (DeepNet bounds the output update by its alpha/beta; measured 2.4x, and 2.2-2.5x over
    16 other seeds, where Post-LN varied 3.2-9.6x), ReZero's hardly moves (each layer is
    the identity at init; measured 1.6x)."""
    growth = {}
    for name, extra in (("post-ln", ["--admin-init", "none"]),
                        ("deepnorm", ["--admin-residual", "deepnorm"]),
                        ("rezero", ["--admin-residual", "rezero"])):
        shallow, deep = _output_change(tiny_data, extra, 2), _output_change(tiny_data, extra, 18)
        growth[name] = deep / shallow
    assert growth["post-ln"] > 4.5, growth
    assert growth["deepnorm"] < 3.2, growth
    assert growth["deepnorm"] < growth["post-ln"] / 2, growth
    assert growth["rezero"] < 2.0, growth


def test_analysis_tool_output_change_per_scheme(tmp_path):
    """The analysis tool (relative branch perturbation, Liu et al. 2020's measure) on the
    rivals, depths 1..8 (8x): Post-LN grows with depth; DeepNorm stays bounded (DeepNet:
    alpha/beta bound the output update whatever the depth; measured: it even shrinks);
    ReZero's output does not depend on any branch weight at init (every layer is the
    identity), so its change is exactly 0, with and without Post-LN."""
    from fairseq_admin_pos.cli import analyze

    args = analyze.get_parser().parse_args([
        "--embed-dim", "16", "--ffn-dim", "32", "--heads", "2", "--depths", "1,2,4,8",
        "--seeds", "1,2", "--trials", "2", "--variants", "post-ln,deepnorm,rezero,rezero-post-ln",
        "--out-dir", str(tmp_path)])
    results = analyze.run_analysis(args)
    means = analyze.mean_changes(results)
    for which in (0, 1):  # encoder output, decoder output
        post = means["post-ln"]
        assert post[8][which] / post[1][which] > 4.0, post
        deep = means["deepnorm"]
        assert all(deep[n][which] <= 1.5 * deep[1][which] for n in (2, 4, 8)), deep
        assert deep[8][which] < post[8][which]
        for rz in ("rezero", "rezero-post-ln"):
            assert all(means[rz][n][which] == 0.0 for n in (1, 2, 4, 8)), means[rz]
    for r in results:  # the omega column: DeepNorm's alpha, 1 for ReZero's plain shortcut
        if r.variant == "deepnorm":
            c = paper_deepnorm(r.encoder_layers, r.decoder_layers)
            assert r.omegas["encoder"] == pytest.approx([c[0]] * 2 * r.encoder_layers, rel=1e-6)
            assert r.omegas["decoder"] == pytest.approx([c[2]] * 3 * r.decoder_layers, rel=1e-6)
        if r.variant.startswith("rezero"):
            assert r.omegas["encoder"] == [1.0] * 2 * r.encoder_layers
    assert "rezero" in analyze.table(results)


@pytest.mark.parametrize("scheme", ["deepnorm", "rezero", "rezero-post-ln"])
def test_incremental_decoding_matches_full_forward(tiny_data, scheme):
    model, task, _ = build(tiny_data, "admin_transformer", SMALL + [
        "--encoder-layers", "2", "--decoder-layers", "2", "--admin-residual", scheme])
    with torch.no_grad():  # move ReZero off its identity start so the layers do something
        for m in model.modules():
            if isinstance(m, ReZeroResidual):
                m.alpha.fill_(0.7)
    assert_incremental_matches_full(model, task)


def test_default_scheme_is_admin_and_unchanged(tiny_data):
    model, _, args = build(tiny_data, "admin_transformer", SMALL)
    assert args.admin_residual == "admin" and args.admin_init == "closed-form"
    assert model.admin_settings["admin_residual"] == "admin"
    assert all(type(m) is Float32OmegaResidual for m in residuals(model.encoder))


@pytest.mark.parametrize("extra,match", [
    (["--admin-residual", "deepnorm", "--admin-init", "closed-form"],
     "--admin-residual deepnorm sets its own shortcut weights.*--admin-init closed-form"),
    (["--admin-residual", "rezero", "--admin-init", "profile"],
     "--admin-residual rezero .*--admin-init profile"),
    (["--admin-residual", "deepnorm", "--admin-omega", "parameter"],
     "--admin-omega parameter .*--admin-residual deepnorm"),
    (["--admin-residual", "deepnorm", "--encoder-normalize-before"],
     "--encoder-normalize-before \\(Pre-LN\\).*deepnorm is a Post-LN scheme"),
    (["--admin-residual", "rezero", "--decoder-normalize-before"],
     "--decoder-normalize-before \\(Pre-LN\\).*rezero has no sub-layer LayerNorm"),
    (["--admin-residual", "rezero-post-ln", "--encoder-normalize-before",
      "--decoder-normalize-before"], "--encoder-normalize-before and --decoder-normalize-before"),
])
def test_scheme_flag_errors(tiny_data, extra, match):
    with pytest.raises(ValueError, match=match):
        build(tiny_data, "admin_transformer", SMALL + extra)


def test_scheme_is_checked_on_load(tiny_data):
    a, _, _ = build(tiny_data, "admin_transformer", SMALL + ["--admin-residual", "deepnorm"])
    b, _, _ = build(tiny_data, "admin_transformer", SMALL + ["--admin-init", "none"])
    with pytest.raises(ValueError, match="--admin-residual: checkpoint 'deepnorm', flags 'admin'"):
        b.load_state_dict(a.state_dict(), strict=False)


# --------------------------------------------------------------------------------------- #
# through fairseq-train / fairseq-generate
# --------------------------------------------------------------------------------------- #
def valid_losses(log: str):
    """``{epoch: validation loss}`` from fairseq-train's simple log."""
    return {int(e): float(v) for e, v in
            re.findall(r"\| valid \| epoch (\d+) \| valid on 'valid' subset \| loss ([0-9.]+)", log)}


@pytest.mark.parametrize("scheme", [s for s in RESIDUAL_SCHEMES if s != "admin"])
def test_each_scheme_trains_and_generates(tiny_data, tmp_path, scheme):
    """Two epochs (5 updates each) through fairseq-train: finite training losses, the
    validation loss (same sentences both times) goes down, then fairseq-generate. (admin
    itself is trained through the CLI in test_cli.py.)"""
    save = tmp_path / "ck"
    proc = run("fairseq_cli.train", [
        tiny_data, "--user-dir", USER_DIR, "--arch", "admin_transformer", *TINY_MODEL,
        "--admin-residual", scheme, "--dropout", "0.1", "--cpu", "--seed", "3",
        "--optimizer", "adam", "--lr", "2e-3", "--max-tokens", "400", "--no-progress-bar",
        "--log-format", "simple", "--log-interval", "1", "--num-workers", "0",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--max-epoch", "2", "--save-dir", save, "--no-epoch-checkpoints",
    ])
    log = proc.stdout + proc.stderr
    losses = [float(v) for v in train_losses(log)]
    assert len(losses) >= 8 and all(math.isfinite(v) for v in losses), losses
    valid = valid_losses(log)
    assert set(valid) == {1, 2} and valid[2] < valid[1], valid
    state = load_model_state(save / "checkpoint_last.pt")
    assert state["_extra_state"]["admin_residual"] == scheme
    if scheme == "deepnorm":  # alpha is a constant
        alpha = paper_deepnorm(2, 2)[0]
        assert state["encoder.layers.0.final_residual.omega"].item() == pytest.approx(alpha, rel=1e-6)
    if scheme.startswith("rezero"):  # the decoder's scalars left zero
        assert state["decoder.layers.1.final_residual.alpha"].abs().item() > 0
    out = generate(tiny_data, save / "checkpoint_last.pt").stdout
    assert len(hypotheses(out)) == 24 and "BLEU4" in out
