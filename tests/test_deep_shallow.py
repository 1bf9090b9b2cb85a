"""Deep encoder, shallow decoder (Kasai et al., ICLR 2021): the shallow-decoder
presets, every residual scheme at decoder depth 1, and a 1-layer decoder through every path a
user takes.

* presets: each shallow-decoder ``admin_transformer_wmt_en_de_<enc>l_<dec>l``, through fairseq's
  architecture registry, has its stated depths at WMT base width (512/2048/8 heads); a model
  built from it has those stacks; ``--encoder-layers`` on the command line still wins;
* one unit test per scheme at decoder depth 1, against the formulas written here: Admin's
  closed form (omega^2 = (N+1)/ln(N+1) - 1, N, or 1; N = 3 for the decoder, 2 L_enc for the
  encoder), Admin's profiling in both modes (the omegas against the recurrence computed by
  hand from hooked variances), DeepNorm's constants at M = 1 (alpha and the initialisation's
  beta), ReZero (every sub-layer the identity at initialisation), B2T (the N^(-1/2) scaling
  is 1 at N = 1), ResiDual (the decoder against its equations), Post-LN / Pre-LN (omega 1);
  incremental decoding equals the full forward for each; the export's fold of each
  exportable scheme gives the original's log-probabilities;
* a 3L-1L model through fairseq-train, -generate, -interactive, the hub, the export and
  averaging: tests/test_deep_shallow_paths.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from export_utils import (
    EXACT,
    SCHEMES as EXPORT_SCHEMES,
    eps_tolerance,
    incremental_logprobs,
    logprobs,
    max_diff,
    padded_batch,
    randomize_,
    set_eps,
    stock_model,
    unpadded_targets,
)
from model_utils import SMALL, assert_incremental_matches_full, build, parse, residuals, \
    sample_batch

# the shallow-decoder presets and their depths, stated here (not read from the
# package): Kasai et al.'s 6-1 and 12-1, the Transformer-Clinic report's 12-2, 18-1, 18-2, and
# a deeper encoder over one decoder layer
PRESETS = {"6l_1l": (6, 1), "12l_1l": (12, 1), "12l_2l": (12, 2), "18l_1l": (18, 1),
           "18l_2l": (18, 2), "24l_1l": (24, 1)}

ENC = 3  # encoder layers of the 1-layer-decoder models below
SHAPE = ["--encoder-layers", str(ENC), "--decoder-layers", "1"]
NO_DROPOUT = ["--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0"]


def closed_form(n: int, scale: str) -> float:
    """Admin's closed form, from the formulas (admin-torch): omega^2 = (N+1)/ln(N+1) - 1
    (O(logn)), N (O(1)), 1 (O(n))."""
    omega2 = {"O(logn)": (n + 1) / math.log(n + 1) - 1, "O(1)": float(n), "O(n)": 1.0}[scale]
    return math.sqrt(omega2)


def omega_values(stack):
    """Every residual module's omega of a stack, one float per sub-layer (a vector omega
    must be uniform at initialisation)."""
    out = []
    for mod in residuals(stack):
        w = mod.omega.detach().reshape(-1)
        assert torch.all(w == w[0])
        out.append(float(w[0]))
    return out


# --------------------------------------------------------------------------------------- #
# presets
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_has_its_depths_at_wmt_base_width(tiny_data, name):
    from fairseq.models import ARCH_MODEL_REGISTRY

    arch = f"admin_transformer_wmt_en_de_{name}"
    enc, dec = PRESETS[name]
    assert ARCH_MODEL_REGISTRY[arch].__name__ == "AdminTransformerModel"
    args = parse(tiny_data, arch)  # fairseq applied the registered preset
    assert (args.encoder_layers, args.decoder_layers) == (enc, dec)
    for side in ("encoder", "decoder"):
        assert (getattr(args, f"{side}_embed_dim"), getattr(args, f"{side}_ffn_embed_dim"),
                getattr(args, f"{side}_attention_heads")) == (512, 2048, 8)
    # the stacks of a model built from the preset (width from the command line, to be fast),
    # closed-form omegas with N = 2 x encoder layers and 3 x decoder layers
    model, _, _ = build(tiny_data, arch, SMALL)
    assert len(model.encoder.layers) == enc and len(model.decoder.layers) == dec
    assert omega_values(model.encoder) == pytest.approx([closed_form(2 * enc, "O(logn)")]
                                                        * 2 * enc, rel=1e-6)
    assert omega_values(model.decoder) == pytest.approx([closed_form(3 * dec, "O(logn)")]
                                                        * 3 * dec, rel=1e-6)


def test_presets_are_documented_and_the_command_line_wins(tiny_data):
    from fairseq.models import ARCH_CONFIG_REGISTRY

    from fairseq_admin_pos.models import architectures

    assert {k: v[:2] for k, v in architectures.SHALLOW_DECODER_PRESETS.items()} == PRESETS
    for name in PRESETS:
        doc = ARCH_CONFIG_REGISTRY[f"admin_transformer_wmt_en_de_{name}"].__doc__
        assert "Kasai et al., ICLR 2021 (arXiv 2006.10369)" in doc, doc
    args = parse(tiny_data, "admin_transformer_wmt_en_de_12l_1l", ["--encoder-layers", "3"])
    assert (args.encoder_layers, args.decoder_layers) == (3, 1)
    args = parse(tiny_data, "admin_transformer_wmt_en_de_24l_1l", ["--decoder-layers", "2"])
    assert (args.encoder_layers, args.decoder_layers) == (24, 2)


# --------------------------------------------------------------------------------------- #
# every scheme at decoder depth 1
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("form", ["buffer", "parameter"])
@pytest.mark.parametrize("scale", ["O(logn)", "O(1)", "O(n)"])
def test_closed_form_at_decoder_depth_1(tiny_data, scale, form):
    model, _, _ = build(tiny_data, "admin_transformer", SMALL + SHAPE + [
        "--admin-output-change-scale", scale, "--admin-omega", form])
    dec, enc = omega_values(model.decoder), omega_values(model.encoder)
    assert len(dec) == 3 and len(enc) == 2 * ENC
    assert dec == pytest.approx([closed_form(3, scale)] * 3, rel=1e-6)
    assert enc == pytest.approx([closed_form(2 * ENC, scale)] * 2 * ENC, rel=1e-6)
    # by hand, O(logn): 4/ln 4 - 1 = 1.8854 -> 1.3731; 7/ln 7 - 1 = 2.5973 -> 1.6116
    hand = {"O(logn)": (1.3731, 1.6116), "O(1)": (3 ** 0.5, 6 ** 0.5), "O(n)": (1.0, 1.0)}
    assert (dec[0], enc[0]) == pytest.approx(hand[scale], abs=1e-4)


def hooked_sublayers(model, net_input, train_mode):
    """One forward of ``model``; per stack, in execution order, each residual sub-layer's
    shortcut x (the layer input, or the LayerNorm output that feeds the next sub-layer), its
    branch output f (attention / fc2 output) and its LayerNorm's input, captured by hooks on
    fairseq's sub-modules, float64 numpy arrays of shape (T, B, C)."""
    seen = {"encoder": [], "decoder": []}
    hooks = []

    def grab(stack, kind, pre=False):
        def hook(mod, args, out=None):
            t = args[0] if pre else (out[0] if isinstance(out, tuple) else out)
            seen[stack].append((kind, t.detach().double().numpy().copy()))
        return hook

    for stack in ("encoder", "decoder"):
        for layer in getattr(model, stack).layers:
            hooks.append(layer.register_forward_pre_hook(grab(stack, "x", pre=True)))
            names = [("self_attn", "self_attn_layer_norm")]
            if stack == "decoder":
                names.append(("encoder_attn", "encoder_attn_layer_norm"))
            names.append(("fc2", "final_layer_norm"))
            for branch, norm in names:
                hooks.append(getattr(layer, branch).register_forward_hook(grab(stack, "f")))
                ln = getattr(layer, norm)
                hooks.append(ln.register_forward_pre_hook(grab(stack, "ln_in", pre=True)))
                if norm != "final_layer_norm":  # its output is the next layer's input
                    hooks.append(ln.register_forward_hook(grab(stack, "x")))
    model.train(train_mode)
    try:
        with torch.no_grad():
            model(**net_input)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for stack, items in seen.items():
        xs, fs, ln_in = ([t for k, t in items if k == kind] for kind in ("x", "f", "ln_in"))
        assert len(xs) == len(fs) == len(ln_in)
        out[stack] = list(zip(xs, fs, ln_in))
    return out


