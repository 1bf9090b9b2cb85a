"""DyT (``--admin-norm dyt``) and the LayerNorm placements (Post-LN, Pre-LN, Peri-LN,
Mix-LN) as pure-torch building blocks: values and gradients against hand-written formulas,
Mix-LN's layer split and final-norm rule against a table, and the refusals of bad flags.
Seeded, CPU only, no fairseq."""
from __future__ import annotations

import ast
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fairseq_admin_pos.norms import (
    DYT_ALPHA_INIT,
    NORM_CHOICES,
    DynamicTanh,
    check_dyt_alpha_init,
    check_norm_kind,
    make_norm,
)
from fairseq_admin_pos.placements import (
    LAYER_PLACEMENTS,
    MIX_LN_ALPHA,
    PLACEMENTS,
    Sublayer,
    SublayerNorms,
    check_mix_ln_alpha,
    layer_placements,
    mix_ln_post_layers,
    reference_stack,
    stack_final_norm,
    sublayer_norms,
    sublayer_residual,
)

PKG = Path(__file__).resolve().parents[1] / "fairseq_admin_pos"
C = 8


def dyt_by_hand(x, a, g, b):
    """``g * tanh(a * x) + b``, written out."""
    return g * torch.tanh(a * x) + b


def layer_norm_by_hand(x, g, b, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * g + b


def random_dyt(c=C, alpha=0.37, seed=0, dtype=torch.float32):
    """A DyT with non-trivial parameters (alpha != 0.5, weight != 1, bias != 0)."""
    gen = torch.Generator().manual_seed(seed)
    dyt = DynamicTanh(c).to(dtype)
    with torch.no_grad():
        dyt.alpha.fill_(alpha)
        dyt.weight.copy_(1 + 0.5 * torch.randn(c, generator=gen, dtype=dtype))
        dyt.bias.copy_(0.3 * torch.randn(c, generator=gen, dtype=dtype))
    return dyt


def random_layer_norm(c=C, seed=0, dtype=torch.float32, eps=1e-5):
    gen = torch.Generator().manual_seed(seed)
    ln = nn.LayerNorm(c, eps=eps).to(dtype)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.5 * torch.randn(c, generator=gen, dtype=dtype))
        ln.bias.copy_(0.3 * torch.randn(c, generator=gen, dtype=dtype))
    return ln


def one_line_value_error(match_all, fn, *args, **kwargs):
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    for part in match_all:
        assert part in message, (part, message)
    return message


