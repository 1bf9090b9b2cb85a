"""Peri-LN, Mix-LN and DyT in ``admin_transformer`` (``--admin-residual peri-ln|mix-ln``,
``--mix-ln-alpha``, ``--admin-norm dyt``, ``--dyt-alpha-init``; fairseq glue in
``fairseq_admin_pos/models/norm_layers.py``).

Numbers, on tiny seeded CPU models built the way ``fairseq-train`` builds them:

* every sub-layer sum, every layer output and the stack outputs of the encoder and the
  decoder equal a computation written here from the model's own weights (attention, FFN,
  LayerNorm and DyT by hand, each placement through ``placements.sublayer_residual`` /
  ``reference_stack`` with the layer placements written out), the branch dropout replaced by
  a fixed scale so its position (Peri-LN: after the output norm) counts;
* Mix-LN's Post-LN/Pre-LN switch and final LayerNorm in the built model for several depths
  and alphas, and ``alpha 0`` / ``alpha 1`` the Pre-LN / Post-LN model exactly (parameters,
  outputs, a training step), with LayerNorm and with DyT;
* DyT's ``alpha``, ``weight`` and ``bias`` gradients inside the model against their formulas;
* incremental decoding equal to a full decoder forward;
* ``fairseq-train`` + ``fairseq-generate`` for each DyT placement and Mix-LN at an explicit
  alpha, the hypotheses' scores recomputed from the checkpoint; ``fairseq-interactive``, the
  hub interface and ``fairseq-hydra-train`` on these settings.

(Peri-LN and Mix-LN at the default alpha also train and generate in ``test_schemes.py``;
the refusals are in ``test_flag_errors.py``, the export's in ``test_export_*.py``, the
host-sync, precision and monitor checks in their files.)
"""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fairseq_admin_pos.norms import DynamicTanh
from fairseq_admin_pos.placements import Sublayer, reference_stack, sublayer_residual
from fairseq_cli_utils import (
    REPO,
    TINY_MODEL,
    USER_DIR,
    env,
    generate,
    run,
    train_losses,
)
from model_utils import SMALL, assert_incremental_matches_full, build, build_trainer, sample_batch

PRE_LN = ["--admin-init", "none", "--encoder-normalize-before", "--decoder-normalize-before"]
DYT = ["--admin-norm", "dyt"]
#: the placements' flags (Mix-LN at alpha 0.5 so that a small stack has both kinds)
PLACEMENT_FLAGS = {
    "post-ln": ["--admin-init", "none"],
    "pre-ln": PRE_LN,
    "peri-ln": ["--admin-residual", "peri-ln"],
    "mix-ln": ["--admin-residual", "mix-ln", "--mix-ln-alpha", "0.5"],
}
P, Q = "post-ln", "pre-ln"
#: each layer's placement written out, (encoder 4 layers, decoder 3 layers): Mix-LN at 0.5
#: has floor(0.5 * 4) = 2 and floor(0.5 * 3) = 1 Post-LN layers at the bottom
LAYERS = {
    "post-ln": ([P] * 4, [P] * 3),
    "pre-ln": ([Q] * 4, [Q] * 3),
    "peri-ln": (["peri-ln"] * 4, ["peri-ln"] * 3),
    "mix-ln": ([P, P, Q, Q], [P, Q, Q]),
}
DEPTHS = ["--encoder-layers", "4", "--decoder-layers", "3"]
BRANCH_SCALE = 3.0  # stands in for the branch dropout (applied last on the branch)


# --------------------------------------------------------------------------------------- #
# the computation by hand
# --------------------------------------------------------------------------------------- #
def norm_by_hand(m):
    """The module's formula with its own parameters: DyT ``g * tanh(a x) + b``, LayerNorm
    ``(x - mean) / sqrt(var + eps) * g + b``."""
    if isinstance(m, DynamicTanh):
        return lambda x: m.weight * torch.tanh(m.alpha * x) + m.bias
    assert isinstance(m, nn.LayerNorm)

    def layer_norm(x):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + m.eps) * m.weight + m.bias

    return layer_norm


