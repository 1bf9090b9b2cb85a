"""Tests for fairseq_admin_pos.positional (pure torch, CPU, seeded) and, at the end, for the
scaled-sinusoid position choice of admin_transformer built through fairseq's command line
(``--pos-emb-scaled-table``, ``--pos-emb-scale-init``)."""
import math
import os
import re
import types

import pytest
import torch
import torch.nn as nn

from fairseq_admin_pos.positional import PositionalEmbeddings, SinusoidalEmbeddings

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POSITIONAL_PATH = os.path.join(REPO_ROOT, "fairseq_admin_pos", "positional.py")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --------------------------------------------------------------------------- #
# independent loop references (math.sin/cos, written as plain double loops)
# --------------------------------------------------------------------------- #
def seed_loop_table(n_position, hidden_width):
    """The seed's table: angle pos / 10000^(2i/H) for every column i, row 0 zero,
    sin on even columns, cos on odd ones."""
    rows = []
    for pos in range(n_position):
        row = []
        for i in range(hidden_width):
            if pos == 0:
                row.append(0.0)
                continue
            angle = pos / math.pow(10000, 2 * i / hidden_width)
            row.append(math.sin(angle) if i % 2 == 0 else math.cos(angle))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64).to(torch.float32)


def standard_loop_table(n_position, hidden_width):
    """Vaswani et al.: PE(pos, 2j) = sin(pos / 10000^(2j/H)), PE(pos, 2j+1) = cos(same)."""
    table = [[0.0] * hidden_width for _ in range(n_position)]
    for pos in range(1, n_position):
        for j in range(0, hidden_width, 2):
            freq = math.exp(-math.log(10000.0) * j / hidden_width)
            table[pos][j] = math.sin(pos * freq)
            if j + 1 < hidden_width:
                table[pos][j + 1] = math.cos(pos * freq)
    return torch.tensor(table, dtype=torch.float64).to(torch.float32)


def fairseq_loop_table(n_position, hidden_width):
    """tensor2tensor/fairseq: h = H // 2 frequencies w_j = 10000^(-j / (h - 1)), first half
    sin(pos w_j), second half cos(pos w_j), a zero last column for odd H; row 0 included."""
    h = hidden_width // 2
    table = [[0.0] * hidden_width for _ in range(n_position)]
    for pos in range(n_position):
        for j in range(h):
            w = 10000.0 ** (-j / (h - 1))
            table[pos][j] = math.sin(pos * w)
            table[pos][h + j] = math.cos(pos * w)
    return torch.tensor(table, dtype=torch.float64).to(torch.float32)


REFERENCES = {"standard": standard_loop_table, "seed": seed_loop_table}
TOL = dict(rtol=0.0, atol=1e-6)  # float32 values in [-1, 1]; layouts differ by >> 1e-6


# --------------------------------------------------------------------------- #
# table
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("layout", ["standard", "seed"])
@pytest.mark.parametrize("n_position,hidden_width", [(1, 1), (2, 2), (9, 8), (17, 7), (33, 16), (64, 10)])
def test_vectorised_table_matches_loop(layout, n_position, hidden_width):
    table = SinusoidalEmbeddings.position_encoding_init(n_position, hidden_width, layout)
    assert table.dtype == torch.float32
    assert table.shape == (n_position, hidden_width)
    torch.testing.assert_close(table, REFERENCES[layout](n_position, hidden_width), **TOL)


def test_seed_layout_value_for_value():
    table = SinusoidalEmbeddings.position_encoding_init(50, 12, frequency_layout="seed")
    ref = seed_loop_table(50, 12)
    torch.testing.assert_close(table, ref, **TOL)
    assert (table == ref).float().mean() > 0.99  # almost all bit-identical
    # hand value: pos 3, column 5 (cos) -> cos(3 / 10000^(10/12))
    assert table[3, 5].item() == pytest.approx(math.cos(3 / 10000 ** (10 / 12)), abs=1e-7)