# --------------------------------------------------------------------------------------- #
# DyT: values
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("shape", [(5, 3, C), (3, 5, C), (C,), (2, 1, 4, C)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dyt_matches_formula(shape, dtype):
    torch.manual_seed(1)
    dyt = random_dyt(dtype=dtype)
    x = 3 * torch.randn(shape, dtype=dtype)
    y = dyt(x)
    expected = dyt_by_hand(x, dyt.alpha.detach(), dyt.weight.detach(), dyt.bias.detach())
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-15)
    # the values are not trivially the identity / tanh: parameters matter
    assert (y - torch.tanh(x)).abs().max() > 0.1


def test_dyt_initialisation_and_state_dict_layout():
    dyt = DynamicTanh(C)
    assert dyt.alpha.shape == (1,) and dyt.alpha.item() == DYT_ALPHA_INIT == 0.5
    assert torch.equal(dyt.weight, torch.ones(C)) and torch.equal(dyt.bias, torch.zeros(C))
    # the authors' DynamicTanh layout and LayerNorm's names for the affine parameters
    assert {k: tuple(v.shape) for k, v in dyt.state_dict().items()} == {
        "alpha": (1,), "weight": (C,), "bias": (C,)}
    assert set(dict(nn.LayerNorm(C).named_parameters())) <= set(dict(dyt.named_parameters()))
    x = torch.randn(4, 2, C)
    torch.testing.assert_close(dyt(x), torch.tanh(0.5 * x), rtol=0, atol=0)
    # reset_parameters restores the paper's initialisation after training moved the values
    init = DynamicTanh(C, alpha_init=0.8)
    with torch.no_grad():
        init.alpha.fill_(3.0)
        init.weight.mul_(2)
        init.bias.add_(1)
    init.reset_parameters()
    assert init.alpha.item() == pytest.approx(0.8) and torch.equal(init.weight, torch.ones(C))
    assert torch.equal(init.bias, torch.zeros(C))


def test_dyt_layout_independent_time_batch_and_batch_time():
    torch.manual_seed(2)
    dyt = random_dyt()
    x_tbc = torch.randn(7, 3, C)
    torch.testing.assert_close(dyt(x_tbc.transpose(0, 1)), dyt(x_tbc).transpose(0, 1),
                               rtol=0, atol=0)


def test_dyt_without_affine_and_multi_dim_shape():
    torch.manual_seed(3)
    x = torch.randn(4, 3, 5)
    plain = DynamicTanh(5, alpha_init=0.7, elementwise_affine=False)
    assert plain.weight is None and plain.bias is None
    assert list(dict(plain.named_parameters())) == ["alpha"]
    torch.testing.assert_close(plain(x), torch.tanh(torch.tensor(0.7) * x), rtol=0, atol=0)
    two = DynamicTanh((3, 5))
    with torch.no_grad():
        two.weight.copy_(torch.randn(3, 5))
        two.bias.copy_(torch.randn(3, 5))
    torch.testing.assert_close(two(x), dyt_by_hand(x, 0.5, two.weight.detach(),
                                                   two.bias.detach()), rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", [(4, 2, C + 1), (4, 2, 1), (C, 2)])
def test_dyt_refuses_wrong_channel_dimension(shape):
    # (.., 1) would silently broadcast against weight (C,) without the check
    one_line_value_error(["DynamicTanh", str((C,))], DynamicTanh(C), torch.randn(shape))


def test_dyt_reads_no_tensor_value_on_the_host():
    # meta tensors have no values: .item() or a branch on a value would raise
    dyt = DynamicTanh(C, device="meta")
    y = dyt(torch.empty(5, 3, C, device="meta"))
    assert y.device.type == "meta" and y.shape == (5, 3, C)
    half = DynamicTanh(C, device="meta", dtype=torch.float16)
    assert half(torch.empty(5, 3, C, device="meta", dtype=torch.float16)).dtype == torch.float16


# --------------------------------------------------------------------------------------- #
# DyT: gradients
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("alpha", [0.37, 1.9])
@pytest.mark.parametrize("seed", [0, 1])
def test_dyt_gradients_match_hand_derivation(alpha, seed):
    torch.manual_seed(seed)
    dyt = random_dyt(alpha=alpha, seed=seed, dtype=torch.float64)
    x = (2 * torch.randn(6, 3, C, dtype=torch.float64)).requires_grad_()
    u = torch.randn(6, 3, C, dtype=torch.float64)
    dyt(x).backward(u)

    a, g = dyt.alpha.detach(), dyt.weight.detach()
    xd = x.detach()
    t = torch.tanh(a * xd)
    sech2 = 1 - t ** 2
    grads = {
        "x": (x.grad, u * g * a * sech2),
        "alpha": (dyt.alpha.grad, (u * g * sech2 * xd).sum().reshape(1)),
        "weight": (dyt.weight.grad, (u * t).sum(dim=(0, 1))),
        "bias": (dyt.bias.grad, u.sum(dim=(0, 1))),
    }
    for name, (got, want) in grads.items():
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=name)
    assert dyt.alpha.grad.abs().item() > 1e-3  # a non-trivial number was compared


def test_dyt_gradcheck_float64():
    torch.manual_seed(4)
    dyt = random_dyt(c=5, alpha=0.6, dtype=torch.float64)
    params = {k: v.detach().clone().requires_grad_() for k, v in dyt.named_parameters()}
    x = torch.randn(3, 2, 5, dtype=torch.float64, requires_grad=True)

    def fn(x, alpha, weight, bias):
        return torch.func.functional_call(
            dyt, {"alpha": alpha, "weight": weight, "bias": bias}, (x,))

    inputs = (x, params["alpha"], params["weight"], params["bias"])
    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


# --------------------------------------------------------------------------------------- #
# DyT: mixed precision (computed in float32, rounded once; alpha's gradient summed in float32)
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dyt_low_precision_is_float32_rounded_once(dtype):
    torch.manual_seed(5)
    low = random_dyt(alpha=0.43).to(dtype)  # parameters follow the model dtype, like .half()
    assert all(p.dtype == dtype for p in low.parameters())
    ref = DynamicTanh(C)
    ref.load_state_dict({k: v.float() for k, v in low.state_dict().items()})

    x = (4 * torch.randn(64, 4, C)).to(dtype).requires_grad_()
    x32 = x.detach().float().requires_grad_()
    u = torch.randn(64, 4, C).to(dtype)

    y = low(x)
    y32 = ref(x32)
    assert y.dtype == dtype
    assert torch.equal(y, y32.to(dtype))  # bit for bit: one rounding of the float32 value
    y.backward(u)
    y32.backward(u.float())
    assert torch.equal(x.grad, x32.grad.to(dtype))
    for name, p in low.named_parameters():
        p32 = dict(ref.named_parameters())[name]
        assert p.grad.dtype == dtype
        assert torch.equal(p.grad, p32.grad.to(dtype)), name
    # three roundings (the authors' expression evaluated in the low dtype) differ
    naive = torch.tanh(low.alpha * x.detach()) * low.weight + low.bias
    assert not torch.equal(naive, y.detach())


# --------------------------------------------------------------------------------------- #
# make_norm
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("eps", [1e-5, 1e-3])
def test_make_norm_layernorm_is_torch_layer_norm(eps):
    torch.manual_seed(6)
    norm = make_norm("layernorm", C, eps=eps)
    assert type(norm) is nn.LayerNorm and norm.eps == eps and norm.normalized_shape == (C,)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(C))
        norm.bias.copy_(torch.randn(C))
    x = 3 * torch.randn(5, 2, C) + 1
    torch.testing.assert_close(norm(x), F.layer_norm(x, (C,), norm.weight, norm.bias, eps),
                               rtol=0, atol=0)
    torch.testing.assert_close(norm(x), layer_norm_by_hand(x, norm.weight, norm.bias, eps),
                               rtol=1e-5, atol=1e-5)


