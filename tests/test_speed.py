"""The faster training step keeps the numbers: ``fairseq_admin_pos/speed`` (multi-tensor Adam
and clipping for the plugin's models) and the native residual ops of ``schemes.py``.

Each test trains the same seeded model twice through fairseq's own ``Trainer`` (20 updates,
float32, CPU): once as the package runs now, once as it ran before these changes, i.e.
fairseq's per-parameter Adam and ``clip_grad_norm_`` (the speed hook switched off) and the
residuals through the Python autograd function ``schemes._ShortcutSum``. Losses, gradient
norms, the monitor's per-stack norms and every final weight must agree bit for bit; on the
CPU the multi-tensor ops call the same kernels per tensor, so nothing less is accepted.
"""
import pytest
import torch
from fairseq.logging import metrics

from fairseq_admin_pos.models import monitoring
from fairseq_admin_pos.schemes import Float32OmegaResidual, ReZeroResidual, _ShortcutSum
from fairseq_admin_pos.speed import foreach
from fairseq_admin_pos.speed import trainer as speed_trainer
from fairseq_cli_utils import TINY_MODEL
from model_utils import build_trainer

SCHEMES = {
    "admin-parameter": ["--admin-omega", "parameter"],
    "admin-buffer": ["--admin-omega", "buffer"],
    "post-ln": ["--admin-init", "none"],
    "deepnorm": ["--admin-residual", "deepnorm"],
    "rezero": ["--admin-residual", "rezero"],
    "b2t": ["--admin-residual", "b2t"],
    "resi-dual": ["--admin-residual", "resi-dual"],
}
UPDATES = 20
# ReZero without LayerNorm: autograd's node order around the encoder output (read by every
# decoder layer's cross-attention) changes with the node types, so one gradient that is
# mathematically zero (the key bias of cross-attention: softmax ignores a shift common to
# all keys) is a different sum of float32 rounding noise (~1e-7), which Adam, normalising,
# turns into a different step of that bias. Measured over 20 updates: relative differences
# below 1e-6 in every logged value, key biases within 5.1e-5, every other weight within
# 6e-8. Every other scheme is bitwise.
REORDERED = {"rezero"}
REORDERED_RTOL = 1e-5
REORDERED_WEIGHT_ATOL = 1e-6
LOGGED = ("loss", "nll_loss", "gnorm", "enc_gnorm", "dec_gnorm", "emb_gnorm")


def _old_forward_omega(self, x, f_x):
    """``Float32OmegaResidual.forward_omega`` before the native ops: the Python function
    wherever the shapes and dtypes allowed it."""
    omega = self.omega
    dtype = x.dtype if x.dtype == f_x.dtype else torch.promote_types(x.dtype, f_x.dtype)
    wide = omega.dtype == torch.float32 and dtype in (torch.float16, torch.bfloat16)
    if (wide or omega.dtype == dtype) and x.dtype == f_x.dtype and x.shape == f_x.shape:
        return _ShortcutSum.apply(x, f_x, omega)
    return torch.addcmul(f_x, x, omega)


def _old_rezero_forward(self, x, f_x):
    return _ShortcutSum.apply(f_x, x, self.alpha.to(f_x.dtype))


def _run(data, extra, monkeypatch, old: bool, precision=None):
    with monkeypatch.context() as m:
        if old:
            m.setattr(speed_trainer, "accelerate", lambda trainer: None)
            m.setattr(Float32OmegaResidual, "forward_omega", _old_forward_omega)
            m.setattr(ReZeroResidual, "forward", _old_rezero_forward)
        if precision == "fp16-flat":
            # fairseq puts the flat master copy on torch.cuda.current_device() and matches it
            # to p.device.index: None on a CPU-only machine (as in test_precision.py)
            m.setattr(torch.cuda, "current_device", lambda: None)
        trainer = build_trainer(data, TINY_MODEL + list(extra), precision=precision)
        fast = type(trainer.optimizer.optimizer) is speed_trainer.ForeachAdam
        assert fast is not old
        if precision is not None:
            copies = "_sync_fp16_grads_to_fp32" in trainer.optimizer.__dict__
            assert copies is not old
        itr = trainer.get_train_iterator(epoch=1).next_epoch_itr(shuffle=False)
        batches = list(itr)
        logged = []
        for i in range(UPDATES):
            with metrics.aggregate(new_root=True) as agg:
                trainer.train_step([batches[i % len(batches)]])
            # the unrounded meter values: loss, gnorm and the monitor's per-stack norms
            logged.append({k: float(agg[k].avg) for k in LOGGED if k in agg})
        weights = {k: v.clone() for k, v in trainer.get_model().state_dict().items()
                   if torch.is_tensor(v)}
    return logged, weights


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("clip", ["0", "0.1"])
def test_twenty_updates_are_bitwise_the_previous_step(tiny_data, monkeypatch, scheme, clip):
    extra = SCHEMES[scheme] + ["--clip-norm", clip, "--weight-decay", "0.01",
                               "--adam-betas", "(0.9, 0.98)"]
    new = _run(tiny_data, extra, monkeypatch, old=False)
    old = _run(tiny_data, extra, monkeypatch, old=True)
    assert all(set(row) == set(LOGGED) for row in new[0])
    assert new[1].keys() == old[1].keys()
    if scheme not in REORDERED:
        assert new[0] == old[0]  # losses, gradient norms, per-stack norms: every update
        for k in new[1]:
            assert torch.equal(new[1][k], old[1][k]), k
    else:
        for a, b in zip(new[0], old[0]):
            for k in LOGGED:
                assert a[k] == pytest.approx(b[k], rel=REORDERED_RTOL, abs=1e-9), k
        for k in new[1]:
            # key biases: Adam's steps on their rounding-noise gradients differ
            atol = 1e-4 if k.endswith("k_proj.bias") else REORDERED_WEIGHT_ATOL
            torch.testing.assert_close(new[1][k], old[1][k], rtol=REORDERED_RTOL, atol=atol)
    assert len({row["loss"] for row in new[0]}) > 1  # it trained