def test_default_layout_is_standard_and_differs_from_seed():
    default = SinusoidalEmbeddings(20, 8)
    assert default.frequency_layout == "standard"
    assert torch.equal(SinusoidalEmbeddings.position_encoding_init(20, 8),
                       SinusoidalEmbeddings.position_encoding_init(20, 8, "standard"))
    seed = SinusoidalEmbeddings(20, 8, frequency_layout="seed")
    assert (default.embedding.weight - seed.embedding.weight).abs().max() > 0.1
    # column 1 of the standard layout is cos(pos) (frequency 1, same as column 0)
    pos = torch.arange(1, 20, dtype=torch.float64)
    torch.testing.assert_close(default.embedding.weight[1:, 1], torch.cos(pos).float(), **TOL)


def test_standard_pairs_share_frequency():
    """sin^2 + cos^2 = 1 per pair and a shift by k is a fixed rotation per pair
    (only true for the standard layout)."""
    h = 16
    std = SinusoidalEmbeddings.position_encoding_init(40, h, "standard").double()
    seed = SinusoidalEmbeddings.position_encoding_init(40, h, "seed").double()
    norms = std[1:, 0::2] ** 2 + std[1:, 1::2] ** 2
    torch.testing.assert_close(norms, torch.ones_like(norms), rtol=0, atol=1e-6)
    assert ((seed[1:, 0::2] ** 2 + seed[1:, 1::2] ** 2) - 1).abs().max() > 0.1
    k = 3
    for j in range(h // 2):
        w = 10000.0 ** (-2 * j / h)
        rot = torch.tensor([[math.cos(k * w), -math.sin(k * w)], [math.sin(k * w), math.cos(k * w)]],
                           dtype=torch.float64)
        pair = std[1:-k, 2 * j:2 * j + 2]                 # (sin a, cos a)
        shifted = std[1 + k:, 2 * j:2 * j + 2]            # (sin(a+kw), cos(a+kw))
        torch.testing.assert_close(pair @ rot, shifted, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["standard", "seed"])
def test_row_zero_is_zero(layout):
    m = SinusoidalEmbeddings(10, 6, frequency_layout=layout)
    assert torch.equal(m.embedding.weight[0], torch.zeros(6))
    assert m.embedding.weight[1].abs().sum() > 0.5
    assert torch.equal(m(torch.tensor(0)), torch.zeros(6))


@pytest.mark.parametrize("layout", ["standard", "seed"])
def test_odd_width_last_column_is_sin(layout):
    h = 7
    table = SinusoidalEmbeddings(12, h, frequency_layout=layout).embedding.weight
    exponent = (2 * 3 if layout == "standard" else 2 * 6) / h
    pos = torch.arange(1, 12, dtype=torch.float64)
    torch.testing.assert_close(table[1:, -1], torch.sin(pos / 10000 ** exponent).float(), **TOL)


def test_large_table_is_fast_and_finite():
    table = SinusoidalEmbeddings.position_encoding_init(8192, 512)
    assert torch.isfinite(table).all()
    assert table.abs().max() <= 1.0
    torch.testing.assert_close(table[8191, :2].double(),
                               torch.tensor([math.sin(8191), math.cos(8191)], dtype=torch.float64),
                               rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- #
# forward
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("cls", [SinusoidalEmbeddings, PositionalEmbeddings])
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 5), (2, 3, 4)])
def test_forward_shapes_and_values(cls, shape):
    m = cls(16, 6)
    x = torch.randint(0, 16, shape)
    out = m(x)
    assert out.shape == shape + (6,)
    assert out.dtype == torch.float32
    assert torch.equal(out, m.embedding.weight.detach()[x])


def test_forward_accepts_int32():
    m = SinusoidalEmbeddings(8, 4)
    x = torch.tensor([[1, 7]], dtype=torch.int32)
    assert torch.equal(m(x), m(x.long()))


