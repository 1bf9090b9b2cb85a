"""Mixed precision on the CPU: fixed omegas/alphas stay float32 through fairseq's casts,
position tables are rounded once, profiling statistics stay float32/64, profiled trainable
omegas reach FP16Optimizer's float32 master copy (flat and per-parameter), every residual
scheme and position choice trains through fairseq's own fp16 (loss scaling) and bf16
machinery, and checkpoints load back in float32 for generation.

What runs here and what does not: fp16 and bf16 arithmetic run on the CPU. fairseq's
``--fp16`` default keeps a *flattened* float32 master copy that it allocates on
``torch.cuda.current_device()``, so on a CPU-only torch ``--fp16`` needs
``--fp16-no-flatten-grads`` (same FP16Optimizer and DynamicLossScaler, one master tensor per
parameter) or ``--memory-efficient-fp16``. fairseq ties ``--bf16`` to ``--tpu``
(``options.py``: ``if args.bf16: args.tpu = True``), so ``fairseq-train --bf16 --cpu`` asks
for torch_xla; the bf16 tests run fairseq's own ``train.main`` / ``Trainer`` with ``tpu``
reset to False, which is the same model cast, sample cast and FP16Optimizer a GPU run uses.
CUDA kernels (and apex's fused kernels) are not exercised here.
"""
import json
import math
import sys

import pytest
import torch

from fairseq_admin_pos.admin import OmegaResidual, calculate_init
from fairseq_admin_pos.schemes import (
    RESIDUAL_SCHEMES,
    Float32OmegaResidual,
    ReZeroResidual,
    deepnorm_constants,
)
from fairseq_cli_utils import (
    TINY_MODEL,
    USER_DIR,
    generate,
    hypotheses,
    run,
    train_losses,
)
from model_utils import POS_CHOICES, SMALL, build, build_trainer, residuals, sample_batch

LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}

#: DyT in place of every LayerNorm, per placement (Mix-LN's alpha 0.5: one Post-LN
#: and one Pre-LN layer per 2-layer stack); the other schemes are --admin-residual's choices
DYT_SCHEMES = {
    "post-ln-dyt": ["--admin-init", "none", "--admin-norm", "dyt"],
    "pre-ln-dyt": ["--admin-init", "none", "--encoder-normalize-before",
                   "--decoder-normalize-before", "--admin-norm", "dyt"],
    "peri-ln-dyt": ["--admin-residual", "peri-ln", "--admin-norm", "dyt"],
    "mix-ln-dyt": ["--admin-residual", "mix-ln", "--mix-ln-alpha", "0.5", "--admin-norm", "dyt"],
}


def scheme_flags(scheme):
    # admin: the fixed omega (--admin-omega buffer), the form whose precision is checked here
    fixed = ["--admin-omega", "buffer"] if scheme == "admin" else []
    return DYT_SCHEMES.get(scheme, ["--admin-residual", scheme, *fixed])


# --------------------------------------------------------------------------------------- #
# Float32OmegaResidual (pure torch)
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("cast,dtype", [("half", torch.float16), ("bfloat16", torch.bfloat16)])
def test_fixed_omega_stays_float32_through_casts(cast, dtype):
    omega = calculate_init(36)  # 3.04...: 3.03125 in bfloat16, 3.041 in float16
    m = Float32OmegaResidual(omega)
    getattr(m, cast)()
    assert m.omega.dtype == torch.float32
    assert m.omega.item() == torch.tensor(omega, dtype=torch.float32).item()
    assert m.state_dict()["omega"].dtype == torch.float32
    m.double()  # widening casts still apply
    assert m.omega.dtype == torch.float64
    # the seed API class is unchanged: its omega follows the cast
    seed = OmegaResidual(omega)
    getattr(seed, cast)()
    assert seed.omega.dtype == dtype


