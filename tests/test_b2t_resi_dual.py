"""B2T connection and ResiDual (``--admin-residual b2t`` / ``resi-dual``): each model's
encoder output and decoder features against the papers' equations written here from plain
torch ops on the model's own weights, B2T's initialisation, incremental decoding, the float32
dual stream under bfloat16, flag errors, the output change against depth in the analysis
tool, and a fairseq-train run resumed from a mid-epoch checkpoint equal to the uninterrupted
run. (Training + generation through the CLI for every scheme: ``test_schemes.py``;
checkpointing, precision, host reads and the monitor: the tests of those features.)
"""
import math
import re

import pytest
import torch
import torch.nn.functional as F

from fairseq_cli_utils import TINY_MODEL, load_checkpoint, train, train_losses
from model_utils import (
    POS_CHOICES,
    SMALL,
    assert_incremental_matches_full,
    build,
    residuals,
    sample_batch,
)

SCHEMES = ["b2t", "resi-dual"]


# --------------------------------------------------------------------------------------- #
# the papers' equations, from plain torch ops
# --------------------------------------------------------------------------------------- #
def attention(m, q_in, kv_in, key_pad=None, causal=False):
    """Multi-head attention of fairseq's ``MultiheadAttention`` ``m`` from its weights:
    softmax(q k^T / sqrt(d_head) + masks) v, heads concatenated, output projection.
    ``q_in`` ``(Tq, B, C)``, ``kv_in`` ``(Tk, B, C)``, ``key_pad`` ``(B, Tk)`` True at pads."""
    h, dh = m.num_heads, m.head_dim
    q = F.linear(q_in, m.q_proj.weight, m.q_proj.bias) / math.sqrt(dh)
    k = F.linear(kv_in, m.k_proj.weight, m.k_proj.bias)
    v = F.linear(kv_in, m.v_proj.weight, m.v_proj.bias)
    tq, b, c = q.shape
    tk = k.shape[0]
    split = lambda t, n: t.reshape(n, b, h, dh).permute(1, 2, 0, 3)  # (B, H, T, dh)
    scores = split(q, tq) @ split(k, tk).transpose(-1, -2)
    if key_pad is not None:
        scores = scores.masked_fill(key_pad[:, None, None, :], float("-inf"))
    if causal:
        scores = scores.masked_fill(torch.ones(tq, tk, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ split(v, tk)).permute(2, 0, 1, 3).reshape(tq, b, c)
    return F.linear(out, m.out_proj.weight, m.out_proj.bias)


def ffn(layer, x):
    return F.linear(F.relu(F.linear(x, layer.fc1.weight, layer.fc1.bias)),
                    layer.fc2.weight, layer.fc2.bias)


def ln(module, x, eps=None):
    return F.layer_norm(x, x.shape[-1:], module.weight, module.bias,
                        module.eps if eps is None else eps)


def embedding_output(stack, tokens, zero_pads):
    """sqrt(d) E[tokens] + positions, time-major; the encoder zeroes pad positions."""
    x = math.sqrt(stack.embed_tokens.embedding_dim) * stack.embed_tokens.weight[tokens]
    if stack.embed_positions is not None:
        x = x + stack.embed_positions(tokens)
    if zero_pads:
        x = x * tokens.ne(stack.padding_idx).unsqueeze(-1)
    return x.transpose(0, 1)


def b2t_encoder(model, src):
    """Takase et al. 2023: h = LN1(x + Attn(x)); y = LN2(h + FFN(h) + x), every layer."""
    pad = src.eq(model.encoder.padding_idx)
    x = embedding_output(model.encoder, src, zero_pads=True)
    for layer in model.encoder.layers:
        h = ln(layer.self_attn_layer_norm, x + attention(layer.self_attn, x, x, pad))
        x = ln(layer.final_layer_norm, h + ffn(layer, h) + x)
    return x


def b2t_decoder(model, prev, enc, src_pad):
    """h1 = LN1(x + SelfAttn(x)); h2 = LN2(h1 + CrossAttn(h1)); y = LN3(h2 + FFN(h2) + x)."""
    x = embedding_output(model.decoder, prev, zero_pads=False)
    for layer in model.decoder.layers:
        h = ln(layer.self_attn_layer_norm, x + attention(layer.self_attn, x, x, causal=True))
        if layer.encoder_attn is not None:
            h = ln(layer.encoder_attn_layer_norm,
                   h + attention(layer.encoder_attn, h, enc, src_pad))
        x = ln(layer.final_layer_norm, h + ffn(layer, h) + x)
    return x.transpose(0, 1)


def resi_dual_stack(stack, x, sublayers):
    """Xie et al. 2023: x_{k+1} = LN_k(x_k + f_k(x_k)), d_{k+1} = d_k + f_k(x_k), x_0 = d_0 =
    the embedding output; output x_K + LN_d(d_K) (eps 1e-7). ``sublayers(layer)`` lists a
    layer's (branch function, LayerNorm) in order."""
    d = x
    for layer in stack.layers:
        for branch, norm in sublayers(layer):
            f = branch(x)
            d = d + f
            x = ln(norm, x + f)
    return x + ln(stack.dual_layer_norm, d, eps=1e-7)


def resi_dual_encoder(model, src):
    pad = src.eq(model.encoder.padding_idx)
    x = embedding_output(model.encoder, src, zero_pads=True)
    return resi_dual_stack(model.encoder, x, lambda l: [
        (lambda x: attention(l.self_attn, x, x, pad), l.self_attn_layer_norm),
        (lambda x: ffn(l, x), l.final_layer_norm)])


def resi_dual_decoder(model, prev, enc, src_pad):
    x = embedding_output(model.decoder, prev, zero_pads=False)

    def sublayers(l):
        subs = [(lambda x: attention(l.self_attn, x, x, causal=True), l.self_attn_layer_norm)]
        if l.encoder_attn is not None:
            subs.append((lambda x: attention(l.encoder_attn, x, enc, src_pad),
                         l.encoder_attn_layer_norm))
        return subs + [(lambda x: ffn(l, x), l.final_layer_norm)]

    return resi_dual_stack(model.decoder, x, sublayers).transpose(0, 1)


REFERENCE = {"b2t": (b2t_encoder, b2t_decoder), "resi-dual": (resi_dual_encoder, resi_dual_decoder)}


def _randomise_layer_norms(model, seed=5):
    """LayerNorms start at weight 1, bias 0: draw them, so that a LayerNorm used in the wrong
    place (or a missing one) shows in the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g) if name.endswith("weight")
                        else 0.5 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("pos", POS_CHOICES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_forward_matches_the_papers_equations(tiny_data, scheme, pos):
    model, task, _ = build(tiny_data, "admin_transformer", SMALL + [
        "--encoder-layers", "3", "--decoder-layers", "2", "--admin-residual", scheme,
        "--encoder-pos-emb", pos, "--decoder-pos-emb", pos], seed=3)
    _randomise_layer_norms(model)
    model.eval()
    src, lengths, prev = sample_batch(task, bsz=3, src_len=7, tgt_len=6,
                                      left_pad_lengths=[7, 4, 6])
    ref_enc, ref_dec = REFERENCE[scheme]
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=lengths)
        feats, _ = model.decoder(prev, encoder_out=enc, features_only=True)
        want_enc = ref_enc(model, src)
        want_dec = ref_dec(model, prev, want_enc, src.eq(model.encoder.padding_idx))
    real = src.ne(model.encoder.padding_idx).t()  # pad positions of the encoder: unused
    torch.testing.assert_close(enc["encoder_out"][0][real], want_enc[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(feats, want_dec, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_decoder_without_cross_attention_matches_the_equations(tiny_data, scheme):
    """--no-cross-attention: the decoder layer has the encoder layer's two sub-layers."""
    model, task, _ = build(tiny_data, "admin_transformer", SMALL + [
        "--encoder-layers", "1", "--decoder-layers", "3", "--admin-residual", scheme,
        "--no-cross-attention"], seed=4)
    _randomise_layer_norms(model)
    model.eval()
    src, lengths, prev = sample_batch(task)
    assert all(layer.encoder_attn is None for layer in model.decoder.layers)
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=lengths)
        feats, _ = model.decoder(prev, encoder_out=enc, features_only=True)
        want = REFERENCE[scheme][1](model, prev, None, None)
    torch.testing.assert_close(feats, want, rtol=1e-5, atol=1e-5)