def test_make_norm_layernorm_uses_the_given_factory():
    calls = []

    def factory(dim, eps):
        calls.append((dim, eps))
        return nn.LayerNorm(dim, eps=eps, elementwise_affine=False)

    norm = make_norm("layernorm", 12, eps=1e-6, layer_norm=factory)
    assert calls == [(12, 1e-6)] and norm.weight is None


def test_make_norm_dyt():
    norm = make_norm("dyt", 16, dyt_alpha_init=0.8, eps=123.0)  # eps is LayerNorm's alone
    assert type(norm) is DynamicTanh and norm.normalized_shape == (16,)
    assert torch.equal(norm.alpha.detach(), torch.tensor([0.8]))
    assert torch.equal(norm.weight, torch.ones(16)) and torch.equal(norm.bias, torch.zeros(16))
    assert make_norm("dyt", 4).alpha.item() == 0.5


@pytest.mark.parametrize("kind", ["rmsnorm", "LayerNorm", "DyT", "", None, 1])
def test_make_norm_refuses_unknown_kind(kind):
    one_line_value_error(["--admin-norm", "'layernorm'", "'dyt'", repr(kind)],
                         make_norm, kind, C)
    one_line_value_error(["--admin-norm"], check_norm_kind, kind)
    assert NORM_CHOICES == ("layernorm", "dyt")