def test_table_gets_no_gradient_and_scaling_does():
    m = SinusoidalEmbeddings(20, 8, learnable_scaling=True)
    assert not m.embedding.weight.requires_grad
    assert isinstance(m.scaling, nn.Parameter) and m.scaling.requires_grad
    assert m.scaling.shape == (1,)
    assert m.scaling.item() == pytest.approx(1 / math.sqrt(8), rel=1e-7)
    assert [n for n, p in m.named_parameters() if p.requires_grad] == ["scaling"]
    x = torch.randint(0, 20, (3, 5))
    upstream = torch.randn(3, 5, 8)
    out = m(x)
    torch.testing.assert_close(out, m.embedding.weight[x] / math.sqrt(8))
    (out * upstream).sum().backward()
    assert m.embedding.weight.grad is None
    expected = (m.embedding.weight.detach()[x] * upstream).sum().reshape(1)
    torch.testing.assert_close(m.scaling.grad, expected)


def test_no_learnable_scaling_matches_seed_attribute():
    m = SinusoidalEmbeddings(10, 4)
    assert m.scaling == 1
    assert list(m.state_dict()) == ["embedding.weight"]
    assert list(p for p in m.parameters() if p.requires_grad) == []


def test_state_dict_keys_match_seed_and_roundtrip(tmp_path):
    src = SinusoidalEmbeddings(12, 6, learnable_scaling=True)
    assert sorted(src.state_dict()) == ["embedding.weight", "scaling"]
    with torch.no_grad():
        src.scaling.fill_(0.75)
    torch.save(src.state_dict(), tmp_path / "pos.pt")
    state = torch.load(tmp_path / "pos.pt", weights_only=True)
    dst = SinusoidalEmbeddings(12, 6, learnable_scaling=True)
    dst.load_state_dict(state, strict=True)
    x = torch.arange(12)
    assert torch.equal(dst(x), src(x))
    assert dst.scaling.item() == 0.75


def test_loads_a_seed_style_state_dict():
    """A checkpoint written by the seed (seed table, learned scaling) loads
    strictly and reproduces the seed output, whatever the default layout."""
    seed_state = {"embedding.weight": seed_loop_table(10, 6), "scaling": torch.tensor([0.5])}
    m = SinusoidalEmbeddings(10, 6, learnable_scaling=True)
    m.load_state_dict(seed_state, strict=True)
    x = torch.tensor([[1, 2, 9]])
    torch.testing.assert_close(m(x), seed_loop_table(10, 6)[x] * 0.5)
    assert not m.embedding.weight.requires_grad


@pytest.mark.parametrize("convert,dtype", [("half", torch.float16), ("bfloat16", torch.bfloat16),
                                           ("double", torch.float64)])
@pytest.mark.parametrize("learnable", [False, True])
def test_dtype_following(convert, dtype, learnable):
    m = SinusoidalEmbeddings(16, 8, learnable_scaling=learnable)
    ref = m(torch.arange(16)).double()
    getattr(m, convert)()
    assert m.embedding.weight.dtype == dtype
    if learnable:
        assert m.scaling.dtype == dtype
    out = m(torch.arange(16))
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


def test_device_following_meta():
    m = SinusoidalEmbeddings(8, 4, learnable_scaling=True).to("meta")
    assert m.embedding.weight.device.type == "meta" and m.scaling.device.type == "meta"