def attention_by_hand(m, query, key, key_pad=None, causal=False):
    """fairseq's MultiheadAttention written out: ``(T, B, C)`` -> ``(T, B, C)``."""
    t, b, c = query.shape
    h = m.num_heads
    d = c // h

    def heads(x, proj):
        return F.linear(x, proj.weight, proj.bias).reshape(x.size(0), b * h, d).transpose(0, 1)

    q, k, v = heads(query, m.q_proj) * d ** -0.5, heads(key, m.k_proj), heads(key, m.v_proj)
    scores = q @ k.transpose(1, 2)  # (B*H, T, S)
    if key_pad is not None:
        scores = scores.masked_fill(key_pad.repeat_interleave(h, 0)[:, None, :], float("-inf"))
    if causal:
        future = torch.ones(t, key.size(0), dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, b, c)
    return F.linear(out, m.out_proj.weight, m.out_proj.bias)


def ffn_by_hand(layer):
    return lambda x: F.linear(F.relu(F.linear(x, layer.fc1.weight, layer.fc1.bias)),
                              layer.fc2.weight, layer.fc2.bias)


def sublayers_by_hand(layer, pad, enc=None, enc_pad=None):
    """The layer's residual sub-layers as ``placements.Sublayer`` (function, its norm,
    Peri-LN's output norm), the functions and norms written out."""
    def out_norm(name):
        m = getattr(layer, name)
        return None if m is None else norm_by_hand(m)

    subs = [Sublayer(lambda x: attention_by_hand(layer.self_attn, x, x, pad, causal=enc is not None),
                     norm_by_hand(layer.self_attn_layer_norm), out_norm("self_attn_out_layer_norm"))]
    if enc is not None:
        subs.append(Sublayer(lambda x: attention_by_hand(layer.encoder_attn, x, enc, enc_pad),
                             norm_by_hand(layer.encoder_attn_layer_norm),
                             out_norm("encoder_attn_out_layer_norm")))
    subs.append(Sublayer(ffn_by_hand(layer), norm_by_hand(layer.final_layer_norm),
                         out_norm("ffn_out_layer_norm")))
    return subs


class Scale(nn.Module):
    """A deterministic stand-in for the branch dropout."""

    def forward(self, x):
        return BRANCH_SCALE * x