@pytest.mark.parametrize("init", [0, 0.0, -0.5, float("nan"), float("inf"), -float("inf"),
                                  True, "0.5", None])
def test_refuses_bad_dyt_alpha_init(init):
    one_line_value_error(["--dyt-alpha-init", "positive finite"], make_norm, "dyt", C,
                         dyt_alpha_init=init)
    one_line_value_error(["--dyt-alpha-init"], DynamicTanh, C, alpha_init=init)
    one_line_value_error(["--dyt-alpha-init"], check_dyt_alpha_init, init)


def test_dyt_alpha_init_is_only_checked_for_dyt():
    assert type(make_norm("layernorm", C, dyt_alpha_init=-1.0)) is nn.LayerNorm
    assert check_dyt_alpha_init(2) == 2.0 and isinstance(check_dyt_alpha_init(2), float)


@pytest.mark.parametrize("dim", [0, -3, 2.0, True, None])
def test_make_norm_refuses_bad_dim(dim):
    for kind in NORM_CHOICES:
        one_line_value_error(["dim"], make_norm, kind, dim)


@pytest.mark.parametrize("eps", [0.0, -1e-5, float("nan"), True])
def test_make_norm_refuses_bad_eps(eps):
    one_line_value_error(["eps"], make_norm, "layernorm", C, eps=eps)


# --------------------------------------------------------------------------------------- #
# Mix-LN: the split and the final LayerNorm
# --------------------------------------------------------------------------------------- #
MIX_TABLE = [
    # (alpha, L, floor(alpha * L) as a person computes it)
    (0.25, 1, 0), (0.25, 3, 0), (0.25, 4, 1), (0.25, 6, 1), (0.25, 7, 1), (0.25, 12, 3),
    (0.25, 18, 4), (0.25, 24, 6),
    (0, 1, 0), (0, 6, 0), (0.0, 12, 0), (1, 1, 1), (1, 6, 6), (1.0, 12, 12),
    (0.5, 1, 0), (0.5, 5, 2), (0.5, 6, 3),
    (0.7, 10, 7),        # 7.000000000000001 in floating point
    (0.29, 100, 29),     # 28.999999999999996
    (0.57, 100, 57),     # 56.99999999999999
    (0.1, 30, 3),        # 3.0000000000000004
    (1 / 3, 3, 1), (1 / 3, 6, 2), (2 / 3, 6, 4),
    (Fraction(1, 4), 12, 3), (Fraction(3, 10), 10, 3),
    (0.999, 1000, 999), (0.9999999, 10, 9), (0.0001, 1000, 0),
]


@pytest.mark.parametrize("alpha,num_layers,expected", MIX_TABLE)
def test_mix_ln_post_layers_table(alpha, num_layers, expected):
    assert mix_ln_post_layers(num_layers, alpha) == expected
    placements = layer_placements("mix-ln", num_layers, alpha)
    assert placements == ["post-ln"] * expected + ["pre-ln"] * (num_layers - expected)
    assert stack_final_norm("mix-ln", num_layers, alpha) is (expected < num_layers)


def test_naive_floor_would_get_the_table_wrong():
    # the cases above that a bare math.floor(alpha * L) gets wrong
    assert math.floor(0.29 * 100) == 28 and math.floor(0.57 * 100) == 56
    assert mix_ln_post_layers(100, 0.29) == 29 and mix_ln_post_layers(100, 0.57) == 57


def test_mix_ln_default_alpha():
    assert MIX_LN_ALPHA == 0.25
    assert mix_ln_post_layers(12) == 3
    assert layer_placements("mix-ln", 6) == ["post-ln"] + ["pre-ln"] * 5