@pytest.mark.parametrize("cast,dtype", [("half", torch.float16), ("bfloat16", torch.bfloat16)])
def test_trainable_omega_follows_the_model_dtype(cast, dtype):
    m = Float32OmegaResidual(2.0, as_parameter=True, embed_dim=8)
    p = m.omega
    getattr(m, cast)()
    assert m.omega.dtype == dtype and isinstance(m.omega, torch.nn.Parameter)
    r = ReZeroResidual()
    getattr(r, cast)()
    assert r.alpha.dtype == dtype
    assert p is m.omega  # same Parameter object (optimizers keep working)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_sum_is_computed_in_float32(dtype):
    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(4096, 8, generator=g, dtype=torch.float64)
    f64 = torch.randn(4096, 8, generator=g, dtype=torch.float64) * 0.3
    x, f = x64.to(dtype), f64.to(dtype)
    omega = calculate_init(36)
    m = Float32OmegaResidual(omega).to(dtype)
    out = m(x, f)
    assert out.dtype == dtype
    omega32 = torch.tensor(omega, dtype=torch.float32).double()
    exact = x.double() * omega32 + f.double()  # exact: 11 + 24 significant bits
    # float32 arithmetic, then one rounding to dtype: the float32 step is fused (one float32
    # rounding, as a GPU's FMA or a vectorised CPU loop) or not (two); either way every
    # element is one of these two values
    fused = exact.float().to(dtype)
    unfused = (x.float() * omega32.float() + f.float()).to(dtype)
    assert ((out == fused) | (out == unfused)).all()
    naive = OmegaResidual(omega).to(dtype)(x, f)  # omega rounded to dtype, two roundings
    err_ours = (out.double() - exact).abs().mean().item()
    err_naive = (naive.double() - exact).abs().mean().item()
    assert err_ours < err_naive, (err_ours, err_naive)
    # omega == 1: bitwise the plain half-precision residual (stock fairseq in fp16/bf16)
    one = Float32OmegaResidual(1.0).to(dtype)
    assert torch.equal(one(x, f), x + f)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_gradient_is_float32_rounded_once(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 8, generator=g).to(dtype).requires_grad_()
    f = torch.randn(64, 8, generator=g).to(dtype).requires_grad_()
    up = torch.randn(64, 8, generator=g).to(dtype)
    m = Float32OmegaResidual(calculate_init(36)).to(dtype)
    gx, gf = torch.autograd.grad(m(x, f), (x, f), up)
    assert gx.dtype == gf.dtype == dtype
    assert torch.equal(gx, (up.double() * m.omega.double()).to(dtype))  # exact product, rounded
    assert torch.equal(gf, up)