@pytest.mark.cuda
@pytest.mark.parametrize("cls", [SinusoidalEmbeddings, PositionalEmbeddings])
def test_cuda_forward_does_not_synchronize(cls):
    m = cls(10, 4).cuda()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host wait raises
    try:
        out = m(torch.arange(10, device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.is_cuda and torch.equal(out.cpu(), m.cpu()(torch.arange(10)))


@pytest.mark.cuda
@pytest.mark.parametrize("cls", ["SinusoidalEmbeddings", "PositionalEmbeddings"])
def test_cuda_out_of_range_fails_asynchronously(cls):
    """On CUDA the range check is a device assertion: the process fails at the next
    synchronisation (run in a subprocess: a device assertion ends the CUDA context)."""
    import subprocess
    import sys

    code = (f"import torch\nfrom fairseq_admin_pos.positional import {cls}\n"
            f"m = {cls}(10, 4).cuda()\nm(torch.tensor([3, 10], device='cuda'))\n"
            "torch.cuda.synchronize()\nprint('no error')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=300)
    assert proc.returncode != 0 and "no error" not in proc.stdout
    assert "assert" in proc.stderr.lower()


# --------------------------------------------------------------------------- #
# padding_idx
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("layout", ["standard", "seed"])
@pytest.mark.parametrize("padding_idx,row", [(5, 5), (-1, 9), (0, 0)])
def test_sinusoidal_padding_row_is_zero(layout, padding_idx, row):
    m = SinusoidalEmbeddings(10, 6, padding_idx=padding_idx, frequency_layout=layout)
    assert m.padding_idx == row and m.embedding.padding_idx == row
    table = m.embedding.weight.detach()
    ref = REFERENCES[layout](10, 6)
    ref[row] = 0.0
    torch.testing.assert_close(table, ref, **TOL)
    assert torch.equal(table[row], torch.zeros(6))
    out = m(torch.tensor([row, 1]))
    assert torch.equal(out[0], torch.zeros(6)) and out[1].abs().sum() > 0.5


def test_learned_padding_row_zero_and_no_gradient():
    m = PositionalEmbeddings(10, 4, padding_idx=2)
    w = m.embedding.weight
    assert torch.equal(w[2].detach(), torch.zeros(4))
    assert w.requires_grad
    assert w[3].abs().sum() > 0  # N(0, 1) init for other rows
    x = torch.tensor([[2, 3, 2, 7]])
    (m(x) * torch.randn(1, 4, 4)).sum().backward()
    assert torch.equal(w.grad[2], torch.zeros(4))
    assert w.grad[3].abs().sum() > 0 and w.grad[7].abs().sum() > 0
    assert torch.equal(w.grad[0], torch.zeros(4))  # unused row


def test_learned_negative_padding_idx():
    m = PositionalEmbeddings(10, 4, padding_idx=-2)
    assert m.padding_idx == 8
    assert torch.equal(m.embedding.weight[8].detach(), torch.zeros(4))


def test_learned_state_dict_key():
    assert list(PositionalEmbeddings(5, 3).state_dict()) == ["embedding.weight"]


# --------------------------------------------------------------------------- #
# errors
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("cls", [SinusoidalEmbeddings, PositionalEmbeddings])
@pytest.mark.parametrize("bad,which", [([0, 10], 10), ([[3, 11]], 11), ([-1, 2], 2), ([4, -7], 4)])
def test_out_of_range_indices(cls, bad, which):
    m = cls(10, 4)
    with pytest.raises(IndexError, match="n_position") as info:
        m(torch.tensor(bad))
    message = str(info.value)
    assert f"max index {which}" in message
    assert "10" in message


@pytest.mark.parametrize("cls", [SinusoidalEmbeddings, PositionalEmbeddings])
def test_float_indices_rejected(cls):
    with pytest.raises(TypeError, match="integer"):
        cls(10, 4)(torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("cls", [SinusoidalEmbeddings, PositionalEmbeddings])
@pytest.mark.parametrize("name,kwargs", [
    ("n_position", dict(n_position=0, hidden_width=4)),
    ("n_position", dict(n_position=-3, hidden_width=4)),
    ("n_position", dict(n_position=True, hidden_width=4)),
    ("n_position", dict(n_position=10.0, hidden_width=4)),
    ("hidden_width", dict(n_position=10, hidden_width=0)),
    ("hidden_width", dict(n_position=10, hidden_width="4")),
    ("padding_idx", dict(n_position=10, hidden_width=4, padding_idx=10)),
    ("padding_idx", dict(n_position=10, hidden_width=4, padding_idx=-11)),
    ("padding_idx", dict(n_position=10, hidden_width=4, padding_idx=1.0)),
    ("padding_idx", dict(n_position=10, hidden_width=4, padding_idx=True)),
])
def test_constructor_validation(cls, name, kwargs):
    with pytest.raises(ValueError, match=name):
        cls(**kwargs)


@pytest.mark.parametrize("bad", ["vaswani", "Standard", "", None, 1])
def test_bad_frequency_layout(bad):
    with pytest.raises(ValueError, match="frequency_layout") as info:
        SinusoidalEmbeddings(10, 4, frequency_layout=bad)
    assert "'standard'" in str(info.value) and "'seed'" in str(info.value)
    with pytest.raises(ValueError, match="frequency_layout"):
        SinusoidalEmbeddings.position_encoding_init(10, 4, bad)


def test_position_encoding_init_validates():
    with pytest.raises(ValueError, match="hidden_width"):
        SinusoidalEmbeddings.position_encoding_init(10, 0)


def test_extra_repr():
    r = repr(SinusoidalEmbeddings(10, 4, learnable_scaling=True, padding_idx=1))
    assert "n_position=10" in r and "frequency_layout='standard'" in r and "padding_idx=1" in r
    assert "n_position=10" in repr(PositionalEmbeddings(10, 4))


# --------------------------------------------------------------------------- #
# python -O (in-process; the real `python -O` subprocess run lives in test_admin.py)
# --------------------------------------------------------------------------- #
def _load_as_if_python_O(path, name):
    with open(path) as fh:
        code = compile(fh.read(), path, "exec", optimize=1)
    module = types.ModuleType(name)
    module.__file__ = path
    exec(code, module.__dict__)
    return module


def test_errors_survive_optimized_compile():
    pos = _load_as_if_python_O(POSITIONAL_PATH, "positional_optimized")
    checks = [
        (lambda: pos.SinusoidalEmbeddings(0, 4), ValueError, "n_position"),
        (lambda: pos.SinusoidalEmbeddings(4, 4, padding_idx=4), ValueError, "padding_idx"),
        (lambda: pos.PositionalEmbeddings(4, 4, padding_idx=-5), ValueError, "padding_idx"),
        (lambda: pos.SinusoidalEmbeddings(4, 4, frequency_layout="x"), ValueError, "frequency_layout"),
        (lambda: pos.SinusoidalEmbeddings(4, 4)(torch.tensor([4])), IndexError, "n_position"),
        (lambda: pos.PositionalEmbeddings(4, 4)(torch.tensor([-1])), IndexError, "n_position"),
    ]
    for fn, exc, word in checks:
        with pytest.raises(exc, match=re.escape(word)):
            fn()


# --------------------------------------------------------------------------- #
# fairseq layout and the initial scale (pure module)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("n_position,hidden_width,padding_idx", [
    (10, 4, None), (9, 5, 1), (40, 16, 1), (1030, 512, 1), (33, 7, 0)])
def test_fairseq_layout_is_fairseqs_table_bit_for_bit(n_position, hidden_width, padding_idx):
    from fairseq.modules.sinusoidal_positional_embedding import SinusoidalPositionalEmbedding

    m = SinusoidalEmbeddings(n_position, hidden_width, padding_idx=padding_idx,
                             frequency_layout="fairseq")
    want = SinusoidalPositionalEmbedding.get_embedding(n_position, hidden_width, padding_idx)
    assert m.embedding.weight.dtype == torch.float32
    assert torch.equal(m.embedding.weight, want)


@pytest.mark.parametrize("n_position,hidden_width", [(12, 4), (50, 9), (64, 16)])
def test_fairseq_layout_closed_form(n_position, hidden_width):
    # float32 angles pos * w_j lose ~pos * 6e-8 against the float64 loop
    table = SinusoidalEmbeddings.position_encoding_init(n_position, hidden_width, "fairseq")
    torch.testing.assert_close(table, fairseq_loop_table(n_position, hidden_width),
                               rtol=0, atol=n_position * 1e-7 + 1e-6)
    assert torch.equal(table[0, : hidden_width // 2], torch.zeros(hidden_width // 2))  # sin 0
    assert torch.equal(table[0, hidden_width // 2: 2 * (hidden_width // 2)],
                       torch.ones(hidden_width // 2))                                   # cos 0


@pytest.mark.parametrize("hidden_width", [1, 2, 3])
def test_fairseq_layout_needs_width_four(hidden_width):
    with pytest.raises(ValueError, match="hidden_width >= 4"):
        SinusoidalEmbeddings(8, hidden_width, frequency_layout="fairseq")


@pytest.mark.parametrize("layout", ["standard", "seed", "fairseq"])
@pytest.mark.parametrize("scaling_init", [None, 1.0, 0.25, -2.0, 0.0])
def test_scaling_init(layout, scaling_init):
    m = SinusoidalEmbeddings(20, 8, learnable_scaling=True, padding_idx=1,
                             frequency_layout=layout, scaling_init=scaling_init)
    want = 8 ** -0.5 if scaling_init is None else scaling_init
    assert m.scaling.shape == (1,) and m.scaling.item() == pytest.approx(want, rel=1e-7)
    assert sorted(m.state_dict()) == ["embedding.weight", "scaling"]  # the seed's keys
    x = torch.tensor([[1, 2, 19], [5, 1, 3]])
    torch.testing.assert_close(m(x), m.embedding.weight.detach()[x] * torch.tensor(want),
                               rtol=0, atol=0)
    assert f"scaling_init={want:.6g}" in repr(m)


@pytest.mark.parametrize("kwargs,match", [
    (dict(scaling_init=1.0), "learnable_scaling=True"),
    (dict(learnable_scaling=True, scaling_init=float("nan")), "scaling_init"),
    (dict(learnable_scaling=True, scaling_init=float("inf")), "scaling_init"),
    (dict(learnable_scaling=True, scaling_init=True), "scaling_init"),
    (dict(learnable_scaling=True, scaling_init="1"), "scaling_init"),
])
def test_scaling_init_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SinusoidalEmbeddings(10, 4, **kwargs)


def test_lookup_is_forward_without_the_check():
    m = SinusoidalEmbeddings(16, 6, learnable_scaling=True, scaling_init=0.5)
    x = torch.randint(0, 16, (3, 4))
    assert torch.equal(m.lookup(x), m(x))
    with pytest.raises(IndexError, match="n_position"):
        m(torch.tensor([16]))
    with pytest.raises(IndexError):  # nn.Embedding's own error, not a silent wrong row
        m.lookup(torch.tensor([16]))


# --------------------------------------------------------------------------- #
# admin_transformer: --pos-emb-scaled-table / --pos-emb-scale-init
# --------------------------------------------------------------------------- #
SCALED = ["--encoder-pos-emb", "scaled-sinusoidal", "--decoder-pos-emb", "scaled-sinusoidal"]


def _tiny():
    from fairseq_cli_utils import TINY_MODEL

    return TINY_MODEL + ["--dropout", "0.2"]


def test_scaled_fairseq_table_scale_one_is_stock_fairseq_at_init(tiny_data):
    """Stock fairseq's transformer (SinusoidalPositionalEmbedding) and admin_transformer with
    the scaled sinusoid (fairseq table, scale 1), --admin-init none, same seed: the same
    parameters plus one scalar per side, bitwise the same outputs in training (dropout on)
    and evaluation, and the same incremental decoding."""
    from model_utils import build, sample_batch

    stock, task, _ = build(tiny_data, "transformer", _tiny(), seed=7)
    scaled, _, _ = build(tiny_data, "admin_transformer", _tiny() + SCALED + [
        "--admin-init", "none", "--pos-emb-scaled-table", "fairseq", "--pos-emb-scale-init", "1"],
        seed=7)
    s_state, a_state = stock.state_dict(), scaled.state_dict()
    for k, v in s_state.items():
        assert torch.equal(v, a_state[k]), k
    extra = {k for k in set(a_state) - set(s_state) if not k.endswith(".omega")}
    assert extra == {"_extra_state"} | {f"{side}.embed_positions.embed.{name}"
                                        for side in ("encoder", "decoder")
                                        for name in ("embedding.weight", "scaling")}
    assert all(a_state[f"{side}.embed_positions.embed.scaling"].item() == 1.0
               for side in ("encoder", "decoder"))

    src, lengths, prev = sample_batch(task, left_pad_lengths=[7, 4, 6])
    for train_mode in (True, False):
        stock.train(train_mode), scaled.train(train_mode)
        torch.manual_seed(3)
        want = stock(src, lengths, prev)[0]
        torch.manual_seed(3)
        assert torch.equal(scaled(src, lengths, prev)[0], want)

    with torch.no_grad():
        outs = []
        for model in (stock, scaled):
            enc = model.encoder(src, src_lengths=lengths)
            state = {}
            outs.append(torch.cat([model.decoder(prev[:, : t + 1], encoder_out=enc,
                                                 incremental_state=state)[0]
                                   for t in range(prev.size(1))], dim=1))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("side,tokens", [("encoder", "src"), ("decoder", "prev")])
def test_scaled_fairseq_table_matches_fairseqs_module(tiny_data, side, tokens):
    """Position by position against fairseq's SinusoidalPositionalEmbedding, full sequences
    (left-padded) and one incremental step."""
    from fairseq.modules import PositionalEmbedding

    from model_utils import build, sample_batch

    model, task, _ = build(tiny_data, "admin_transformer", _tiny() + SCALED + [
        "--pos-emb-scaled-table", "fairseq", "--pos-emb-scale-init", "1"])
    ours = getattr(model, side).embed_positions
    pad = task.source_dictionary.pad()
    theirs = PositionalEmbedding(ours.max_positions, 32, pad, learned=False)
    src, _, prev = sample_batch(task, left_pad_lengths=[7, 3, 5])
    x = {"src": src, "prev": prev}[tokens]
    assert torch.equal(ours(x), theirs(x))
    assert ours(x)[0].abs().sum() > 0 and torch.equal(ours(src)[1, :4], torch.zeros(4, 32))
    step = ours(x, incremental_state={})
    assert torch.equal(step.expand(x.size(0), 1, -1), theirs(x, incremental_state={}))


@pytest.mark.parametrize("table,layout", [(None, "standard"), ("interleaved", "standard"),
                                          ("seed", "seed"), ("fairseq", "fairseq")])
@pytest.mark.parametrize("scale", [None, "0.5"])
def test_scaled_table_and_scale_flags_build_that_module(tiny_data, table, layout, scale):
    from model_utils import build

    extra = SCALED + (["--pos-emb-scaled-table", table] if table else []) + (
        ["--pos-emb-scale-init", scale] if scale else [])
    model, task, args = build(tiny_data, "admin_transformer", _tiny() + extra)
    pad = task.source_dictionary.pad()
    for side in ("encoder", "decoder"):
        emb = getattr(model, side).embed_positions.embed
        assert emb.frequency_layout == layout
        want = SinusoidalEmbeddings.position_encoding_init(emb.n_position, 32, layout)
        want[pad] = 0
        assert torch.equal(emb.embedding.weight, want)
        assert emb.scaling.item() == pytest.approx(0.5 if scale else 32 ** -0.5, rel=1e-7)
    assert model.admin_settings["pos_emb_scaled_table"] == (table or "interleaved")
    assert model.admin_settings["pos_emb_scale_init"] == (float(scale) if scale else None)


def test_one_scaled_side_gets_the_flags_and_the_other_is_stock(tiny_data):
    from fairseq.modules import SinusoidalPositionalEmbedding

    from model_utils import build

    model, _, _ = build(tiny_data, "admin_transformer", _tiny() + [
        "--decoder-pos-emb", "scaled-sinusoidal", "--pos-emb-scaled-table", "seed"])
    assert isinstance(model.encoder.embed_positions, SinusoidalPositionalEmbedding)
    assert model.decoder.embed_positions.embed.frequency_layout == "seed"


@pytest.mark.parametrize("extra,match", [
    (["--pos-emb-scaled-table", "fairseq"],
     r"--pos-emb-scaled-table fairseq only apply to scaled-sinusoid positions"),
    (["--pos-emb-scale-init", "1", "--encoder-pos-emb", "learned"],
     r"--pos-emb-scale-init 1.0 only apply .* --encoder-pos-emb is learned"),
    (SCALED + ["--pos-emb-scale-init", "nan"], r"--pos-emb-scale-init must be a finite number"),
    (SCALED + ["--pos-emb-scale-init", "inf"], r"--pos-emb-scale-init must be a finite number"),
])
def test_scaled_flag_errors(tiny_data, extra, match):
    from model_utils import build

    with pytest.raises(ValueError, match=match):
        build(tiny_data, "admin_transformer", _tiny() + extra)


def test_bad_scaled_table_choice_is_refused_by_the_parser(tiny_data, capsys):
    from model_utils import parse

    with pytest.raises(SystemExit):
        parse(tiny_data, "admin_transformer", SCALED + ["--pos-emb-scaled-table", "vaswani"])
    assert "interleaved" in capsys.readouterr().err


@pytest.mark.parametrize("flag,ours,theirs", [
    ("--pos-emb-scaled-table", "seed", "fairseq"),
    ("--pos-emb-scale-init", "1", "0.5"),
])
def test_scaled_settings_are_checked_on_load(tiny_data, flag, ours, theirs):
    from model_utils import build

    a, _, _ = build(tiny_data, "admin_transformer", _tiny() + SCALED + [flag, ours])
    b, _, _ = build(tiny_data, "admin_transformer", _tiny() + SCALED + [flag, theirs])
    with pytest.raises(ValueError, match=re.escape(flag) + ": checkpoint"):
        b.load_state_dict(a.state_dict())


def test_too_long_input_names_n_position(tiny_data):
    from model_utils import build

    model, task, _ = build(tiny_data, "admin_transformer", _tiny() + SCALED + [
        "--max-source-positions", "6"])
    emb = model.encoder.embed_positions
    tokens = torch.full((2, 7), task.source_dictionary.eos())
    with pytest.raises(IndexError,
                       match=r"7 tokens .* = 8, .* n_position = 8 rows \(max positions 6"):
        emb(tokens)
    assert emb(tokens[:, :6]).shape == (2, 6, 32)


def test_cli_train_generate_keep_the_table_and_train_the_scale(tiny_data, tmp_path):
    """fairseq-train with the seed's table and scale 0.5; the checkpoint carries the settings
    and the trained scale, and fairseq-generate rebuilds the same table from it."""
    from fairseq_cli_utils import generate, hypotheses, load_model_state, train

    save = tmp_path / "ck"
    train(tiny_data, save, "admin_transformer", _tiny() + SCALED + [
        "--pos-emb-scaled-table", "seed", "--pos-emb-scale-init", "0.5"], max_update=3)
    state = load_model_state(save / "checkpoint_last.pt")
    assert state["_extra_state"]["pos_emb_scaled_table"] == "seed"
    assert state["_extra_state"]["pos_emb_scale_init"] == 0.5
    for side in ("encoder", "decoder"):
        scale = state[f"{side}.embed_positions.embed.scaling"]
        assert scale.shape == (1,) and scale.item() != 0.5  # trained
        table = state[f"{side}.embed_positions.embed.embedding.weight"]
        want = SinusoidalEmbeddings.position_encoding_init(table.size(0), 32, "seed")
        want[1] = 0  # fairseq's padding index
        assert torch.equal(table, want)
    out = generate(tiny_data, save / "checkpoint_last.pt").stdout
    assert len(hypotheses(out)) == 24
