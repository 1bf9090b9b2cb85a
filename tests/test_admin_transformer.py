"""admin_transformer built in-process the way fairseq-train builds it: omegas, parity with
stock fairseq, positions, incremental decoding, and flag errors."""
import math

import pytest
import torch

from fairseq_admin_pos.admin import OmegaResidual
from model_utils import (
    POS_CHOICES,
    SMALL,
    assert_incremental_matches_full,
    build,
    parse,
    residuals,
    sample_batch,
)


def expected_omega(n: int, scale: str) -> float:
    # independent of calculate_init: written from the paper/admin-torch formulas
    if scale == "O(n)":
        return 1.0
    if scale == "O(1)":
        return math.sqrt(n)
    return math.sqrt((n + 1) / math.log(n + 1) - 1)


@pytest.mark.parametrize("enc,dec", [(1, 1), (3, 2), (6, 6)])
@pytest.mark.parametrize("scale", ["O(logn)", "O(n)", "O(1)"])
@pytest.mark.parametrize("form", ["buffer", "parameter"])
def test_closed_form_omegas(tiny_data, enc, dec, scale, form):
    model, _, _ = build(tiny_data, "admin_transformer", SMALL + [
        "--encoder-layers", enc, "--decoder-layers", dec,
        "--admin-output-change-scale", scale, "--admin-omega", form,
    ])
    enc_res, dec_res = residuals(model.encoder), residuals(model.decoder)
    assert len(enc_res) == 2 * enc and len(dec_res) == 3 * dec
    for mods, n in ((enc_res, 2 * enc), (dec_res, 3 * dec)):
        for m in mods:
            assert isinstance(m, OmegaResidual)
            want = torch.full((16,) if form == "parameter" else (1,), expected_omega(n, scale))
            torch.testing.assert_close(m.omega.detach(), want, rtol=1e-6, atol=0)
            assert isinstance(m.omega, torch.nn.Parameter) == (form == "parameter")


def test_no_cross_attention_counts_two_sublayers(tiny_data):
    model, _, _ = build(tiny_data, "admin_transformer", SMALL + [
        "--encoder-layers", "1", "--decoder-layers", "4", "--no-cross-attention"])
    dec_res = residuals(model.decoder)
    assert len(dec_res) == 8
    torch.testing.assert_close(dec_res[0].omega.detach(),  # the default: a trainable vector
                               torch.full((16,), expected_omega(8, "O(logn)")))


@pytest.mark.parametrize("pos", ["sinusoidal", "learned"])
@pytest.mark.parametrize("pre_ln", [False, True])
def test_none_buffer_is_stock_transformer(tiny_data, pos, pre_ln):
    """Same seed -> same parameters, and bitwise the same outputs, train and eval mode."""
    extra = SMALL + ["--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0.2"]
    if pos == "learned":
        extra += ["--encoder-learned-pos", "--decoder-learned-pos"]
    if pre_ln:
        extra += ["--encoder-normalize-before", "--decoder-normalize-before"]
    stock, task, _ = build(tiny_data, "transformer", extra, seed=5)
    admin, _, _ = build(tiny_data, "admin_transformer", extra + ["--admin-init", "none"], seed=5)

    s_state, a_state = stock.state_dict(), admin.state_dict()
    extra_keys = set(a_state) - set(s_state)
    assert set(s_state) <= set(a_state)
    assert extra_keys and all(k.endswith(".omega") or k == "_extra_state" for k in extra_keys)
    for k, v in s_state.items():
        assert torch.equal(v, a_state[k]), k

    src, lengths, prev = sample_batch(task, left_pad_lengths=[7, 5, 3])
    for train_mode in (False, True):
        stock.train(train_mode)
        admin.train(train_mode)
        torch.manual_seed(11)
        out_s = stock(src, lengths, prev)[0]
        torch.manual_seed(11)
        out_a = admin(src, lengths, prev)[0]
        assert torch.equal(out_s, out_a)


