"""fairseq's ``--checkpoint-activations`` / ``--offload-activations`` with every residual
scheme: the layers really are recomputed in the backward pass, and loss and gradients are
the same as without checkpointing (in-process, and per update through fairseq-train).

On this CPU-only machine ``--offload-activations`` moves the saved layer inputs "to the
CPU", where they already are: the code path runs, the memory effect needs a GPU.
"""
import pytest
import torch

from fairseq_admin_pos.schemes import ReZeroResidual
from fairseq_cli_utils import TINY_MODEL, train, train_losses
from model_utils import SMALL, build, sample_batch

SCHEMES = {
    "admin": [],
    "admin-parameter": ["--admin-omega", "parameter"],
    "admin-profile": ["--admin-init", "profile", "--admin-omega", "buffer"],
    "pre-ln": ["--admin-init", "none", "--encoder-normalize-before", "--decoder-normalize-before"],
    "deepnorm": ["--admin-residual", "deepnorm"],
    "rezero": ["--admin-residual", "rezero"],
    "rezero-post-ln": ["--admin-residual", "rezero-post-ln"],
    "b2t": ["--admin-residual", "b2t"],
    "resi-dual": ["--admin-residual", "resi-dual"],  # the dual stream crosses each checkpoint
    # the LayerNorm placements (Mix-LN: 1 Post-LN + 2 Pre-LN encoder layers) and DyT
    "peri-ln-dyt": ["--admin-residual", "peri-ln", "--admin-norm", "dyt"],
    "mix-ln": ["--admin-residual", "mix-ln", "--mix-ln-alpha", "0.34"],
}
MEMORY = {"plain": [], "checkpoint": ["--checkpoint-activations"],
          "offload": ["--offload-activations"]}  # fairseq: offload implies checkpointing


def _loss_and_grads(data, extra, memory, dropout):
    model, task, args = build(data, "admin_transformer", SMALL + [
        "--encoder-layers", "3", "--decoder-layers", "2", "--dropout", str(dropout),
        *extra, *MEMORY[memory]], seed=7)
    assert args.checkpoint_activations == (memory != "plain")
    with torch.no_grad():  # ReZero starts as the identity (no gradient to the branches)
        gen = torch.Generator().manual_seed(0)
        for m in model.modules():
            if isinstance(m, ReZeroResidual):
                m.alpha.copy_(torch.rand(1, generator=gen) + 0.2)
    # count the FFN calls: a checkpointed layer runs again during the backward pass
    calls = []
    hook = model.encoder.layers[0].fc1.register_forward_hook(lambda *a: calls.append(1))
    model.train()
    src, lengths, prev = sample_batch(task, bsz=4, src_len=8, tgt_len=6, seed=3,
                                      left_pad_lengths=[8, 6, 4, 8])
    target = torch.roll(prev, -1, dims=1)
    torch.manual_seed(123)  # dropout masks (fairseq restores the RNG state for the recompute)
    logits = model(src, lengths, prev)[0]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="sum")
    forward_calls = len(calls)
    loss.backward()
    hook.remove()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    omegas = {k: v.clone() for k, v in model.state_dict().items() if k.endswith(".omega")}
    return loss.detach(), grads, omegas, forward_calls, len(calls) - forward_calls


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_same_loss_and_gradients_with_checkpointing(tiny_data, scheme):
    # --admin-init profile: the first training forward runs the profiling pass first
    passes = 2 if scheme == "admin-profile" else 1
    ref_loss, ref_grads, ref_omegas, fwd, recompute = _loss_and_grads(
        tiny_data, SCHEMES[scheme], "plain", dropout=0.0)
    assert (fwd, recompute) == (passes, 0)
    assert len(ref_grads) > 20
    if scheme == "admin-profile":
        assert any(v.item() > 1.1 for v in ref_omegas.values())  # profiled, not still 1
    for memory in ("checkpoint", "offload"):
        loss, grads, omegas, fwd, recompute = _loss_and_grads(
            tiny_data, SCHEMES[scheme], memory, dropout=0.0)
        assert (fwd, recompute) == (passes, 1), memory  # the layer was recomputed in backward
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
        assert set(grads) == set(ref_grads)
        for k, g in grads.items():
            torch.testing.assert_close(g, ref_grads[k], rtol=1e-5, atol=1e-6, msg=k)
        for k, v in omegas.items():  # profiled omegas: the same batch gives the same values
            assert torch.equal(v, ref_omegas[k]), k


@pytest.mark.parametrize("scheme", ["admin", "rezero", "resi-dual"])
def test_same_gradients_with_dropout(tiny_data, scheme):
    """Dropout on: fairseq restores the forward RNG state for the recomputation, so the
    masks, the loss and the gradients are still the same."""
    ref_loss, ref_grads, _, _, _ = _loss_and_grads(tiny_data, SCHEMES[scheme], "plain", 0.2)
    loss, grads, _, _, recompute = _loss_and_grads(tiny_data, SCHEMES[scheme], "checkpoint", 0.2)
    assert recompute == 1
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for k, g in grads.items():
        torch.testing.assert_close(g, ref_grads[k], rtol=1e-5, atol=1e-6, msg=k)


def test_fairseq_train_losses_identical_with_checkpointing(tiny_data, tmp_path):
    extra = TINY_MODEL + ["--admin-residual", "deepnorm", "--dropout", "0.1", "--no-save"]
    plain = train(tiny_data, tmp_path / "a", "admin_transformer", extra, max_update=3)
    ckpt = train(tiny_data, tmp_path / "b", "admin_transformer",
                 extra + ["--checkpoint-activations"], max_update=3)
    a = train_losses(plain.stdout + plain.stderr)
    b = train_losses(ckpt.stdout + ckpt.stderr)
    assert len(a) == 3 and a == b