def profiled(tiny_data, mode, seed=4):
    """A 3L-1L model before and after its first training forward profiled the omegas."""
    flags = SMALL + SHAPE + NO_DROPOUT + ["--admin-init", "profile", "--admin-profile-mode", mode]
    model, task, _ = build(tiny_data, "admin_transformer", flags, seed=seed)
    src, lengths, prev = sample_batch(task, bsz=3, src_len=7, tgt_len=5,
                                      left_pad_lengths=[7, 4, 6])
    net_input = {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev}
    return model, net_input


def test_eval_profile_of_a_1_layer_decoder_is_the_recurrence(tiny_data):
    """--admin-profile-mode eval: the statistics of an eval forward with every omega 1, over
    the real tokens; omega_1 = 1, omega_{i+1} = sqrt(omega_i^2 Var[x_i] + Var[f_i])."""
    model, net_input = profiled(tiny_data, "eval")
    assert all(v == 1.0 for s in ("encoder", "decoder") for v in omega_values(getattr(model, s)))
    before = hooked_sublayers(model, net_input, train_mode=False)
    masks = {"encoder": net_input["src_tokens"].ne(model.encoder.padding_idx).t().numpy(),
             "decoder": net_input["prev_output_tokens"].ne(model.decoder.padding_idx).t().numpy()}
    assert not masks["encoder"].all()  # padding present, and left out
    model.train()
    model(**net_input)  # the first training forward profiles
    assert int(model.admin_profiled) == 1
    for stack in ("encoder", "decoder"):
        want, ratio = [], 1.0
        for x, f, _ in before[stack]:
            want.append(ratio)
            m = masks[stack]
            ratio = math.sqrt(ratio ** 2 * np.var(x[m]) + np.var(f[m]))
        got = omega_values(getattr(model, stack))
        assert len(got) == (3 if stack == "decoder" else 2 * ENC)
        assert got == pytest.approx(want, rel=1e-5), stack
        assert got[0] == 1.0 and all(b > a for a, b in zip(got, got[1:]))