@pytest.mark.parametrize("num_layers", [1, 2, 6, 12, 18, 100])
def test_mix_ln_endpoints_are_pre_ln_and_post_ln(num_layers):
    assert layer_placements("mix-ln", num_layers, 0.0) == layer_placements("pre-ln", num_layers)
    assert layer_placements("mix-ln", num_layers, 1.0) == layer_placements("post-ln",
                                                                            num_layers)
    assert stack_final_norm("mix-ln", num_layers, 0.0) is stack_final_norm("pre-ln",
                                                                           num_layers) is True
    assert stack_final_norm("mix-ln", num_layers, 1.0) is stack_final_norm("post-ln",
                                                                           num_layers) is False


@pytest.mark.parametrize("placement,num_layers,alpha,expected", [
    ("post-ln", 6, 0.25, False), ("post-ln", 1, 0.0, False),
    ("pre-ln", 6, 0.25, True), ("pre-ln", 1, 1.0, True),
    ("peri-ln", 6, 0.25, True), ("peri-ln", 1, 1.0, True),
    ("mix-ln", 3, 0.25, True),    # 0 Post-LN layers: all Pre-LN
    ("mix-ln", 12, 0.25, True),   # 3 Post-LN, 9 Pre-LN
    ("mix-ln", 12, 0.99, True),   # 11 Post-LN, 1 Pre-LN: still a final LN
    ("mix-ln", 20, 0.95, True),   # 19 + 1
    ("mix-ln", 12, 1.0, False),   # all Post-LN: exactly Post-LN
    ("mix-ln", 1, 1.0, False),
    ("mix-ln", 1, 0.5, True),
])
def test_stack_final_norm(placement, num_layers, alpha, expected):
    assert stack_final_norm(placement, num_layers, alpha) is expected


def test_layer_placements_of_uniform_placements():
    assert PLACEMENTS == ("post-ln", "pre-ln", "peri-ln", "mix-ln")
    for placement in LAYER_PLACEMENTS:
        # alpha is not used (nor checked) outside mix-ln
        assert layer_placements(placement, 3, alpha=7.0) == [placement] * 3


@pytest.mark.parametrize("alpha", [-0.1, -1e-12, 1.0000001, 2, float("nan"), float("inf"),
                                   -float("inf"), True, False, "0.25", None])
def test_refuses_bad_mix_ln_alpha(alpha):
    parts = ["--mix-ln-alpha", "[0, 1]", repr(alpha)]
    one_line_value_error(parts, mix_ln_post_layers, 12, alpha)
    one_line_value_error(parts, layer_placements, "mix-ln", 12, alpha)
    one_line_value_error(parts, stack_final_norm, "mix-ln", 12, alpha)
    one_line_value_error(parts, check_mix_ln_alpha, alpha)


@pytest.mark.parametrize("num_layers", [0, -1, 2.0, True, None])
def test_refuses_bad_num_layers(num_layers):
    for placement in PLACEMENTS:
        one_line_value_error(["num_layers"], layer_placements, placement, num_layers)
        one_line_value_error(["num_layers"], stack_final_norm, placement, num_layers)
    one_line_value_error(["num_layers"], mix_ln_post_layers, num_layers, 0.25)


@pytest.mark.parametrize("placement", ["sandwich", "Pre-LN", "preln", "", None])
def test_refuses_unknown_placement(placement):
    one_line_value_error(["'post-ln'", "'pre-ln'", "'peri-ln'", "'mix-ln'"],
                         layer_placements, placement, 6)
    one_line_value_error(["placement"], stack_final_norm, placement, 6)