@pytest.mark.parametrize("precision", ["fp16", "fp16-flat", "bf16"])
@pytest.mark.parametrize("scheme", ["admin-parameter", "admin-buffer", "resi-dual"])
def test_low_precision_updates_are_bitwise_the_previous_step(tiny_data, monkeypatch, scheme,
                                                             precision):
    """FP16Optimizer's master copy (flat for --fp16, per parameter for --bf16 and
    --fp16-no-flatten-grads): the multi-tensor copies and Adam give fairseq's numbers."""
    extra = SCHEMES[scheme] + ["--clip-norm", "0.1", "--adam-betas", "(0.9, 0.98)"]
    new = _run(tiny_data, extra, monkeypatch, old=False, precision=precision)
    old = _run(tiny_data, extra, monkeypatch, old=True, precision=precision)
    assert new[0] == old[0]
    for k in new[1]:
        assert torch.equal(new[1][k], old[1][k]), k
    assert len({row["loss"] for row in new[0]}) > 1


def test_foreach_adam_matches_fairseq_adam_with_uneven_steps():
    """Parameters whose step counts differ (one had no gradient for a while) and weight
    decay: the bucketed multi-tensor step equals fairseq's loop bit for bit."""
    from fairseq.optim.adam import Adam

    g = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,), (2, 2, 2)]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(6)]
    results = []
    for cls in (Adam, speed_trainer.ForeachAdam):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = cls(params, lr=3e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
        for step, gs in enumerate(grads):
            for i, (p, gr) in enumerate(zip(params, gs)):
                # the second parameter gets no gradient on the first two steps
                p.grad = None if (i == 1 and step < 2) else gr.clone()
            opt.step()
        results.append((params, opt.state_dict()))
    (p_ref, s_ref), (p_new, s_new) = results
    for a, b in zip(p_ref, p_new):
        assert torch.equal(a, b)
    assert [s_ref["state"][i]["step"] for i in range(3)] == [6, 4, 6]
    for i in range(3):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(s_ref["state"][i][key]),
                               torch.as_tensor(s_new["state"][i][key]))


def test_foreach_adam_falls_back_for_half_parameters():
    from fairseq.optim.adam import Adam

    torch.manual_seed(0)
    results = []
    for cls in (Adam, speed_trainer.ForeachAdam):
        p = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3).to(torch.bfloat16))
        opt = cls([p], lr=0.1)
        p.grad = torch.ones_like(p)
        opt.step()
        results.append(p.detach().clone())
    assert torch.equal(*results)


def test_clipping_norms_are_fairseqs():
    from fairseq import utils

    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(s, generator=g) for s in [(4, 4), (9,), (3, 2)]]
    params = []
    for gr in grads:
        p = torch.nn.Parameter(torch.zeros_like(gr))
        p.grad = gr.clone()
        params.append(p)
    expected = utils.clip_grad_norm_(params, 0.5)
    clipped = [p.grad.clone() for p in params]
    norms, total = foreach.norms_and_total(grads)
    assert torch.equal(total, expected)
    for n, gr in zip(norms, grads):
        assert torch.equal(n, torch.norm(gr, p=2, dtype=torch.float32))
    foreach.clip_grads_(grads, total, 0.5)
    for a, b in zip(grads, clipped):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["transformer", "admin_transformer"])
def test_only_the_plugins_models_get_the_fast_step(tiny_data, arch):
    trainer = build_trainer(tiny_data, TINY_MODEL, arch=arch)
    fast = arch == "admin_transformer"
    assert (type(trainer.optimizer.optimizer) is speed_trainer.ForeachAdam) is fast
    assert speed_trainer.has_fast_clipping(trainer.optimizer) is fast
