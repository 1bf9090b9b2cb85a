"""No host-device synchronisation in admin_transformer's forward, backward and incremental
decoding, for every residual scheme and position choice.

On an accelerator every read of a device value on the host (``.item()``, ``.tolist()``,
``bool(tensor)``, ``nonzero``, boolean-mask indexing, ...) makes the host wait for all queued
kernels. The CPU has no such wait, so the tests track on the CPU which tensors would live on
the device and fail on any such read inside the model (``dispatch_utils.no_host_sync``); the
first tests show that the probe catches stock fairseq's own reads and each kind of read.
"""
import pytest
import torch
import torch.nn as nn

from dispatch_utils import HostSyncError, no_host_sync
from fairseq_cli_utils import TINY_MODEL
from model_utils import build, sample_batch

POSITIONS = ["sinusoidal", "scaled-sinusoidal", "learned", "none"]
SCHEMES = {
    "admin-buffer": ["--admin-omega", "buffer"],
    "admin-parameter": ["--admin-omega", "parameter"],
    "post-ln": ["--admin-init", "none"],
    "pre-ln": ["--admin-init", "none", "--encoder-normalize-before", "--decoder-normalize-before"],
    "deepnorm": ["--admin-residual", "deepnorm"],
    "rezero": ["--admin-residual", "rezero"],
    "rezero-post-ln": ["--admin-residual", "rezero-post-ln"],
    "profile-loaded": ["--admin-init", "profile"],
    # ResiDual's stacks also compute the dual-stream norm for the monitor in training
    "b2t": ["--admin-residual", "b2t"],
    "resi-dual": ["--admin-residual", "resi-dual"],
    # the LayerNorm placements (Mix-LN's alpha 0.5: one Post-LN, one Pre-LN layer
    # per 2-layer stack) and DyT in place of LayerNorm
    "peri-ln": ["--admin-residual", "peri-ln"],
    "mix-ln": ["--admin-residual", "mix-ln", "--mix-ln-alpha", "0.5"],
    "post-ln-dyt": ["--admin-init", "none", "--admin-norm", "dyt"],
    "pre-ln-dyt": ["--admin-init", "none", "--encoder-normalize-before",
                   "--decoder-normalize-before", "--admin-norm", "dyt"],
    "peri-ln-dyt": ["--admin-residual", "peri-ln", "--admin-norm", "dyt"],
    "mix-ln-dyt": ["--admin-residual", "mix-ln", "--mix-ln-alpha", "0.5", "--admin-norm", "dyt"],
}
# bfloat16 (fairseq's --bf16 model cast): every scheme once, positions rotated
BF16 = [(s, POSITIONS[i % len(POSITIONS)]) for i, s in enumerate(SCHEMES)]


def _model(data, scheme, pos, dtype=torch.float32, seed=1):
    extra = TINY_MODEL + SCHEMES[scheme] + [
        "--encoder-pos-emb", pos, "--decoder-pos-emb", pos, "--dropout", "0.1"]
    model, task, _ = build(data, "admin_transformer", extra, seed=seed)
    if scheme == "profile-loaded":
        # what resuming or fine-tuning a profiled run loads: admin_profiled = 1 and omegas
        from fairseq_admin_pos import profiling
        from fairseq_admin_pos.models import admin_profile

        donor, _, _ = build(data, "admin_transformer", extra, seed=seed)
        for mods in admin_profile.residual_stacks(donor).values():
            profiling.set_omegas(mods, [1.5 + 0.1 * i for i in range(len(mods))])
        donor.admin_profiled.fill_(1)
        model.load_state_dict(donor.state_dict())
    with torch.no_grad():  # ReZero: leave the identity start so every branch is computed
        for name, p in model.named_parameters():
            if name.endswith("_residual.alpha"):
                p.fill_(0.5)
    return model.to(dtype), task


def _train_step(model, task, guard=None):
    src, lengths, prev = sample_batch(task, bsz=3, src_len=7, tgt_len=5,
                                      left_pad_lengths=[7, 4, 6])
    model.train()
    out = model(src, lengths, prev)[0]
    with guard.active() if guard is not None else torch.enable_grad():
        out.float().log_softmax(-1).sum().backward()
    return out


def _beam_search(model, task, beam=3):
    from fairseq.sequence_generator import SequenceGenerator

    src, lengths, _ = sample_batch(task, bsz=3, src_len=7, left_pad_lengths=[7, 4, 6])
    model.eval()
    gen = SequenceGenerator([model], task.target_dictionary, beam_size=beam, max_len_a=0,
                            max_len_b=6)
    with torch.no_grad():
        return gen.generate([model], {"net_input": {"src_tokens": src, "src_lengths": lengths}})