def test_admin_differs_from_stock_when_omega_not_one(tiny_data):
    extra = SMALL + ["--encoder-layers", "3", "--decoder-layers", "3", "--dropout", "0"]
    stock, task, _ = build(tiny_data, "transformer", extra, seed=5)
    admin, _, _ = build(tiny_data, "admin_transformer", extra, seed=5)
    stock.eval(), admin.eval()
    src, lengths, prev = sample_batch(task)
    assert not torch.allclose(stock(src, lengths, prev)[0], admin(src, lengths, prev)[0])


def _manual_encoder_layer(layer, x, omega_attn, omega_ffn):
    """Independent Post-LN Admin encoder layer: LN(x * omega + f(x)), eval mode."""
    f, _ = layer.self_attn(query=x, key=x, value=x, key_padding_mask=None, need_weights=False)
    x = layer.self_attn_layer_norm(x * omega_attn + f)
    f = layer.fc2(torch.relu(layer.fc1(x)))
    return layer.final_layer_norm(x * omega_ffn + f)


@pytest.mark.parametrize("form", ["buffer", "parameter"])
def test_encoder_layer_formula(tiny_data, form):
    model, _, _ = build(tiny_data, "admin_transformer", SMALL + [
        "--encoder-layers", "4", "--admin-omega", form])
    model.eval()
    layer = model.encoder.layers[0]
    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(0))
    omega = expected_omega(8, "O(logn)")
    torch.testing.assert_close(layer(x, None), _manual_encoder_layer(layer, x, omega, omega))


@pytest.mark.parametrize("pos", POS_CHOICES)
@pytest.mark.parametrize("form", ["buffer", "parameter"])
def test_incremental_decoding_matches_full_forward(tiny_data, pos, form):
    model, task, _ = build(tiny_data, "admin_transformer", SMALL + [
        "--encoder-layers", "2", "--decoder-layers", "3", "--encoder-pos-emb", pos,
        "--decoder-pos-emb", pos, "--admin-omega", form])
    assert_incremental_matches_full(model, task)


@pytest.mark.parametrize("pos", POS_CHOICES)
def test_left_padding_gives_same_positions(tiny_data, pos):
    """A left-padded source encodes exactly like the same sentence without padding."""
    model, task, _ = build(tiny_data, "admin_transformer", SMALL + [
        "--encoder-layers", "2", "--encoder-pos-emb", pos])
    model.eval()
    src, lengths, _ = sample_batch(task, bsz=1, src_len=6)
    pad = task.source_dictionary.pad()
    padded = torch.cat([torch.full((1, 3), pad), src], dim=1)
    with torch.no_grad():
        a = model.encoder(src, src_lengths=lengths)["encoder_out"][0]
        b = model.encoder(padded, src_lengths=lengths)["encoder_out"][0][3:]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if pos != "none":
        emb = model.encoder.embed_positions
        torch.testing.assert_close(emb(src), emb(padded)[:, 3:])
        assert emb(padded)[:, :3].abs().max() == 0  # pads get the zero row


@pytest.mark.parametrize("side", ["encoder", "decoder"])
def test_position_choice_builds_expected_module(tiny_data, side):
    from fairseq.modules import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding

    from fairseq_admin_pos.models.positions import ScaledSinusoidalPositions

    expected = {
        "sinusoidal": SinusoidalPositionalEmbedding,
        "learned": LearnedPositionalEmbedding,
        "scaled-sinusoidal": ScaledSinusoidalPositions,
    }
    for choice, cls in expected.items():
        model, _, args = build(tiny_data, "admin_transformer", SMALL + [f"--{side}-pos-emb", choice])
        assert isinstance(getattr(model, side).embed_positions, cls)
        assert getattr(args, f"{side}_learned_pos") == (choice == "learned")
    model, _, _ = build(tiny_data, "admin_transformer", SMALL + [f"--{side}-pos-emb", "none"])
    assert getattr(model, side).embed_positions is None
    other = "decoder" if side == "encoder" else "encoder"
    assert getattr(model, other).embed_positions is not None