def test_clinic_profile_of_a_1_layer_decoder_is_the_in_pass_recurrence(tiny_data):
    """--admin-profile-mode clinic (Transformer-Clinic): each omega applied as the pass
    reaches it, variances over the whole tensor (padding included). Without dropout the pass
    is the model's own forward with the final omegas, so the hooked x_i, f_i of a forward
    after profiling are the profile's: omega_1 = 1, omega_{i+1} = sqrt(Var[omega_i x_i] +
    Var[f_i]); each LayerNorm's input is omega_i x_i + f_i."""
    model, net_input = profiled(tiny_data, "clinic")
    model.train()
    model(**net_input)
    assert int(model.admin_profiled) == 1
    after = hooked_sublayers(model, net_input, train_mode=True)
    for stack in ("encoder", "decoder"):
        got = omega_values(getattr(model, stack))
        assert len(got) == len(after[stack]) == (3 if stack == "decoder" else 2 * ENC)
        want, ratio = [], 1.0
        for (x, f, ln_in), omega in zip(after[stack], got):
            want.append(ratio)
            np.testing.assert_allclose(ln_in, x * omega + f, rtol=1e-5, atol=1e-5)
            ratio = math.sqrt(np.var(x * ratio) + np.var(f))
        assert got == pytest.approx(want, rel=1e-5), stack


def _xavier_std(weight, gain):
    fan_out, fan_in = weight.shape
    return gain * math.sqrt(2.0 / (fan_in + fan_out))