def _kernels(fn, x, f):
    """Kernels (aten ops that are neither views nor allocations) of one forward and of the
    backward to both inputs."""
    from dispatch_utils import OpRecorder

    x = x.detach().requires_grad_()
    f = f.detach().requires_grad_()
    with OpRecorder() as fwd:
        out = fn(x, f)
    up = torch.ones_like(out)
    with OpRecorder() as bwd:
        torch.autograd.grad(out, (x, f), up)
    return fwd.kernels(), bwd.kernels()


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _xf(dtype):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(6, 2, 8, generator=g).to(dtype),
            torch.randn(6, 2, 8, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("how", ["init", "O(n)", "load", "cast"])
def test_omega_one_costs_what_stock_costs(dtype, how):
    """Post-LN/Pre-LN baselines (--admin-init none): the kernels of fairseq's ``x + f_x``."""
    if how == "init":
        m = Float32OmegaResidual(1.0)
    elif how == "O(n)":
        m = Float32OmegaResidual(calculate_init(12, "O(n)"))
    elif how == "load":  # a checkpoint holding omega = 1 (fairseq loads on the CPU)
        m = Float32OmegaResidual(2.0)
        m.load_state_dict({"omega": torch.tensor([1.0], dtype=torch.float64)})
    else:  # fairseq's model casts, and back
        m = Float32OmegaResidual(1.0).to(dtype).double().float()
    m.to(dtype)
    x, f = _xf(dtype)
    assert _kernels(m, x, f) == _kernels(lambda a, b: a + b, x, f)
    assert torch.equal(m(x, f), x + f)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", ["admin", "deepnorm"])
def test_fixed_omega_kernels_each_way(dtype, scheme):
    c = deepnorm_constants(6, 6)
    m = Float32OmegaResidual(calculate_init(36) if scheme == "admin" else c.encoder_alpha)
    m.to(dtype)
    x, f = _xf(dtype)
    fwd, bwd = _kernels(m, x, f)
    if dtype == torch.float32:
        # native addcmul and autograd's own backward: grad_x = grad * (omega * 1), the
        # second factor a one-element product; grad_f = grad, no kernel; no Python
        assert (fwd, bwd) == (["aten.addcmul.default"], ["aten.mul.Scalar", "aten.mul.Tensor"])
        assert m(x.requires_grad_(), f).grad_fn.name() == "AddcmulBackward0"
    else:
        assert fwd == ["aten.addcmul.out"]  # float32 maths, rounded on store
        assert bwd == ["aten.mul.out"]      # grad_x = grad * omega; grad_f = grad, no kernel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("module", ["admin-parameter", "rezero"])
def test_trained_weight_is_one_native_kernel_forward(dtype, module):
    m = (Float32OmegaResidual(2.0, as_parameter=True, embed_dim=8) if module == "admin-parameter"
         else ReZeroResidual(0.5)).to(dtype)
    x, f = _xf(dtype)
    fwd, bwd = _kernels(m, x, f)
    assert fwd == ["aten.addcmul.default"]
    # the branch's gradient: grad * (weight * 1), autograd's addcmul formula, no Python
    assert bwd == ["aten.mul.Scalar", "aten.mul.Tensor"]
    assert m(x.requires_grad_(), f).grad_fn.name() == "AddcmulBackward0"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("module", ["admin-buffer", "admin-parameter", "rezero"])
def test_native_residual_is_bitwise_the_fused_function(dtype, module):
    """The native ops that replaced the Python autograd function where the weight and the
    activations share a dtype give its numbers bit for bit: output, both input gradients
    and the weight's gradient (a product rounded in the activation dtype, then a sum)."""
    from fairseq_admin_pos.schemes import _ShortcutSum

    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 4, 16, generator=g).to(dtype)
    f = torch.randn(9, 4, 16, generator=g).to(dtype)
    up = torch.randn(9, 4, 16, generator=g).to(dtype)
    if module == "rezero":
        m = ReZeroResidual(0.7).to(dtype)
        weight, reference = m.alpha, (lambda a, b, w: _ShortcutSum.apply(b, a, w))
    else:
        m = Float32OmegaResidual(2.3, as_parameter=module == "admin-parameter",
                                 embed_dim=16).to(dtype)
        weight, reference = m.omega, _ShortcutSum.apply
    if weight.dtype != dtype:
        pytest.skip("a float32 buffer with low-precision activations keeps the function")
    results = []
    for fn in (m, lambda a, b: reference(a, b, weight)):
        a, b = x.clone().requires_grad_(), f.clone().requires_grad_()
        out = fn(a, b)
        inputs = (a, b, weight) if weight.requires_grad else (a, b)
        results.append((out, *torch.autograd.grad(out, inputs, up)))
    for ours, ref in zip(*results):
        assert torch.equal(ours, ref)


def test_module_built_under_inference_mode():
    # inference tensors have no version counter: such an omega is never "known", still right
    x, f = _xf(torch.float32)
    with torch.inference_mode():
        one, two = Float32OmegaResidual(1.0), Float32OmegaResidual(2.0)
        assert torch.equal(one(x, f), x + f)
    assert torch.equal(one(x, f), x + f)
    assert torch.equal(two(x, f), torch.addcmul(f, x, torch.tensor([2.0])))