def randomize_norms_(model, seed=5):
    """Non-trivial normalisation parameters (weight != 1, bias != 0, alpha != 0.5), so a
    norm applied in the wrong place or skipped shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.LayerNorm, DynamicTanh)):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))
            if isinstance(m, DynamicTanh):
                m.alpha.fill_(0.3 + 0.9 * torch.rand(1, generator=g).item())


def capture(modules, store, key, pre=False, index=None):
    for i, m in enumerate(modules):
        if pre:
            m.register_forward_pre_hook(lambda mod, args, i=i: store.setdefault(key, {}).__setitem__(
                i, args[0].detach()))
        else:
            m.register_forward_hook(lambda mod, args, out, i=i: store.setdefault(key, []).append(
                (out if index is None else out[index]).detach()))


def model_with_hooks(data, placement, norm):
    flags = SMALL + DEPTHS + PLACEMENT_FLAGS[placement] + (DYT if norm == "dyt" else []) + [
        "--dropout", "0.3"]
    model, task, _ = build(data, "admin_transformer", flags, seed=7)
    randomize_norms_(model)
    model.eval()
    for layer in [*model.encoder.layers, *model.decoder.layers]:
        layer.dropout_module = Scale()
    seen = {}
    capture(model.encoder.layers[:1], seen, "enc_in", pre=True)
    capture(model.decoder.layers[:1], seen, "dec_in", pre=True)
    capture(model.encoder.layers, seen, "enc_layers")
    capture(model.decoder.layers, seen, "dec_layers", index=0)
    for side, stack in (("enc", model.encoder), ("dec", model.decoder)):
        capture([r for layer in stack.layers for r in
                 (layer.self_attn_residual, getattr(layer, "encoder_attn_residual", None),
                  layer.final_residual) if r is not None], seen, f"{side}_sums")
    return model, task, seen


def stack_by_hand(x, layers, layer_placements, pad, enc=None, enc_pad=None):
    """Per layer: its sub-layers through ``sublayer_residual`` with the layer's placement;
    returns (layer outputs, residual sums)."""
    outs, sums = [], []

    def residual(a, f):
        sums.append(a + f)
        return sums[-1]

    for layer, placement in zip(layers, layer_placements):
        for sub in sublayers_by_hand(layer, pad, enc, enc_pad):
            x = sublayer_residual(x, sub.f, placement, sub.norm, sub.out_norm,
                                  dropout=Scale(), residual=residual)
        outs.append(x)
    return outs, sums


@pytest.mark.parametrize("norm", ["layernorm", "dyt"])
@pytest.mark.parametrize("placement", list(PLACEMENT_FLAGS))
def test_sublayers_layers_and_stacks_match_hand_computation(tiny_data, placement, norm):
    model, task, seen = model_with_hooks(tiny_data, placement, norm)
    src, lengths, prev = sample_batch(task, bsz=3, src_len=7, tgt_len=6, left_pad_lengths=[7, 4, 6])
    with torch.no_grad():
        enc_out = model.encoder(src, src_lengths=lengths)
        features = model.decoder(prev, encoder_out=enc_out, features_only=True)[0]
    enc_layers, dec_layers = LAYERS[placement]
    final = placement != "post-ln"
    kind = DynamicTanh if norm == "dyt" else nn.LayerNorm
    for stack, n in ((model.encoder, 4), (model.decoder, 3)):
        assert [layer.normalize_before for layer in stack.layers] == [
            p != "post-ln" for p in (enc_layers if stack is model.encoder else dec_layers)]
        assert isinstance(stack.layer_norm, kind) if final else stack.layer_norm is None
        assert all((layer.ffn_out_layer_norm is not None) == (placement == "peri-ln")
                   for layer in stack.layers)
        assert all(isinstance(m, (kind, nn.Identity)) for m in stack.modules()
                   if isinstance(m, (nn.LayerNorm, DynamicTanh)))

    src_pad = src.eq(model.encoder.padding_idx)
    with torch.no_grad():
        # the encoder: layer by layer, then the whole stack through reference_stack
        x0 = seen["enc_in"][0]
        outs, sums = stack_by_hand(x0, model.encoder.layers, enc_layers, src_pad)
        for got, want in zip(seen["enc_layers"] + seen["enc_sums"], outs + sums):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        layers = [sublayers_by_hand(layer, src_pad) for layer in model.encoder.layers]
        enc_ref = reference_stack(
            x0, layers, placement, mix_ln_alpha=0.5, dropout=Scale(),
            final_norm=norm_by_hand(model.encoder.layer_norm) if final else None)
        torch.testing.assert_close(enc_out["encoder_out"][0], enc_ref, atol=2e-5, rtol=1e-5)
        # the decoder on that encoder output (causal self-attention, encoder attention)
        y0 = seen["dec_in"][0]
        tgt_pad = prev.eq(model.decoder.padding_idx)
        outs, sums = stack_by_hand(y0, model.decoder.layers, dec_layers, tgt_pad, enc_ref,
                                   src_pad)
        for got, want in zip(seen["dec_layers"] + seen["dec_sums"], outs + sums):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        layers = [sublayers_by_hand(layer, tgt_pad, enc_ref, src_pad)
                  for layer in model.decoder.layers]
        dec_ref = reference_stack(
            y0, layers, placement, mix_ln_alpha=0.5, dropout=Scale(),
            final_norm=norm_by_hand(model.decoder.layer_norm) if final else None)
        torch.testing.assert_close(features, dec_ref.transpose(0, 1), atol=2e-5, rtol=1e-5)
    assert len(seen["enc_sums"]) == 8 and len(seen["dec_sums"]) == 9


# --------------------------------------------------------------------------------------- #
# Mix-LN's switch, and its endpoints
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("layers,alpha,post", [
    # (layers of the stack, --mix-ln-alpha, Post-LN layers at its bottom: floor(alpha L))
    (1, "0.25", 0), (4, "0.25", 1), (6, "0.25", 1), (12, "0.25", 3), (24, "0.25", 6),
    (10, "0.7", 7), (7, "0.5", 3), (5, "0.99", 4), (3, "0", 0), (3, "1", 3), (2, "1.0", 2),
])
def test_mix_ln_layers_per_depth_and_alpha(tiny_data, layers, alpha, post):
    model, _, args = build(tiny_data, "admin_transformer", SMALL + [
        "--admin-residual", "mix-ln", "--mix-ln-alpha", alpha, "--encoder-layers", str(layers),
        "--decoder-layers", "4"])
    assert args.mix_ln_alpha == float(alpha) and model.admin_settings["mix_ln_alpha"] == float(alpha)
    assert [layer.normalize_before for layer in model.encoder.layers] == \
        [False] * post + [True] * (layers - post)
    # the stack ends with a LayerNorm iff one of its layers is Pre-LN
    assert (model.encoder.layer_norm is not None) == (post < layers)
    dec_post = int(4 * float(alpha) + 1e-9)  # the decoder counts its own 4 layers
    assert [layer.normalize_before for layer in model.decoder.layers] == \
        [False] * dec_post + [True] * (4 - dec_post)
    assert all(layer.self_attn_out_layer_norm is None for layer in model.encoder.layers)


def test_mix_ln_default_alpha_is_the_papers(tiny_data):
    model, _, _ = build(tiny_data, "admin_transformer", SMALL + [
        "--admin-residual", "mix-ln", "--encoder-layers", "8", "--decoder-layers", "3"])
    assert model.admin_settings["mix_ln_alpha"] == 0.25
    assert [layer.normalize_before for layer in model.encoder.layers] == [False] * 2 + [True] * 6
    assert [layer.normalize_before for layer in model.decoder.layers] == [True] * 3


def _loss_after_step(data, flags):
    trainer = build_trainer(data, TINY_MODEL + ["--dropout", "0.2", *flags])
    sample = next(iter(trainer.get_train_iterator(epoch=1).next_epoch_itr(shuffle=False)))
    log = trainer.train_step([sample])
    return log["loss"], trainer.get_model().state_dict()


@pytest.mark.parametrize("norm", ["layernorm", "dyt"])
@pytest.mark.parametrize("alpha,twin", [("0", PRE_LN), ("1", ["--admin-init", "none"])])
def test_mix_ln_alpha_0_is_pre_ln_and_1_is_post_ln(tiny_data, alpha, twin, norm):
    """Same seed: the same parameters (names, values), the same outputs bit for bit, and the
    same training step (dropout on) as the Pre-LN (alpha 0) or Post-LN (alpha 1) model."""
    extra = (DYT if norm == "dyt" else []) + ["--encoder-layers", "3", "--decoder-layers", "2"]
    mix_flags = ["--admin-residual", "mix-ln", "--mix-ln-alpha", alpha, *extra]
    mix, task, _ = build(tiny_data, "admin_transformer", SMALL + mix_flags, seed=3)
    ref, _, _ = build(tiny_data, "admin_transformer", SMALL + twin + extra, seed=3)
    a = {k: v for k, v in mix.state_dict().items() if k != "_extra_state"}
    b = {k: v for k, v in ref.state_dict().items() if k != "_extra_state"}
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    mix.eval(), ref.eval()
    src, lengths, prev = sample_batch(task, left_pad_lengths=[7, 4, 6])
    with torch.no_grad():
        assert torch.equal(mix(src, lengths, prev)[0], ref(src, lengths, prev)[0])
    loss_mix, after_mix = _loss_after_step(tiny_data, mix_flags)
    loss_ref, after_ref = _loss_after_step(tiny_data, twin + extra)
    assert loss_mix == loss_ref
    assert all(torch.equal(after_mix[k], after_ref[k]) for k in a)


def test_peri_ln_has_pre_ln_weights_for_the_same_seed(tiny_data):
    """Norm modules draw no random numbers and are added after fairseq's: Peri-LN (with
    LayerNorm or DyT) has exactly the Pre-LN model's other parameters, plus its output
    norms (ones, zeros; DyT's alpha = --dyt-alpha-init)."""
    pre, _, _ = build(tiny_data, "admin_transformer", SMALL + PRE_LN, seed=9)
    want = pre.state_dict()
    for flags in ([], DYT + ["--dyt-alpha-init", "0.8"]):
        peri, _, _ = build(tiny_data, "admin_transformer",
                           SMALL + ["--admin-residual", "peri-ln", *flags], seed=9)
        got = peri.state_dict()
        extra = sorted(set(got) - set(want) - {"_extra_state"})
        assert all("_out_layer_norm." in k or k.endswith(".alpha") for k in extra), extra
        # 6 encoder + 6 decoder layers' output norms
        assert sum(k.endswith("_out_layer_norm.weight") for k in extra) == 6 * 2 + 6 * 3
        # every Pre-LN parameter, its LayerNorms' too (DyT's weight 1 and bias 0 as theirs)
        assert all(torch.equal(got[k], v) for k, v in want.items() if k != "_extra_state")
        for k in extra:
            if k.endswith(".alpha"):
                assert got[k].tolist() == [pytest.approx(0.8)]
            else:
                assert torch.equal(got[k], torch.ones_like(got[k]) if k.endswith(".weight")
                                   else torch.zeros_like(got[k]))


# --------------------------------------------------------------------------------------- #
# DyT's gradients inside the model
# --------------------------------------------------------------------------------------- #
def test_dyt_gradients_in_the_model_match_their_formulas(tiny_data):
    """For a sub-layer DyT, a Peri-LN output DyT and the decoder's final DyT of a training
    forward: with the input x and upstream gradient u recorded, ``t = tanh(a x)``:
    ``dalpha = sum(u * g * (1 - t^2) * x)``, ``dweight = sum(u * t)``, ``dbias = sum(u)``
    (sums over every element, resp. over all but the channels)."""
    model, task, _ = build(tiny_data, "admin_transformer",
                           SMALL + ["--admin-residual", "peri-ln", *DYT, "--dropout", "0.1"])
    randomize_norms_(model)
    model.train()
    picked = {"sub": model.encoder.layers[1].final_layer_norm,
              "out": model.decoder.layers[0].encoder_attn_out_layer_norm,
              "final": model.decoder.layer_norm}
    record = {}
    for name, m in picked.items():
        def hook(mod, args, out, name=name):
            record[name] = {"x": args[0].detach()}
            out.register_hook(lambda grad, name=name: record[name].__setitem__("u", grad.detach()))
        m.register_forward_hook(hook)
    src, lengths, prev = sample_batch(task, left_pad_lengths=[7, 4, 6])
    torch.manual_seed(0)
    model(src, lengths, prev)[0].logsumexp(-1).sum().backward()
    for name, m in picked.items():
        x, u = record[name]["x"].double(), record[name]["u"].double()
        a, g = m.alpha.detach().double(), m.weight.detach().double()
        t = torch.tanh(a * x)
        dims = tuple(range(x.dim() - 1))
        torch.testing.assert_close(m.alpha.grad.double(), (u * g * (1 - t ** 2) * x).sum().reshape(1),
                                   rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(m.weight.grad.double(), (u * t).sum(dims), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(m.bias.grad.double(), u.sum(dims), rtol=1e-4, atol=1e-6)
        assert m.alpha.grad.abs().item() > 0


# --------------------------------------------------------------------------------------- #
# incremental decoding
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("flags", [
    ["--admin-residual", "peri-ln"],
    ["--admin-residual", "mix-ln", "--mix-ln-alpha", "0.5"],
    ["--admin-init", "none", *DYT],
    [*PRE_LN, *DYT],
    ["--admin-residual", "peri-ln", *DYT],
    ["--admin-residual", "mix-ln", "--mix-ln-alpha", "0.34", *DYT],
], ids=["peri-ln", "mix-ln", "post-ln-dyt", "pre-ln-dyt", "peri-ln-dyt", "mix-ln-dyt"])
def test_incremental_decoding_equals_full_decoding(tiny_data, flags):
    model, task, _ = build(tiny_data, "admin_transformer", SMALL + flags + [
        "--encoder-layers", "3", "--decoder-layers", "3"])
    randomize_norms_(model)
    assert_incremental_matches_full(model, task, tgt_len=7)


# --------------------------------------------------------------------------------------- #
# fairseq-train, fairseq-generate, fairseq-interactive, the hub, fairseq-hydra-train
# --------------------------------------------------------------------------------------- #
E2E = {
    "post-ln-dyt": ["--admin-init", "none", *DYT],
    "pre-ln-dyt": [*PRE_LN, *DYT, "--dyt-alpha-init", "0.7"],
    "peri-ln-dyt": ["--admin-residual", "peri-ln", *DYT],
    "mix-ln-dyt": ["--admin-residual", "mix-ln", "--mix-ln-alpha", "0.5", *DYT],
    "mix-ln-0.5": ["--admin-residual", "mix-ln", "--mix-ln-alpha", "0.5"],
}


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """``name -> (fairseq-train log, checkpoint, fairseq-generate stdout)``, trained on use."""
    done = {}

    def get(name):
        if name not in done:
            save = tmp_path_factory.mktemp(name)
            proc = run("fairseq_cli.train", [
                tiny_data, "--user-dir", USER_DIR, "--arch", "admin_transformer", *TINY_MODEL,
                *E2E[name], "--dropout", "0.1", "--cpu", "--seed", "3", "--optimizer", "adam",
                "--lr", "3e-3", "--max-tokens", "400", "--no-progress-bar", "--log-format",
                "simple", "--log-interval", "1", "--num-workers", "0", "--criterion",
                "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-epoch", "2",
                "--save-dir", save, "--no-epoch-checkpoints"])
            ckpt = save / "checkpoint_last.pt"
            done[name] = (proc.stdout + proc.stderr, ckpt, generate(tiny_data, ckpt).stdout)
        return done[name]

    return get


def h_lines(stdout):
    """``[(sentence id, score, text)]`` of the ``H-`` lines, by id."""
    rows = [line.split("\t") for line in stdout.splitlines() if line.startswith("H-")]
    return sorted((int(sid[2:]), float(score), text) for sid, score, text in rows)


def load(ckpt, data):
    from fairseq import checkpoint_utils

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(ckpt)], arg_overrides={"data": str(data)})
    return models[0].eval(), cfg, task


def rescored(model, task, generated):
    """Each hypothesis of fairseq-generate scored again by one teacher-forced forward of the
    loaded model: the mean log2-probability of its tokens and EOS (fairseq's score with
    --lenpen 1), against the printed one."""
    task.load_dataset("test")
    ds, tgt = task.dataset("test"), task.target_dictionary
    out = []
    for sid, score, text in h_lines(generated):
        src = ds[sid]["source"][None]
        hyp = tgt.encode_line(text, add_if_not_exist=False, append_eos=True).long()[None]
        prev = torch.cat([hyp.new_full((1, 1), tgt.eos()), hyp[:, :-1]], dim=1)
        with torch.no_grad():
            logits = model(src, torch.tensor([src.size(1)]), prev)[0]
        lp = model.get_normalized_probs((logits, None), log_probs=True).gather(-1, hyp[..., None])
        out.append((score, lp.mean().item() / math.log(2)))
    return out


@pytest.mark.parametrize("name", list(E2E))
def test_fairseq_train_and_generate(tiny_data, runs, name):
    """Two epochs: finite losses, the validation loss goes down, the settings and DyT's
    trained alphas in the checkpoint; fairseq-generate's 24 hypotheses, each score equal to
    the loaded checkpoint's teacher-forced score of that hypothesis."""
    log, ckpt, generated = runs(name)
    losses = [float(v) for v in train_losses(log)]
    assert len(losses) >= 8 and all(math.isfinite(v) for v in losses), losses
    valid = [float(v) for v in re.findall(
        r"\| valid \| epoch \d+ \| valid on 'valid' subset \| loss ([0-9.]+)", log)]
    assert len(valid) == 2 and valid[1] < valid[0], valid
    model, cfg, task = load(ckpt, tiny_data)
    settings = model.admin_settings
    flags = E2E[name]
    assert settings["admin_norm"] == ("dyt" if "dyt" in name else "layernorm")
    assert settings["mix_ln_alpha"] == (0.5 if "mix-ln" in name else None)
    assert settings["dyt_alpha_init"] == (
        float(flags[flags.index("--dyt-alpha-init") + 1]) if "--dyt-alpha-init" in flags
        else 0.5 if "dyt" in name else None)
    alphas = [m.alpha.item() for m in model.modules() if isinstance(m, DynamicTanh)]
    assert bool(alphas) == ("dyt" in name)
    assert all(a != settings["dyt_alpha_init"] for a in alphas)  # trained
    pairs = rescored(model, task, generated)
    assert len(pairs) == 24 and "BLEU4" in generated
    for printed, recomputed in pairs:
        assert printed == pytest.approx(recomputed, abs=1e-5)


def test_interactive_and_hub_translate_like_generate(tiny_data, runs):
    """fairseq-interactive on the raw test sentences (the data's words) and the hub
    interface give fairseq-generate's hypotheses for a Peri-LN DyT checkpoint."""
    from fairseq.models.transformer import TransformerModel

    _, ckpt, _ = runs("peri-ln-dyt")
    raw = (Path(tiny_data).parent / "raw" / "test.src").read_text().splitlines()[:6]
    gen = generate(tiny_data, ckpt, ["--batch-size", "1"]).stdout
    want = {sid: text for sid, _, text in h_lines(gen) if sid < 6}
    inter = run("fairseq_cli.interactive", [
        tiny_data, "--user-dir", USER_DIR, "--path", ckpt, "--beam", "3", "--cpu",
        "--source-lang", "src", "--target-lang", "tgt"], input="\n".join(raw) + "\n").stdout
    got = {int(line.split("\t")[0][2:]): line.split("\t")[2] for line in inter.splitlines()
           if line.startswith("H-")}
    assert got == want
    hub = TransformerModel.from_pretrained(str(ckpt.parent), checkpoint_file=ckpt.name,
                                           data_name_or_path=str(tiny_data), user_dir=USER_DIR)
    assert type(hub.models[0]).__name__ == "AdminTransformerModel"
    assert [hub.translate(s, beam=3) for s in raw] == [want[i] for i in range(6)]


def test_hydra_train_with_mix_ln_and_dyt(tiny_data, tmp_path):
    """fairseq-hydra-train with the shipped config switched to Mix-LN (alpha 0.5) and DyT by
    model overrides: the settings reach the model (per-layer placement, DyT everywhere) and
    travel in the checkpoint."""
    save = tmp_path / "hydra"
    proc = subprocess.run([
        str(Path(sys.executable).parent / "fairseq-hydra-train"),
        "--config-dir", "examples/wmt14_en_de/hydra", "--config-name", "admin-paper_18l_18l",
        f"task.data={tiny_data}", "task.source_lang=src", "task.target_lang=tgt",
        f"checkpoint.save_dir={save}", "common.fp16=false", "common.cpu=true",
        "common.log_interval=1", "common.no_progress_bar=true",
        "distributed_training.distributed_world_size=1",
        "distributed_training.ddp_backend=legacy_ddp", "dataset.max_tokens=400",
        "dataset.num_workers=0", "dataset.disable_validation=true",
        "optimization.max_update=2", "model.admin_init=none", "~model.admin_profile_mode",
        "model.admin_omega=buffer", "+model.admin_residual=mix-ln", "+model.mix_ln_alpha=0.5",
        "+model.admin_norm=dyt", "+model.dyt_alpha_init=0.6", "+model.encoder_layers=4",
        "+model.decoder_layers=2",
        *[f"+model.{k}={v}" for k, v in (("encoder_embed_dim", 32), ("decoder_embed_dim", 32),
                                         ("encoder_ffn_embed_dim", 64),
                                         ("decoder_ffn_embed_dim", 64),
                                         ("encoder_attention_heads", 2),
                                         ("decoder_attention_heads", 2))],
    ], cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    model, _, _ = load(save / "checkpoint_last.pt", tiny_data)
    assert {k: model.admin_settings[k] for k in ("admin_residual", "mix_ln_alpha", "admin_norm",
                                                 "dyt_alpha_init")} == {
        "admin_residual": "mix-ln", "mix_ln_alpha": 0.5, "admin_norm": "dyt",
        "dyt_alpha_init": 0.6}
    assert [layer.normalize_before for layer in model.encoder.layers] == [False, False, True, True]
    assert [layer.normalize_before for layer in model.decoder.layers] == [False, True]
    assert isinstance(model.encoder.layer_norm, DynamicTanh)
    assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())
