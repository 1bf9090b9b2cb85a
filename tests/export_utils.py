"""Helpers for the export tests: models with trained-looking weights, the stock model their
state dict folds into (in-process, the way ``fairseq-admin-export`` builds it), and the
measurements the tests compare."""
from __future__ import annotations

import argparse
from typing import Dict, List, Tuple

import torch

from fairseq_admin_pos.export.checkpoint import check_batch, model_layout, stock_args
from fairseq_admin_pos.export.fold import FoldResult, eps_relative_error, fold_state_dict

EXACT = 1e-5  # float32 log-probabilities of a fold that is exact up to rounding

#: residual schemes the export folds: the admin_transformer flags that make each
SCHEMES = {
    "admin-buffer": ["--admin-init", "closed-form", "--admin-omega", "buffer"],
    "admin-parameter": ["--admin-init", "closed-form", "--admin-omega", "parameter"],
    "post-ln-parameter": ["--admin-init", "none", "--admin-omega", "parameter"],
    "deepnorm": ["--admin-residual", "deepnorm"],
    "rezero-post-ln": ["--admin-residual", "rezero-post-ln"],
    "post-ln": ["--admin-init", "none"],
    "pre-ln": ["--admin-init", "none", "--encoder-normalize-before",
               "--decoder-normalize-before"],
}

#: (encoder, decoder) position choices; the last two have one side without positions
POSITIONS = [
    ("sinusoidal", "sinusoidal"),
    ("scaled-sinusoidal", "scaled-sinusoidal"),
    ("learned", "learned"),
    ("none", "none"),
    ("none", "learned"),
    ("scaled-sinusoidal", "none"),
]

SHARING = [["--share-all-embeddings"], ["--share-decoder-input-output-embed"], []]


def position_flags(enc: str, dec: str) -> List[str]:
    flags = ["--encoder-pos-emb", enc, "--decoder-pos-emb", dec]
    if "scaled-sinusoidal" in (enc, dec):
        # the fairseq table with a learned scale: starts as the sinusoidal model
        flags += ["--pos-emb-scaled-table", "fairseq", "--pos-emb-scale-init", "1"]
    return flags


def randomize_(model, seed: int = 0) -> None:
    """Trained-looking weights where initialisation leaves them special: omega vectors
    per channel in [0.5, 2.5], ReZero's a in [-1, 1], LayerNorm gains and biases away from
    1 and 0, scaled-sinusoid scales away from their start. Buffers (closed-form omegas,
    DeepNorm's alpha) keep their values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".omega"):
                p.copy_(0.5 + 2.0 * torch.rand(p.shape, generator=g))
            elif name.endswith("_residual.alpha"):
                p.copy_(2.0 * torch.rand(p.shape, generator=g) - 1.0)
            elif "layer_norm" in name or "layernorm" in name:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed.scaling"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))


def stock_model(model, args, task, **fold_options) -> Tuple[torch.nn.Module, FoldResult]:
    """fairseq's ``transformer`` built from the exported settings, loaded (strictly) with
    the folded state dict, in eval mode."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    model.eval()
    fold = fold_state_dict(model.state_dict(), model_layout(model, args), **fold_options)
    settings = stock_args(args, fold.positions, fold.unshared, str(args.data))
    stock = ARCH_MODEL_REGISTRY["transformer"].build_model(argparse.Namespace(**settings), task)
    # the original's dtype before loading (a float64 original must not pass through float32)
    stock.to(next(model.parameters()).dtype)
    stock.load_state_dict(fold.state_dict, strict=True)
    return stock.eval(), fold


def logprobs(model, batch) -> torch.Tensor:
    src, lengths, prev = batch
    with torch.no_grad():
        logits, _ = model(src, lengths, prev)
    return torch.log_softmax(logits, dim=-1)


def incremental_logprobs(model, batch) -> torch.Tensor:
    """Log-probabilities decoding one token at a time with ``incremental_state``."""
    src, lengths, prev = batch
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=lengths)
        state: Dict = {}
        steps = [model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)[0]
                 for t in range(prev.size(1))]
    return torch.log_softmax(torch.cat(steps, dim=1), dim=-1)