@pytest.mark.parametrize("write", ["fill", "copy", "load", "assign", "meta-then-to-empty"])
def test_known_one_follows_every_write(write):
    """The host-side "omega is 1" shortcut never outlives a write to omega."""
    x, f = _xf(torch.float32)
    m = Float32OmegaResidual(1.0)
    with torch.no_grad():
        if write == "fill":
            m.omega.fill_(2.5)
        elif write == "copy":
            m.omega.copy_(torch.tensor([2.5]))
        elif write == "load":
            m.load_state_dict({"omega": torch.tensor([2.5])})
        elif write == "assign":
            m.omega = torch.tensor([2.5])
        else:  # meta-device init: to_empty leaves omega uninitialised (here: 2.5)
            m.to("meta")
            m.to_empty(device="cpu")
            m.omega.data.fill_(2.5)  # what the memory holds; .data bumps no version
    out = m(x, f)  # x * 2.5 + f, fused (one float32 rounding) or not (two)
    assert ((out == (x.double() * 2.5 + f.double()).float()) | (out == x * 2.5 + f)).all()
    assert not torch.equal(out, x + f)
    with torch.no_grad():  # written back to 1 in place: correct, not known from the host
        m.omega.fill_(1.0)
    assert torch.equal(m(x, f), x + f)
    assert _kernels(m, x, f)[0] == ["aten.addcmul.default"]
    m.load_state_dict({"omega": torch.tensor([1.0])})  # known again
    assert _kernels(m, x, f)[0] == ["aten.add.Tensor"]


def test_float32_input_is_bitwise_the_seed_module():
    g = torch.Generator().manual_seed(1)
    x, f = torch.randn(5, 3, 16, generator=g), torch.randn(5, 3, 16, generator=g)
    for kw in ({}, {"as_parameter": True, "embed_dim": 16}):
        assert torch.equal(Float32OmegaResidual(2.017, **kw)(x, f), OmegaResidual(2.017, **kw)(x, f))


# --------------------------------------------------------------------------------------- #
# the model cast the way fairseq-train --fp16 / --bf16 casts it
# --------------------------------------------------------------------------------------- #
def _fixed_weights(scheme, enc, dec):
    if scheme == "admin":
        return calculate_init(2 * enc), calculate_init(3 * dec)
    if scheme in ("b2t", "resi-dual", "peri-ln", "mix-ln", *DYT_SCHEMES):  # the plain shortcut
        return 1.0, 1.0
    c = deepnorm_constants(enc, dec)
    return c.encoder_alpha, c.decoder_alpha


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("scheme", [*RESIDUAL_SCHEMES, *DYT_SCHEMES])
def test_model_cast_keeps_fixed_omegas_float32(tiny_data, scheme, precision):
    from fairseq_admin_pos.norms import DynamicTanh

    dtype = LOW[precision]
    model, _, _ = build(tiny_data, "admin_transformer", SMALL + [
        "--encoder-layers", "3", "--decoder-layers", "2", *scheme_flags(scheme)])
    model.to(dtype)
    dyts = [m for m in model.modules() if isinstance(m, DynamicTanh)]
    assert bool(dyts) == (scheme in DYT_SCHEMES)
    # DyT's alpha, weight and bias follow the model dtype, as LayerNorm's weights do
    assert all(p.dtype == dtype for m in dyts for p in m.parameters())
    for stack, n_sub in ((model.encoder, 6), (model.decoder, 6)):
        mods = residuals(stack)
        assert len(mods) == n_sub
        if scheme.startswith("rezero"):
            assert all(m.alpha.dtype == dtype for m in mods)
            continue
        want = _fixed_weights(scheme, 3, 2)[0 if stack is model.encoder else 1]
        for m in mods:
            assert m.omega.dtype == torch.float32
            assert m.omega.item() == torch.tensor(want, dtype=torch.float32).item()
    assert model.encoder.layers[0].fc1.weight.dtype == dtype