def test_deepnorm_at_decoder_depth_1(tiny_data):
    """DeepNet (Wang et al. 2022, Table 1) at N = 3 encoder and M = 1 decoder layers: encoder
    alpha = 0.81 (N^4 M)^(1/16), beta = 0.87 (N^4 M)^(-1/16); decoder alpha = (3M)^(1/4),
    beta = (12M)^(-1/4). alpha is every sub-layer's shortcut weight; beta the Xavier-normal
    gain of v/out projections and the FFN (q/k: gain 1), seen in the weights' spread."""
    n, m = ENC, 1
    want = {"encoder": (0.81 * (n ** 4 * m) ** (1 / 16), 0.87 * (n ** 4 * m) ** (-1 / 16)),
            "decoder": ((3 * m) ** 0.25, (12 * m) ** -0.25)}
    assert want["decoder"] == pytest.approx((1.316074, 0.537285), abs=1e-6)  # by hand
    wide = ["--encoder-embed-dim", "64", "--decoder-embed-dim", "64", "--encoder-ffn-embed-dim",
            "256", "--decoder-ffn-embed-dim", "256", "--encoder-attention-heads", "2",
            "--decoder-attention-heads", "2"]
    model, _, _ = build(tiny_data, "admin_transformer", wide + SHAPE + [
        "--admin-residual", "deepnorm"])
    for stack in ("encoder", "decoder"):
        alpha, beta = want[stack]
        assert omega_values(getattr(model, stack)) == pytest.approx(
            [alpha] * (3 if stack == "decoder" else 2 * n), rel=1e-6)
        for layer in getattr(model, stack).layers:
            attns = [layer.self_attn] + ([layer.encoder_attn] if stack == "decoder" else [])
            weights = [(a.q_proj.weight, 1.0) for a in attns] + \
                [(a.k_proj.weight, 1.0) for a in attns] + \
                [(a.v_proj.weight, beta) for a in attns] + \
                [(a.out_proj.weight, beta) for a in attns] + \
                [(layer.fc1.weight, beta), (layer.fc2.weight, beta)]
            for w, gain in weights:
                assert float(w.detach().std()) == pytest.approx(_xavier_std(w, gain), rel=0.06)


def _embedding_output(stack, tokens, zero_pads=False):
    """sqrt(d) E[tokens] + positions, time-major (the encoder zeroes pad positions)."""
    x = math.sqrt(stack.embed_tokens.embedding_dim) * stack.embed_tokens.weight[tokens]
    x = x + stack.embed_positions(tokens)
    if zero_pads:
        x = x * tokens.ne(stack.padding_idx).unsqueeze(-1)
    return x.transpose(0, 1)


@pytest.mark.parametrize("scheme", ["rezero", "rezero-post-ln"])
def test_rezero_1_layer_decoder_is_the_identity_at_init(tiny_data, scheme):
    """ReZero (Bachlechner et al. 2020): a = 0 in each of the decoder's 3 sub-layers, so the
    decoder features are its embedding output (rezero), or that output through the 3
    LayerNorms (rezero-post-ln; weight 1, bias 0, eps 1e-5)."""
    model, task, _ = build(tiny_data, "admin_transformer", SMALL + SHAPE + [
        "--admin-residual", scheme])
    mods = residuals(model.decoder)
    assert len(mods) == 3 and all(float(m.alpha) == 0.0 for m in mods)
    model.eval()
    src, lengths, prev = sample_batch(task)
    with torch.no_grad():
        feats, _ = model.decoder(prev, encoder_out=model.encoder(src, src_lengths=lengths),
                                 features_only=True)
        want = _embedding_output(model.decoder, prev).transpose(0, 1)
    if scheme == "rezero-post-ln":
        for _ in range(3):
            want = F.layer_norm(want, want.shape[-1:], eps=1e-5)
    torch.testing.assert_close(feats, want, rtol=1e-5, atol=1e-5)