def test_scaled_sinusoid_scale_is_trained_and_table_is_not(tiny_data):
    model, task, _ = build(tiny_data, "admin_transformer", SMALL + [
        "--encoder-pos-emb", "scaled-sinusoidal", "--decoder-pos-emb", "scaled-sinusoidal"])
    src, lengths, prev = sample_batch(task)
    model(src, lengths, prev)[0].sum().backward()
    emb = model.encoder.embed_positions.embed
    assert emb.scaling.grad is not None and emb.scaling.grad.abs().item() > 0
    assert emb.embedding.weight.grad is None
    torch.testing.assert_close(emb.scaling.detach(), torch.tensor([16 ** -0.5]))


def test_legacy_flags_map_to_choice(tiny_data):
    args = parse(tiny_data, "admin_transformer", ["--encoder-learned-pos"])
    model, _, args = build(tiny_data, "admin_transformer", SMALL + ["--encoder-learned-pos"])
    assert args.encoder_pos_emb == "learned" and args.decoder_pos_emb == "sinusoidal"
    model, _, args = build(tiny_data, "admin_transformer", SMALL + ["--no-token-positional-embeddings"])
    assert args.encoder_pos_emb == args.decoder_pos_emb == "none"
    assert model.encoder.embed_positions is None and model.decoder.embed_positions is None


@pytest.mark.parametrize("extra,match", [
    (["--encoder-normalize-before"], "--encoder-normalize-before.*--admin-init none"),
    (["--decoder-normalize-before", "--admin-init", "closed-form"], "--decoder-normalize-before"),
    (["--encoder-learned-pos", "--encoder-pos-emb", "sinusoidal"], "--encoder-learned-pos contradicts"),
    (["--no-token-positional-embeddings", "--decoder-pos-emb", "learned"],
     "--no-token-positional-embeddings contradicts --decoder-pos-emb learned"),
])
def test_flag_errors(tiny_data, extra, match):
    with pytest.raises(ValueError, match=match):
        build(tiny_data, "admin_transformer", SMALL + extra)


def test_pre_ln_baseline_with_none_builds(tiny_data):
    model, _, _ = build(tiny_data, "admin_transformer", SMALL + [
        "--encoder-normalize-before", "--decoder-normalize-before", "--admin-init", "none"])
    assert model.encoder.layer_norm is not None
    assert all(m.omega.item() == 1.0 for m in residuals(model.encoder))


def test_settings_mismatch_on_load_is_an_error(tiny_data):
    a, _, _ = build(tiny_data, "admin_transformer", SMALL)
    b, _, _ = build(tiny_data, "admin_transformer", SMALL + ["--admin-output-change-scale", "O(1)"])
    with pytest.raises(ValueError, match=r"--admin-output-change-scale: checkpoint 'O\(logn\)'"):
        b.load_state_dict(a.state_dict())
    c, _, _ = build(tiny_data, "admin_transformer", SMALL)
    c.load_state_dict(a.state_dict())  # same settings load fine


@pytest.mark.parametrize("arch,enc,dec,dim", [
    ("admin_transformer", 6, 6, 512),
    ("admin_transformer_iwslt_de_en", 6, 6, 512),
    ("admin_transformer_wmt_en_de_60l_12l", 60, 12, 512),
    ("admin_transformer_wmt_en_de_100l_100l", 100, 100, 512),
    ("admin_transformer_vaswani_wmt_en_de_big", 6, 6, 1024),
])
def test_architecture_presets(tiny_data, arch, enc, dec, dim):
    args = parse(tiny_data, arch)
    from fairseq_admin_pos.models.admin_transformer import admin_base_architecture
    admin_base_architecture(args)
    assert (args.encoder_layers, args.decoder_layers, args.encoder_embed_dim) == (enc, dec, dim)
    assert args.admin_init == "closed-form" and args.admin_output_change_scale == "O(logn)"