def test_resi_dual_final_layer_norms_use_the_repositorys_eps(tiny_data):
    """microsoft/ResiDual replaces each stack's final LayerNorm by LayerNorm(eps=1e-7); the
    equations above cannot tell 1e-7 from fairseq's 1e-5 at these activation sizes."""
    model, _, _ = build(tiny_data, "admin_transformer", SMALL + ["--admin-residual", "resi-dual"])
    assert model.encoder.dual_layer_norm.eps == model.decoder.dual_layer_norm.eps == 1e-7
    assert model.encoder.layer_norm is None and model.decoder.layer_norm is None  # Post-LN


# --------------------------------------------------------------------------------------- #
# B2T's initialisation
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("enc,dec", [(2, 3), (4, 1)])
def test_b2t_scales_every_linear_weight_by_inverse_sqrt_depth(tiny_data, enc, dec):
    """The authors' rescaling_init: with the same seed, every Linear weight of a B2T layer is
    the Post-LN model's times N^(-1/2) (N = layers of its stack); everything else equal."""
    depth = ["--encoder-layers", enc, "--decoder-layers", dec]
    b2t, _, _ = build(tiny_data, "admin_transformer", SMALL + depth + ["--admin-residual", "b2t"])
    post, _, _ = build(tiny_data, "admin_transformer", SMALL + depth + ["--admin-init", "none"])
    post_state = post.state_dict()
    scaled = 0
    for name, value in b2t.state_dict().items():
        if not torch.is_tensor(value):
            continue
        stack, n = ("encoder", enc) if name.startswith("encoder.") else ("decoder", dec)
        is_linear = ".layers." in name and name.endswith("proj.weight") or \
            re.search(r"\.fc[12]\.weight$", name)
        if is_linear:
            assert torch.equal(value, post_state[name] * n ** -0.5), name
            scaled += 1
        else:
            assert torch.equal(value, post_state[name]), name
    assert scaled == enc * (4 + 2) + dec * (8 + 2)