def test_b2t_scaling_is_one_at_decoder_depth_1(tiny_data):
    """B2T (Takase et al. 2023) multiplies a layer's Linear weights by N^(-1/2), N the layers
    of its stack: 1 for the 1-layer decoder, 3^(-1/2) for the encoder; same seed as Post-LN."""
    b2t, _, _ = build(tiny_data, "admin_transformer", SMALL + SHAPE + ["--admin-residual", "b2t"])
    post, _, _ = build(tiny_data, "admin_transformer", SMALL + SHAPE + ["--admin-init", "none"])
    ref = post.state_dict()
    linear = 0
    for name, value in b2t.state_dict().items():
        if not torch.is_tensor(value):
            continue
        is_linear = ".layers." in name and (name.endswith("proj.weight")
                                            or name.endswith((".fc1.weight", ".fc2.weight")))
        scale = (1 ** -0.5 if name.startswith("decoder.") else ENC ** -0.5) if is_linear else 1.0
        assert torch.equal(value, ref[name] * scale) if scale != 1.0 else \
            torch.equal(value, ref[name]), name
        linear += is_linear
    assert linear == ENC * (4 + 2) + 1 * (8 + 2)


def _attention(m, q_in, kv_in, key_pad=None, causal=False):
    """fairseq's MultiheadAttention from its weights: softmax(q k^T / sqrt(d_head) + masks) v."""
    h, dh = m.num_heads, m.head_dim
    q = F.linear(q_in, m.q_proj.weight, m.q_proj.bias) / math.sqrt(dh)
    k = F.linear(kv_in, m.k_proj.weight, m.k_proj.bias)
    v = F.linear(kv_in, m.v_proj.weight, m.v_proj.bias)
    tq, b, c = q.shape
    tk = k.shape[0]
    split = lambda t, n: t.reshape(n, b, h, dh).permute(1, 2, 0, 3)  # noqa: E731
    scores = split(q, tq) @ split(k, tk).transpose(-1, -2)
    if key_pad is not None:
        scores = scores.masked_fill(key_pad[:, None, None, :], float("-inf"))
    if causal:
        scores = scores.masked_fill(torch.ones(tq, tk, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ split(v, tk)).permute(2, 0, 1, 3).reshape(tq, b, c)
    return F.linear(out, m.out_proj.weight, m.out_proj.bias)


def _ln(module, x, eps=None):
    return F.layer_norm(x, x.shape[-1:], module.weight, module.bias,
                        module.eps if eps is None else eps)


def _decoder_reference(scheme, model, prev, enc, src_pad):
    """The 1-layer decoder's features from its equations. b2t: h1 = LN1(x + SelfAttn(x)),
    h2 = LN2(h1 + CrossAttn(h1)), y = LN3(h2 + FFN(h2) + x). resi-dual: x_{k+1} = LN_k(x_k +
    f_k), d_{k+1} = d_k + f_k, x_0 = d_0 = the embedding output, y = x_3 + LN_d(d_3) (eps
    1e-7)."""
    (layer,) = model.decoder.layers
    x = _embedding_output(model.decoder, prev)
    ffn = lambda h: F.linear(F.relu(F.linear(h, layer.fc1.weight, layer.fc1.bias)),  # noqa: E731
                             layer.fc2.weight, layer.fc2.bias)
    if scheme == "b2t":
        h = _ln(layer.self_attn_layer_norm, x + _attention(layer.self_attn, x, x, causal=True))
        h = _ln(layer.encoder_attn_layer_norm, h + _attention(layer.encoder_attn, h, enc, src_pad))
        return _ln(layer.final_layer_norm, h + ffn(h) + x).transpose(0, 1)
    d = x
    for branch, norm in ((lambda h: _attention(layer.self_attn, h, h, causal=True),
                          layer.self_attn_layer_norm),
                         (lambda h: _attention(layer.encoder_attn, h, enc, src_pad),
                          layer.encoder_attn_layer_norm),
                         (ffn, layer.final_layer_norm)):
        f = branch(x)
        d = d + f
        x = _ln(norm, x + f)
    return (x + _ln(model.decoder.dual_layer_norm, d, eps=1e-7)).transpose(0, 1)


@pytest.mark.parametrize("scheme", ["b2t", "resi-dual"])
def test_1_layer_decoder_matches_the_papers_equations(tiny_data, scheme):
    model, task, _ = build(tiny_data, "admin_transformer", SMALL + SHAPE + [
        "--admin-residual", scheme], seed=3)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # LayerNorms away from 1 / 0, so a misplaced one shows
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0)
                        + 0.5 * torch.randn(p.shape, generator=g))
    model.eval()
    src, lengths, prev = sample_batch(task, left_pad_lengths=[7, 4, 6])
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=lengths)
        feats, _ = model.decoder(prev, encoder_out=enc, features_only=True)
        want = _decoder_reference(scheme, model, prev, enc["encoder_out"][0],
                                  src.eq(model.encoder.padding_idx))
    torch.testing.assert_close(feats, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags", [["--admin-init", "none"],
                                   ["--admin-init", "none", "--encoder-normalize-before",
                                    "--decoder-normalize-before"]], ids=["post-ln", "pre-ln"])