def padded_batch(task):
    """The export's self-check batch: left-padded sources, right-padded targets; the mask
    of the target positions that are not padding."""
    batch = check_batch(task.source_dictionary)
    return batch, batch[2].ne(task.target_dictionary.pad())


def unpadded_targets(batch, task):
    """The same batch with the target padding replaced by tokens (incremental decoding
    feeds one real token per step, never a pad)."""
    src, lengths, prev = batch
    prev = prev.clone()
    prev[prev.eq(task.target_dictionary.pad())] = task.target_dictionary.nspecial
    return src, lengths, prev


def max_diff(a, b, mask) -> float:
    return float((a - b).abs()[mask].max())


def set_eps(stock, fold: FoldResult, exact: bool) -> None:
    """Each LayerNorm the scalar fold went through gets eps / w^2 (``exact``) or fairseq's
    own eps back."""
    modules = dict(stock.named_modules())
    for name, w in fold.eps_scales.items():
        modules[name].eps = 1e-5 / w ** 2 if exact else 1e-5


def layer_norm_errors(stock, fold: FoldResult, batch) -> Dict[str, Tuple[torch.Tensor, ...]]:
    """Per LayerNorm of ``fold.eps_scales``, on the stock model's own inputs to it, per real
    (non-pad) token (float64): ``(measured, closed form, first order)`` relative errors of the normalised
    part: ``|LN_eps(v) - LN_exact(v)| / |LN_exact(v) - b|`` with torch's layer_norm,
    ``|1 - sqrt((var + eps/w^2) / (var + eps))|`` and ``eps |1 - 1/w^2| / (2 var)``."""
    modules = dict(stock.named_modules())
    seen: Dict[str, torch.Tensor] = {}
    hooks = [modules[name].register_forward_hook(
        lambda mod, inp, out, name=name: seen.__setitem__(name, inp[0].detach().double()))
        for name in fold.eps_scales]
    try:
        logprobs(stock, batch)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for name, w in fold.eps_scales.items():
        v, ln = seen[name], modules[name]
        g, b = ln.weight.double(), ln.bias.double()
        stock_out = torch.nn.functional.layer_norm(v, v.shape[-1:], g, b, 1e-5) - b
        exact_out = torch.nn.functional.layer_norm(v, v.shape[-1:], g, b, 1e-5 / w ** 2) - b
        measured = (stock_out - exact_out).norm(dim=-1) / exact_out.norm(dim=-1)
        var = v.var(dim=-1, unbiased=False)
        # (T, B) -> (B, T), masked to the real tokens of that side: a pad's stream (zero
        # embedding, masked out of every attention) has a tiny variance and affects nothing
        src, _, prev = batch
        side = src if name.startswith("encoder.") else prev
        real = side.ne(stock.encoder.padding_idx)
        out[name] = tuple(t.transpose(0, 1)[real] for t in (
            measured, eps_relative_error(var, w).abs(), 1e-5 * abs(1 - 1 / w ** 2) / (2 * var)))
    return out


def eps_tolerance(stock, fold, batch, mask) -> float:
    """The log-probability tolerance of an export with fairseq's eps: each affected
    LayerNorm scales its normalised output by 1 - delta_k (delta_k at most the closed form's
    maximum over the batch); if those relative errors reached the logits unamplified, log
    p = z - logsumexp(z) would move by at most 2 max|z| sum_k delta_k. Plus float32
    rounding."""
    deltas = layer_norm_errors(stock, fold, batch)
    total = sum(float(closed.max()) for _, closed, _ in deltas.values())
    src, lengths, prev = batch
    with torch.no_grad():
        z, _ = stock(src, lengths, prev)
    return 2 * float(z.abs()[mask].max()) * total + EXACT


def assert_same_hypotheses(ours, theirs, n: int) -> None:
    """``hypotheses()`` rows of two fairseq-generate runs: ``n`` each, the same tokens, scores
    within 1e-4 (the exported model's float32 rounding)."""
    assert len(ours) == len(theirs) == n
    for a, b in zip(ours, theirs):
        (sa, ta), (sb, tb) = a.split("\t"), b.split("\t")
        assert ta == tb and abs(float(sa) - float(sb)) < 1e-4, (a, b)