# --------------------------------------------------------------------------------------- #
# the probe catches what it must
# --------------------------------------------------------------------------------------- #
class _Reads(nn.Module):
    """A module whose forward reads its (device) input the way ``how`` says."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.w = nn.Parameter(torch.ones(4))
        self.encoder = self.decoder = nn.Identity()

    def forward(self, x):
        y = x * self.w
        if self.how == "item":
            return y.sum().item()
        if self.how == "bool":
            return bool(y.any())
        if self.how == "if":
            return 1 if (y > 0).all() else 0
        if self.how == "int":
            return int(y.argmax())
        if self.how == "float":
            return float(y.detach()[0])
        if self.how == "tolist":
            return y.tolist()
        if self.how == "cpu":
            return y.cpu()
        if self.how == "nonzero":
            return torch.nonzero(y)
        if self.how == "mask-index":
            return y[y > 1]
        if self.how == "equal":
            return torch.equal(y, x)
        # host values derived from shapes and Python numbers are free to read
        n = torch.tensor(x.shape)[0] + torch.tensor(2)
        return int(n) + y.size(0)


@pytest.mark.parametrize("how", ["item", "bool", "if", "int", "float", "tolist", "cpu",
                                 "nonzero", "mask-index", "equal", "host-only"])
def test_probe_flags_every_kind_of_device_read(how):
    m = _Reads(how)
    x = torch.arange(4.0)
    with no_host_sync(m):
        if how == "host-only":
            assert m(x) == 4 + 2 + 4
        else:
            with pytest.raises(HostSyncError):
                m(x)
    assert m(x) is not None  # outside the block nothing is checked


def test_probe_flags_stock_fairseq(tiny_data):
    """Stock fairseq reads ``encoder_padding_mask.any()`` on the host in every forward."""
    model, task, _ = build(tiny_data, "transformer", TINY_MODEL)
    src, lengths, prev = sample_batch(task, left_pad_lengths=[7, 4, 6])
    with no_host_sync(model), pytest.raises(HostSyncError, match="_local_scalar_dense"):
        model(src, lengths, prev)


def test_probe_flags_the_value_checked_position_lookup(tiny_data):
    """The pure module's CPU range check reads the positions back: the glue must not use it."""
    model, task = _model(tiny_data, "admin-buffer", "scaled-sinusoidal")
    emb = model.encoder.embed_positions
    src, _, _ = sample_batch(task)
    positions = torch.arange(2, 2 + src.size(1)).unsqueeze(0)
    with no_host_sync(model, modules=[emb]):
        emb(src)  # shape-bounded lookup: fine
        with pytest.raises(HostSyncError, match="tolist"):
            emb(src, positions=positions)


# --------------------------------------------------------------------------------------- #
# the model
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_training_forward_backward_never_reads_the_device(tiny_data, scheme, pos):
    model, task = _model(tiny_data, scheme, pos)
    if scheme == "profile-loaded":
        # the profiling controller reads admin_profiled once per process, on the first
        # training forward (it then knows the model is profiled); every later step is checked
        _train_step(model, task)
        model.zero_grad()
    with no_host_sync(model) as guard:
        out = _train_step(model, task, guard)
    assert torch.isfinite(out).all()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_beam_search_never_reads_the_device(tiny_data, scheme, pos):
    model, task = _model(tiny_data, scheme, pos)
    with no_host_sync(model):
        hyps = _beam_search(model, task)
    assert len(hyps) == 3 and all(len(h) == 3 for h in hyps)
    # the guarded forward computes exactly what the unguarded one computes
    ref = _beam_search(model, task)
    assert [[h["tokens"].tolist() for h in s] for s in hyps] == \
        [[h["tokens"].tolist() for h in s] for s in ref]


@pytest.mark.parametrize("scheme,pos", BF16)
def test_bfloat16_training_and_beam_search_never_read_the_device(tiny_data, scheme, pos):
    """fairseq's --bf16 model cast: fixed omegas stay float32 (the one-kernel float32 sum)."""
    model, task = _model(tiny_data, scheme, pos, dtype=torch.bfloat16)
    if scheme == "profile-loaded":
        _train_step(model, task)
    with no_host_sync(model) as guard:
        out = _train_step(model, task, guard)
        hyps = _beam_search(model, task)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert len(hyps) == 3


@pytest.mark.cuda
@pytest.mark.parametrize("scheme,pos", BF16)
def test_cuda_forward_backward_and_beam_search_do_not_synchronize(tiny_data, scheme, pos):
    """On a GPU, CUDA's own sync detector (``set_sync_debug_mode("error")``) inside the model."""
    model, task = _model(tiny_data, scheme, pos)
    model.cuda()
    orig = {m: m.forward for m in (model.encoder, model.decoder)}

    def strict(fwd):
        def forward(*a, **k):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fwd(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return forward

    src, lengths, prev = (t.cuda() for t in sample_batch(task, left_pad_lengths=[7, 4, 6]))
    model.train()
    model(src, lengths, prev)  # first call: fairseq moves its position/mask tables once
    try:
        for m, fwd in orig.items():
            m.forward = strict(fwd)
        model(src, lengths, prev)[0].float().sum().backward()
        from fairseq.sequence_generator import SequenceGenerator

        model.eval()
        gen = SequenceGenerator([model], task.target_dictionary, beam_size=3, max_len_b=6)
        with torch.no_grad():
            gen.generate([model], {"net_input": {"src_tokens": src, "src_lengths": lengths}})
    finally:
        for m in orig:
            del m.forward