# --------------------------------------------------------------------------------------- #
# one residual sub-layer per placement, against the formulas written out
# --------------------------------------------------------------------------------------- #
def make_parts(kind: str, seed: int):
    """A sub-layer f (Linear, GELU, Linear), two norms of ``kind`` with random affine
    parameters, a deterministic stand-in for dropout (a fixed mask, inverted scaling) and a
    weighted residual; float64 so that hand formulas agree to 1e-12."""
    gen = torch.Generator().manual_seed(seed)
    w1, b1 = torch.randn(2 * C, C, generator=gen), torch.randn(2 * C, generator=gen)
    w2, b2 = torch.randn(C, 2 * C, generator=gen), torch.randn(C, generator=gen)
    w1, b1, w2, b2 = (t.double() for t in (w1, b1, w2, b2))

    def f(x):
        return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)

    if kind == "layernorm":
        norms = [random_layer_norm(seed=seed + i, dtype=torch.float64) for i in (1, 2)]
        by_hand = [lambda x, n=n: layer_norm_by_hand(x, n.weight, n.bias) for n in norms]
    else:
        norms = [random_dyt(alpha=a, seed=seed + i, dtype=torch.float64)
                 for i, a in ((1, 0.45), (2, 0.8))]
        by_hand = [lambda x, n=n: dyt_by_hand(x, n.alpha, n.weight, n.bias) for n in norms]
    keep = torch.rand(5, 3, C, generator=gen).double() > 0.3

    def dropout(t):
        return t * keep / 0.7

    def residual(x, f_x):
        return 1.3 * x + f_x

    return f, norms, by_hand, dropout, residual