def test_post_ln_and_pre_ln_have_omega_1(tiny_data, flags):
    model, _, _ = build(tiny_data, "admin_transformer", SMALL + SHAPE + flags)
    assert omega_values(model.decoder) == [1.0] * 3
    assert omega_values(model.encoder) == [1.0] * 2 * ENC
    pre_ln = "--decoder-normalize-before" in flags
    assert (model.decoder.layer_norm is not None) == pre_ln


ALL_SCHEMES = {
    "admin-closed-form": ["--admin-omega", "parameter"],
    "admin-profile": ["--admin-init", "profile"],
    "post-ln": ["--admin-init", "none"],
    "pre-ln": ["--admin-init", "none", "--encoder-normalize-before", "--decoder-normalize-before"],
    "deepnorm": ["--admin-residual", "deepnorm"],
    "rezero": ["--admin-residual", "rezero"],
    "rezero-post-ln": ["--admin-residual", "rezero-post-ln"],
    "b2t": ["--admin-residual", "b2t"],
    "resi-dual": ["--admin-residual", "resi-dual"],
}


@pytest.mark.parametrize("scheme", sorted(ALL_SCHEMES))
def test_incremental_decoding_of_a_1_layer_decoder(tiny_data, scheme):
    model, task, _ = build(tiny_data, "admin_transformer", SMALL + SHAPE + ALL_SCHEMES[scheme])
    with torch.no_grad():  # ReZero's a = 0 would hide the decoder's sub-layers
        for mod in residuals(model.decoder):
            if hasattr(mod, "alpha"):
                mod.alpha.fill_(0.7)
    assert_incremental_matches_full(model, task)


@pytest.mark.parametrize("scheme", sorted(EXPORT_SCHEMES))
def test_export_fold_of_a_1_layer_decoder(tiny_data, scheme):
    """The stock transformer the export builds (fold.py) gives the original's
    log-probabilities: exact folds to 1e-5, scalar folds within their eps tolerance and exact
    with eps / w^2; the stock model decodes incrementally like the original."""
    model, task, args = build(tiny_data, "admin_transformer", SMALL + SHAPE
                              + EXPORT_SCHEMES[scheme] + ["--share-all-embeddings"])
    randomize_(model, seed=len(scheme))
    stock, fold = stock_model(model, args, task)
    assert len(stock.decoder.layers) == 1 and len(stock.encoder.layers) == ENC
    batch, mask = padded_batch(task)
    original = logprobs(model, batch)
    if fold.exact:
        assert max_diff(logprobs(stock, batch), original, mask) <= EXACT
    else:
        assert max_diff(logprobs(stock, batch), original, mask) <= eps_tolerance(
            stock, fold, batch, mask)
        set_eps(stock, fold, exact=True)
        assert max_diff(logprobs(stock, batch), original, mask) <= EXACT
    steps = unpadded_targets(batch, task)
    assert max_diff(incremental_logprobs(stock, steps), logprobs(model, steps),
                    torch.ones_like(mask)) <= EXACT