# --------------------------------------------------------------------------------------- #
# decoding, precision, flags
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("pos", ["sinusoidal", "learned"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_incremental_decoding_matches_full_forward(tiny_data, scheme, pos):
    model, task, _ = build(tiny_data, "admin_transformer", SMALL + [
        "--encoder-layers", "2", "--decoder-layers", "3", "--admin-residual", scheme,
        "--encoder-pos-emb", pos, "--decoder-pos-emb", pos])
    _randomise_layer_norms(model)
    assert_incremental_matches_full(model, task)


def test_resi_dual_dual_stream_stays_float32_in_a_bfloat16_model(tiny_data):
    """The dual stream is carried in float32 (no overflow, no rounding of a long sum): each
    layer returns a float32 d, and d_K equals the float32 sum of the bf16 branch outputs."""
    model, task, _ = build(tiny_data, "admin_transformer", SMALL + [
        "--encoder-layers", "3", "--decoder-layers", "2", "--admin-residual", "resi-dual",
        "--dropout", "0"])
    model.to(torch.bfloat16).eval()
    duals, branches = [], []
    for layer in model.encoder.layers:
        layer.register_forward_hook(lambda m, a, out: duals.append(out[1]))
        for res in (layer.self_attn_residual, layer.final_residual):
            res.register_forward_hook(lambda m, a, out: branches.append(a[1]))
    src, lengths, prev = sample_batch(task)
    with torch.no_grad():
        model(src, lengths, prev)
        d0 = model.encoder.forward_embedding(src)[0].transpose(0, 1).float()
        d0 = d0 * src.ne(model.encoder.padding_idx).t().unsqueeze(-1)
    assert [d.dtype for d in duals] == [torch.float32] * 3
    assert all(f.dtype == torch.bfloat16 for f in branches) and len(branches) == 6
    want = d0
    for f in branches:
        want = want + f.float()
    torch.testing.assert_close(duals[-1], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("extra,match", [
    (["--admin-residual", "b2t", "--admin-init", "closed-form"],
     "--admin-residual b2t .*--admin-init closed-form .*valid with b2t: --admin-init none"),
    (["--admin-residual", "resi-dual", "--admin-init", "profile"],
     "--admin-residual resi-dual .*--admin-init profile .*valid with resi-dual: --admin-init none"),
    (["--admin-residual", "b2t", "--admin-omega", "parameter"],
     "--admin-omega parameter .*--admin-residual b2t.*valid with b2t: --admin-omega buffer"),
    (["--admin-residual", "resi-dual", "--admin-omega", "parameter"],
     "--admin-omega parameter .*--admin-residual resi-dual"),
    (["--admin-residual", "b2t", "--encoder-normalize-before"],
     "--encoder-normalize-before \\(Pre-LN\\).*--admin-residual b2t: b2t is a Post-LN scheme"),
    (["--admin-residual", "resi-dual", "--decoder-normalize-before"],
     "--decoder-normalize-before \\(Pre-LN\\).*--admin-residual resi-dual"),
])
def test_flag_errors_name_both_flags(tiny_data, extra, match):
    with pytest.raises(ValueError, match=match):
        build(tiny_data, "admin_transformer", SMALL + extra)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_sub_layer_shortcuts_are_plain_sums(tiny_data, scheme):
    """Neither paper weights the shortcut: every residual module is a fixed omega = 1."""
    model, _, args = build(tiny_data, "admin_transformer", SMALL + ["--admin-residual", scheme])
    assert args.admin_init == "none"
    mods = residuals(model.encoder) + residuals(model.decoder)
    assert len(mods) == 2 * 6 + 3 * 6
    assert all(not m.as_parameter and m.omega.item() == 1.0 for m in mods)


# --------------------------------------------------------------------------------------- #
# fairseq-admin-analyze: output change against depth
# --------------------------------------------------------------------------------------- #
def test_analysis_tool_output_change_against_depth(tmp_path):
    """Depths 1..8 with the analysis tool (relative branch perturbation). B2T: the change
    *falls* with depth (each layer's branches start N^(-1/2) smaller, and the layer input
    reaches the layer output past them; measured 0.33x encoder, 0.23x decoder from 1 to 8).
    ResiDual: grows like Post-LN (measured 28x / 8x against Post-LN's 37x / 15x): at
    initialisation its Post-LN stream x_K is as sensitive as Post-LN's; the dual stream
    bounds the gradient (the paper's claim), not this output change."""
    from fairseq_admin_pos.cli import analyze

    args = analyze.get_parser().parse_args([
        "--embed-dim", "16", "--ffn-dim", "32", "--heads", "2", "--depths", "1,2,4,8",
        "--seeds", "1,2", "--trials", "2", "--variants", "post-ln,b2t,resi-dual",
        "--out-dir", str(tmp_path)])
    results = analyze.run_analysis(args)
    means = analyze.mean_changes(results)
    for which in (0, 1):  # encoder output, decoder output
        b2t, post, rd = means["b2t"], means["post-ln"], means["resi-dual"]
        assert b2t[8][which] < 0.7 * b2t[1][which], b2t
        assert all(b2t[n][which] < post[n][which] for n in (2, 4, 8))
        assert rd[8][which] > 4 * rd[1][which], rd
    # the omega column: the plain shortcut
    for r in results:
        if r.variant in SCHEMES:
            assert r.omegas["encoder"] == [1.0] * 2 * r.encoder_layers
            assert r.omegas["decoder"] == [1.0] * 3 * r.decoder_layers
    table = analyze.table(results)
    assert re.search(r"^b2t +encoder", table, re.M) and re.search(r"^resi-dual +decoder", table, re.M)


# --------------------------------------------------------------------------------------- #
# fairseq-train: a resumed run equals the uninterrupted one
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("scheme", SCHEMES)
def test_resume_equals_uninterrupted_run(tiny_data, tmp_path, scheme):
    """9 updates at once, and 3 then a resume from the checkpoint written after update 3
    (inside epoch 1: fairseq draws a later epoch's batches with another seed) to 9: the same
    logged losses, weights and Adam moments, dropout on (fairseq seeds each update)."""
    extra = TINY_MODEL + ["--admin-residual", scheme, "--dropout", "0.1", "--no-epoch-checkpoints"]
    whole = train(tiny_data, tmp_path / "whole", "admin_transformer",
                  extra + ["--save-interval-updates", "3"], max_update=9)
    resumed = train(tiny_data, tmp_path / "resumed", "admin_transformer",
                    extra + ["--restore-file", tmp_path / "whole" / "checkpoint_1_3.pt"],
                    max_update=9)
    log = resumed.stdout + resumed.stderr
    assert re.search(r"Loaded checkpoint .*checkpoint_1_3\.pt \(epoch 1 @ 3 updates\)", log)
    expected = train_losses(whole.stdout + whole.stderr)
    assert len(expected) == 9 and train_losses(log) == expected[3:]
    a = load_checkpoint(tmp_path / "whole" / "checkpoint_last.pt")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoint_last.pt")
    assert a["model"]["_extra_state"]["admin_residual"] == scheme
    tensors = [k for k, v in a["model"].items() if torch.is_tensor(v)]
    assert any("dual_layer_norm" in k for k in tensors) == (scheme == "resi-dual")
    for key in tensors:
        assert torch.equal(a["model"][key], b["model"][key]), key
    sa, sb = a["last_optimizer_state"]["state"], b["last_optimizer_state"]["state"]
    assert sa.keys() == sb.keys() and len(sa) > 0
    for i in sa:
        assert torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"])
        assert torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"])