@pytest.mark.parametrize("kind", NORM_CHOICES)
@pytest.mark.parametrize("layer_placement", LAYER_PLACEMENTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_sublayer_residual_matches_formula(kind, layer_placement, seed):
    f, (norm, out_norm), (ln, ln_out), dropout, residual = make_parts(kind, seed)
    x = 2 * torch.randn(5, 3, C, generator=torch.Generator().manual_seed(seed),
                        dtype=torch.float64)
    out = out_norm if layer_placement == "peri-ln" else None
    got = sublayer_residual(x, f, layer_placement, norm, out, dropout=dropout,
                            residual=residual)
    plain = sublayer_residual(x, f, layer_placement, norm, out)
    with torch.no_grad():
        if layer_placement == "post-ln":
            want = ln(1.3 * x + dropout(f(x)))
            want_plain = ln(x + f(x))
        elif layer_placement == "pre-ln":
            want = 1.3 * x + dropout(f(ln(x)))
            want_plain = x + f(ln(x))
        else:
            want = 1.3 * x + dropout(ln_out(f(ln(x))))
            want_plain = x + ln_out(f(ln(x)))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(plain, want_plain, rtol=1e-12, atol=1e-12)
    assert (got - plain).abs().max() > 1e-2  # dropout and residual hooks were applied
    assert sublayer_norms(layer_placement) == SublayerNorms(
        norm=True, out_norm=layer_placement == "peri-ln")


@pytest.mark.parametrize("kind", NORM_CHOICES)
def test_peri_ln_dropout_comes_after_the_output_norm(kind):
    f, (norm, out_norm), _, dropout, _ = make_parts(kind, 3)
    x = torch.randn(5, 3, C, dtype=torch.float64)
    got = sublayer_residual(x, f, "peri-ln", norm, out_norm, dropout=dropout)
    with torch.no_grad():
        after = x + dropout(out_norm(f(norm(x))))
        before = x + out_norm(dropout(f(norm(x))))  # the order not taken
    torch.testing.assert_close(got, after, rtol=0, atol=0)
    assert (got - before).abs().max() > 0.1


def test_peri_ln_output_norm_is_on_the_branch_not_the_sum():
    torch.manual_seed(7)
    ln_in, ln_out = random_layer_norm(seed=1), random_layer_norm(seed=2)
    x = 5 * torch.randn(4, 2, C) + 3  # far from normalised, so the two readings differ

    def f(t):
        return 2 * t

    got = sublayer_residual(x, f, "peri-ln", ln_in, ln_out)
    torch.testing.assert_close(got, x + ln_out(f(ln_in(x))), rtol=0, atol=0)
    assert (got - ln_out(x + f(ln_in(x)))).abs().max() > 1.0


def test_sublayer_residual_refusals():
    ln = nn.LayerNorm(C)
    x = torch.randn(2, C)
    one_line_value_error(["out_norm", "required for peri-ln"], sublayer_residual,
                         x, torch.tanh, "peri-ln", ln)
    for placement in ("post-ln", "pre-ln"):
        one_line_value_error(["out_norm", placement], sublayer_residual,
                             x, torch.tanh, placement, ln, ln)
        one_line_value_error(["norm"], sublayer_residual, x, torch.tanh, placement, None)
    # mix-ln is a per-stack rule: a sub-layer gets its layer's placement
    one_line_value_error(["'post-ln'", "'pre-ln'", "'peri-ln'"], sublayer_residual,
                         x, torch.tanh, "mix-ln", ln)
    one_line_value_error(["'peri-ln'"], sublayer_norms, "mix-ln")


def test_sublayer_residual_reads_no_tensor_value_on_the_host():
    ln, ln_out = nn.LayerNorm(C, device="meta"), DynamicTanh(C, device="meta")
    lin = nn.Linear(C, C, device="meta")
    x = torch.empty(5, 3, C, device="meta")
    for placement in LAYER_PLACEMENTS:
        out = ln_out if placement == "peri-ln" else None
        y = sublayer_residual(x, lin, placement, ln, out, dropout=nn.Dropout(0.1))
        assert y.device.type == "meta" and y.shape == x.shape


# --------------------------------------------------------------------------------------- #
# whole stacks: Mix-LN's endpoints are exactly Pre-LN and Post-LN, and its boundary
# --------------------------------------------------------------------------------------- #
def make_stack(num_layers: int, seed: int, peri: bool = False):
    """``num_layers`` layers of two sub-layers (standing in for attention and FFN), each
    with its own f, norm (and out_norm under Peri-LN), plus a final norm; float64."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for i in range(num_layers):
        layer = []
        for j in range(2):
            lin = nn.Linear(C, C).double()
            with torch.no_grad():
                lin.weight.copy_(torch.randn(C, C, generator=gen) / math.sqrt(C))
                lin.bias.copy_(torch.randn(C, generator=gen))
            norm = random_layer_norm(seed=seed * 100 + 10 * i + j, dtype=torch.float64)
            out_norm = (random_dyt(alpha=0.6, seed=seed * 100 + 10 * i + j + 50,
                                   dtype=torch.float64) if peri else None)
            layer.append(Sublayer(lambda t, lin=lin: torch.tanh(lin(t)), norm, out_norm))
        layers.append(layer)
    final = random_layer_norm(seed=seed * 100 + 99, dtype=torch.float64)
    return layers, final


def stack_by_hand(x, layers, kinds, final):
    for layer, kind in zip(layers, kinds):
        for f, norm, out_norm in layer:
            if kind == "post-ln":
                x = norm(x + f(x))
            elif kind == "pre-ln":
                x = x + f(norm(x))
            else:
                x = x + out_norm(f(norm(x)))
    return final(x) if final is not None else x


@pytest.mark.parametrize("num_layers", [1, 4, 6])
def test_mix_ln_stack_endpoints_equal_pre_ln_and_post_ln(num_layers):
    layers, final = make_stack(num_layers, seed=num_layers)
    x = torch.randn(5, 3, C, dtype=torch.float64)
    with torch.no_grad():
        pre = reference_stack(x, layers, "pre-ln", final_norm=final)
        post = reference_stack(x, layers, "post-ln")
        assert torch.equal(reference_stack(x, layers, "mix-ln", mix_ln_alpha=0.0,
                                           final_norm=final), pre)
        assert torch.equal(reference_stack(x, layers, "mix-ln", mix_ln_alpha=1.0), post)
        torch.testing.assert_close(pre, stack_by_hand(x, layers, ["pre-ln"] * num_layers,
                                                      final), rtol=0, atol=0)
        torch.testing.assert_close(post, stack_by_hand(x, layers, ["post-ln"] * num_layers,
                                                       None), rtol=0, atol=0)
    assert (pre - post).abs().max() > 0.1


@pytest.mark.parametrize("num_layers,alpha,post_layers", [(4, 0.5, 2), (12, 0.25, 3),
                                                          (6, 0.25, 1), (3, 0.25, 0),
                                                          (5, 0.9, 4)])
def test_mix_ln_stack_boundary(num_layers, alpha, post_layers):
    layers, final = make_stack(num_layers, seed=10 + num_layers)
    x = 3 * torch.randn(5, 3, C, dtype=torch.float64) + 1
    kinds = ["post-ln"] * post_layers + ["pre-ln"] * (num_layers - post_layers)
    with torch.no_grad():
        got = reference_stack(x, layers, "mix-ln", mix_ln_alpha=alpha, final_norm=final)
        torch.testing.assert_close(got, stack_by_hand(x, layers, kinds, final), rtol=0, atol=0)
        # the boundary one layer off gives other numbers
        for shifted in (post_layers - 1, post_layers + 1):
            if 0 <= shifted < num_layers:
                other = ["post-ln"] * shifted + ["pre-ln"] * (num_layers - shifted)
                assert (got - stack_by_hand(x, layers, other, final)).abs().max() > 1e-3


def test_peri_ln_stack():
    layers, final = make_stack(3, seed=21, peri=True)
    x = torch.randn(4, 2, C, dtype=torch.float64)
    with torch.no_grad():
        got = reference_stack(x, layers, "peri-ln", final_norm=final)
        torch.testing.assert_close(got, stack_by_hand(x, layers, ["peri-ln"] * 3, final),
                                   rtol=0, atol=0)
    with pytest.raises(ValueError, match="out_norm"):
        reference_stack(x, layers, "pre-ln", final_norm=final)


def test_reference_stack_final_norm_must_match_the_rule():
    layers, final = make_stack(4, seed=30)
    x = torch.randn(2, C, dtype=torch.float64)
    one_line_value_error(["pass final_norm"], reference_stack, x, layers, "pre-ln")
    one_line_value_error(["final_norm must be None"], reference_stack, x, layers, "post-ln",
                         final_norm=final)
    one_line_value_error(["final_norm must be None"], reference_stack, x, layers, "mix-ln",
                         mix_ln_alpha=1.0, final_norm=final)
    one_line_value_error(["pass final_norm"], reference_stack, x, layers, "mix-ln",
                         mix_ln_alpha=0.75)


# --------------------------------------------------------------------------------------- #
# pure torch: no fairseq import, at the source level and at run time
# --------------------------------------------------------------------------------------- #
ALLOWED = {"__future__", "math", "numbers", "typing", "torch"}


@pytest.mark.parametrize("name", ["norms", "placements"])
def test_imports_only_torch_and_stdlib(name):
    names = set()
    for node in ast.walk(ast.parse((PKG / f"{name}.py").read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    assert {n for n in names if n.split(".")[0] not in ALLOWED} == set()


def test_modules_work_without_fairseq():
    code = (
        "import importlib.abc, sys\n"
        "class NoFairseq(importlib.abc.MetaPathFinder):  # as where fairseq is not installed\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('fairseq', 'fairseq_cli'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoFairseq())\n"
        "import torch\n"
        "from fairseq_admin_pos.norms import make_norm\n"
        "from fairseq_admin_pos.placements import layer_placements, sublayer_residual\n"
        "n = make_norm('dyt', 4)\n"
        "y = sublayer_residual(torch.ones(2, 4), lambda t: t, 'pre-ln', n)\n"
        "assert torch.allclose(y, 1 + torch.tanh(torch.tensor(0.5))), y\n"
        "assert layer_placements('mix-ln', 12, 0.25)[2:4] == ['post-ln', 'pre-ln']\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'fairseq']\n"
        "print('ok')\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(PKG.parent), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=str(PKG.parent), timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