def _position_table_reference(model_fp32, model_low, side, tokens, dtype, pos):
    a = getattr(model_fp32, side).embed_positions(tokens)
    b = getattr(model_low, side).embed_positions(tokens)
    assert b.dtype == dtype
    if pos == "scaled-sinusoidal":  # table and scale are each rounded once, then multiplied
        torch.testing.assert_close(b.float(), a, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
    else:  # one rounding of the float32 table
        assert torch.equal(b, a.to(dtype))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("pos", POS_CHOICES)
@pytest.mark.parametrize("scheme", RESIDUAL_SCHEMES)
def test_low_precision_forward_backward_every_scheme_and_position(tiny_data, scheme, pos, precision):
    """The low-precision model computes what the float32 one computes (within the dtype's
    precision), positions included, and backpropagates finite gradients."""
    dtype = LOW[precision]
    extra = SMALL + ["--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0",
                     "--admin-residual", scheme, "--encoder-pos-emb", pos, "--decoder-pos-emb", pos]
    model32, task, _ = build(tiny_data, "admin_transformer", extra, seed=4)
    low, _, _ = build(tiny_data, "admin_transformer", extra, seed=4)
    with torch.no_grad():  # ReZero: leave the identity start so the layers contribute
        for m in list(model32.modules()) + list(low.modules()):
            if isinstance(m, ReZeroResidual):
                m.alpha.fill_(0.5)
    low.to(dtype)
    model32.eval(), low.eval()
    src, lengths, prev = sample_batch(task, left_pad_lengths=[7, 5, 3])
    if pos != "none":
        for side, tokens in (("encoder", src), ("decoder", prev)):
            _position_table_reference(model32, low, side, tokens, dtype, pos)
    out32 = model32(src, lengths, prev)[0]
    out = low(src, lengths, prev)[0]
    assert out.dtype == dtype and torch.isfinite(out).all()
    # relative to the logits' scale: a few ulps of the dtype accumulated over 4 layers
    err = (out.float() - out32).norm() / out32.norm()
    assert err < (0.03 if dtype == torch.bfloat16 else 0.005), err.item()
    low.train()
    out = low(src, lengths, prev)[0]
    out.float().logsumexp(-1).sum().backward()
    grads = [p.grad for p in low.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("i,scheme", list(enumerate(DYT_SCHEMES)))
def test_low_precision_forward_backward_dyt(tiny_data, i, scheme, precision):
    """DyT models (positions rotated): the low-precision model computes what the float32
    one computes within the dtype's precision, and every DyT alpha gets a finite gradient."""
    from fairseq_admin_pos.norms import DynamicTanh

    dtype = LOW[precision]
    pos = POS_CHOICES[i % len(POS_CHOICES)]
    extra = SMALL + ["--encoder-layers", "2", "--decoder-layers", "2", "--dropout", "0",
                     *DYT_SCHEMES[scheme], "--encoder-pos-emb", pos, "--decoder-pos-emb", pos]
    model32, task, _ = build(tiny_data, "admin_transformer", extra, seed=4)
    low, _, _ = build(tiny_data, "admin_transformer", extra, seed=4)
    low.to(dtype)
    model32.eval(), low.eval()
    src, lengths, prev = sample_batch(task, left_pad_lengths=[7, 5, 3])
    out32 = model32(src, lengths, prev)[0]
    out = low(src, lengths, prev)[0]
    assert out.dtype == dtype and torch.isfinite(out).all()
    err = (out.float() - out32).norm() / out32.norm()
    assert err < (0.03 if dtype == torch.bfloat16 else 0.005), err.item()
    low.train()
    low(src, lengths, prev)[0].float().logsumexp(-1).sum().backward()
    alphas = [m.alpha for m in low.modules() if isinstance(m, DynamicTanh)]
    assert alphas and all(a.grad is not None and a.grad.dtype == dtype for a in alphas)
    assert all(torch.isfinite(a.grad).all() and a.grad.abs().item() > 0 for a in alphas)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_profiling_statistics_stay_float32_in_a_low_precision_model(tiny_data, dtype):
    from fairseq_admin_pos.models import admin_profile

    extra = SMALL + ["--encoder-layers", "3", "--decoder-layers", "2", "--admin-init", "profile",
                     "--admin-omega", "buffer", "--dropout", "0"]
    model32, task, _ = build(tiny_data, "admin_transformer", extra, seed=2)
    low, _, _ = build(tiny_data, "admin_transformer", extra, seed=2)
    low.to(dtype)
    src, lengths, prev = sample_batch(task, bsz=4, src_len=8, tgt_len=6, left_pad_lengths=[8, 6, 5, 8])
    batch = [{"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev}]
    om32, mom32 = admin_profile.measure(model32, batch)
    om_low, mom_low = admin_profile.measure(low, batch)
    for stack in ("encoder", "decoder"):
        assert mom_low[stack].dtype == torch.float64
        # the counts are exact, the variances agree to the dtype's precision
        assert torch.equal(mom_low[stack][:, :, 0], mom32[stack][:, :, 0])
        for a, b in zip(om_low[stack], om32[stack]):
            assert a == pytest.approx(b, rel=3 * torch.finfo(dtype).eps ** 0.5)
    admin_profile.apply(low, om_low)
    for stack in ("encoder", "decoder"):
        for m, v in zip(residuals(getattr(low, stack)), om_low[stack]):
            assert m.omega.dtype == torch.float32  # the measured value, not rounded to dtype
            assert m.omega.item() == torch.tensor(v, dtype=torch.float32).item()


# --------------------------------------------------------------------------------------- #
# fairseq's own mixed-precision trainer, in-process: per precision every scheme and every
# position choice once (a Latin square; the full product runs forward/backward above)
# --------------------------------------------------------------------------------------- #
def _trainer(data, extra, precision):
    return build_trainer(data, [*TINY_MODEL, *extra], precision=precision, seed=3)


LATIN = [(precision, scheme, POS_CHOICES[(i + shift) % len(POS_CHOICES)])
          for precision, shift in (("fp16", 0), ("bf16", 2))
          for i, scheme in enumerate(RESIDUAL_SCHEMES)]
# DyT: each placement once, two per precision
LATIN += [(("fp16", "bf16")[i % 2], scheme, POS_CHOICES[(i + 1) % len(POS_CHOICES)])
          for i, scheme in enumerate(DYT_SCHEMES)]


@pytest.mark.parametrize("precision,scheme,pos", LATIN)
def test_fairseq_trainer_every_scheme_and_position(tiny_data, scheme, pos, precision):
    from fairseq.optim import FP16Optimizer

    dtype = LOW[precision]
    trainer = _trainer(tiny_data, [*scheme_flags(scheme), "--encoder-pos-emb", pos,
                                   "--decoder-pos-emb", pos, "--dropout", "0.1"], precision)
    model = trainer.model
    assert model.decoder.embed_tokens.weight.dtype == dtype
    assert isinstance(trainer.optimizer, FP16Optimizer)
    assert (trainer.optimizer.scaler is not None) == (precision == "fp16")  # loss scaling
    before = {k: v.detach().float().clone() for k, v in model.state_dict().items()
              if torch.is_tensor(v) and v.is_floating_point()}
    itr = trainer.get_train_iterator(epoch=1).next_epoch_itr(shuffle=False)
    losses = []
    for _, sample in zip(range(3), itr):
        log = trainer.train_step([sample])
        losses.append(log["loss"])
    assert trainer.get_num_updates() == 3
    assert all(math.isfinite(v) for v in losses), losses
    after = model.state_dict()
    for mod in residuals(model.encoder) + residuals(model.decoder):
        if isinstance(mod, Float32OmegaResidual):
            assert mod.omega.dtype == torch.float32
    fixed = [k for k, v in after.items() if k.endswith(".omega")]
    assert all(torch.equal(after[k].float(), before[k]) for k in fixed)  # not trained
    if scheme.startswith("rezero"):
        assert after["decoder.layers.1.final_residual.alpha"].abs().item() > 0
    if pos == "scaled-sinusoidal":
        k = "encoder.embed_positions.embed.scaling"
        assert not torch.equal(after[k].float(), before[k])


# Transformer-Clinic's fp16 flags (its WMT14 En-De commands), the recipe's precision path
CLINIC_FP16 = ["--fp16-scale-window", "256", "--threshold-loss-scale", "0.03125"]


def _master_tensors(optimizer):
    """{id(model parameter): its float32 master tensor} of fairseq's FP16Optimizer: the flat
    copy is laid out in the order of ``fp16_params`` (one device), the other one is a list."""
    if optimizer.has_flat_params:
        (flat,) = optimizer.fp32_params.values()
        out, offset = {}, 0
        for p in optimizer.fp16_params:
            out[id(p)] = flat.data[offset: offset + p.numel()].view(p.shape)
            offset += p.numel()
        return out
    return {id(p): p32.data for p, p32 in zip(optimizer.fp16_params, optimizer.fp32_params)}


@pytest.mark.parametrize("precision", ["fp16", "fp16-flat", "bf16"])
def test_master_copy_follows_profiled_trainable_omegas(tiny_data, tmp_path, monkeypatch, precision):
    """--admin-init profile --admin-omega parameter under FP16Optimizer: the float32 master
    copy is made before the first batch (omega = 1); profiling sets it to the exact profiled
    values, so the first update moves each omega from its profiled value by at most Adam's
    first step (lr), and the model's low-precision omega is that master rounded."""
    from fairseq.optim import FP16Optimizer

    from fairseq_admin_pos.models import admin_profile

    if precision == "fp16-flat":
        # fairseq puts the flat master copy on torch.cuda.current_device() and matches it to
        # parameters by device index: None for both on the CPU
        monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    prof = tmp_path / "p.json"
    flags = ["--admin-init", "profile", "--admin-omega", "parameter", "--admin-profile-path",
             prof, "--lr", "3e-3", *(CLINIC_FP16 if precision != "bf16" else [])]
    trainer = _trainer(tiny_data, flags, precision)
    optimizer = trainer.optimizer
    assert isinstance(optimizer, FP16Optimizer)
    assert optimizer.has_flat_params == (precision == "fp16-flat")
    model = trainer.get_model()
    stacks = admin_profile.residual_stacks(model)
    omegas = [m.omega for mods in stacks.values() for m in mods]
    assert all(w.dtype == LOW[precision[:4]] for w in omegas)
    masters = _master_tensors(optimizer)
    assert all(bool(masters[id(w)].eq(1).all()) for w in omegas)  # copied at omega = 1

    itr = trainer.get_train_iterator(epoch=1).next_epoch_itr(shuffle=False)
    trainer.train_step([next(itr)])
    assert trainer.get_num_updates() == 1
    profiled = json.loads(prof.read_text())["omegas"]
    values = [v for stack in stacks for v in profiled[stack]]
    assert max(values) > 1.1  # really profiled, not 1
    for w, v in zip(omegas, values):
        master = masters[id(w)]
        assert master.dtype == torch.float32
        assert (master - v).abs().max().item() <= 3e-3 * 1.001
        assert torch.equal(w.data, master.to(w.dtype))


# --------------------------------------------------------------------------------------- #
# through the command line: save in fp16/bf16, load back in float32 for generation
# --------------------------------------------------------------------------------------- #
BF16_TRAIN = (  # fairseq-train with tpu reset (fairseq_cli.train first: its log format)
    "import sys\n"
    "from fairseq_cli import train\n"
    "from fairseq import options\n"
    "from fairseq.dataclass.utils import convert_namespace_to_omegaconf\n"
    "from fairseq.distributed import utils as distributed_utils\n"
    "args = options.parse_args_and_arch(options.get_training_parser(), sys.argv[1:])\n"
    "args.tpu = False  # fairseq ties --bf16 to TPUs; run its bf16 path on the CPU\n"
    "distributed_utils.call_main(convert_namespace_to_omegaconf(args), train.main)\n"
)


@pytest.mark.parametrize("precision,scheme,pos", [
    ("fp16", "admin", "scaled-sinusoidal"),
    ("bf16", "deepnorm", "learned"),
])
def test_cli_low_precision_checkpoint_loads_in_float32(tiny_data, tmp_path, precision, scheme, pos):
    save = tmp_path / "ck"
    argv = [tiny_data, "--user-dir", USER_DIR, "--arch", "admin_transformer", *TINY_MODEL,
            *scheme_flags(scheme), "--encoder-pos-emb", pos, "--decoder-pos-emb", pos,
            "--cpu", "--seed", "3", "--optimizer", "adam", "--lr", "2e-3", "--max-tokens", "400",
            "--no-progress-bar", "--log-format", "simple", "--log-interval", "1",
            "--num-workers", "0", "--criterion", "label_smoothed_cross_entropy",
            "--label-smoothing", "0.1", "--max-update", "4", "--disable-validation",
            "--save-dir", save, "--no-epoch-checkpoints"]
    if precision == "fp16":
        proc = run("fairseq_cli.train", argv + ["--fp16", "--fp16-no-flatten-grads"])
    else:
        import subprocess

        from fairseq_cli_utils import REPO, env

        proc = subprocess.run([sys.executable, "-c", BF16_TRAIN, *map(str, argv), "--bf16"],
                              cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    losses = [float(v) for v in train_losses(log)]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses), losses
    if precision == "fp16":
        assert "loss_scale=" in log

    from fairseq import checkpoint_utils  # fairseq's import registers the plugin (allow-list)

    import fairseq_admin_pos  # noqa: F401

    raw = torch.load(save / "checkpoint_last.pt", map_location="cpu")["model"]
    dtype = LOW[precision]
    # fairseq saves the low-precision model copy converted to float32 (utils.move_to_cpu):
    # the weights are values of the low dtype ...
    w = raw["decoder.embed_tokens.weight"]
    assert w.dtype == torch.float32 and torch.equal(w.to(dtype).float(), w)
    # ... while the fixed omegas are the exact float32 values, which that dtype cannot hold
    enc_w, dec_w = _fixed_weights(scheme, 2, 2)
    for want in (enc_w, dec_w):
        exact = torch.tensor(want, dtype=torch.float32)
        assert exact.to(dtype).float().item() != exact.item()
    omegas = [k for k in raw if k.endswith(".omega")]
    assert len(omegas) == 2 * 2 + 3 * 2
    for k in omegas:
        want = enc_w if k.startswith("encoder.") else dec_w
        assert raw[k].item() == torch.tensor(want, dtype=torch.float32).item(), k
    models, cfg = checkpoint_utils.load_model_ensemble([str(save / "checkpoint_last.pt")])
    model = models[0]
    floats = [t for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()]
    assert floats and all(t.dtype == torch.float32 for t in floats)
    torch.testing.assert_close(model.decoder.embed_tokens.weight,
                               raw["decoder.embed_tokens.weight"].float(), rtol=0, atol=0)
    out = generate(tiny_data, save / "checkpoint_last.pt").stdout  # float32, no --fp16
    assert len(hypotheses(out)) == 24 and "BLEU4" in out
