"""The export's folding (fairseq_admin_pos.export.fold) against the original models, in-process.

Every exportable residual scheme x omega form x position choice (tiny models, width 16,
seeded, with trained-looking weights: non-uniform omega vectors, LayerNorms away from
1/0): the stock fairseq ``transformer`` built from the export's settings and loaded strictly
with the folded state dict gives the original's log-probabilities on a batch with padding
(left-padded sources, right-padded targets), in a full forward and decoding incrementally.
Exact folds agree to 1e-5 (float32). Scalar shortcut weights folded into the branch outputs
differ by the LayerNorm eps term of fold.py section 2; there the tests show that the export
is exact once each such LayerNorm's eps is eps / w^2, measure each LayerNorm's relative error
against the closed form, and bound the log-probability difference with it.
"""
from __future__ import annotations

import re

import pytest
import torch

from export_utils import (
    EXACT,
    POSITIONS,
    SCHEMES,
    SHARING,
    eps_tolerance,
    incremental_logprobs,
    layer_norm_errors,
    logprobs,
    max_diff,
    padded_batch,
    position_flags,
    randomize_,
    set_eps,
    stock_model,
    unpadded_targets,
)
from fairseq_admin_pos.export.fold import (
    NotExportable,
    eps_relative_error,
    fairseq_sinusoid_table,
    fold_state_dict,
)
from fairseq_admin_pos.export.checkpoint import model_layout
from model_utils import SMALL, build

CASES = [(scheme, pos) for scheme in SCHEMES for pos in POSITIONS]


@pytest.mark.parametrize("scheme,positions", CASES, ids=[f"{s}-{e}-{d}" for s, (e, d) in CASES])
def test_export_matches_original(tiny_data, scheme, positions):
    sharing = SHARING[CASES.index((scheme, positions)) % len(SHARING)]
    flags = SMALL + SCHEMES[scheme] + position_flags(*positions) + sharing
    model, task, args = build(tiny_data, "admin_transformer", flags)
    randomize_(model, seed=len(scheme))
    stock, fold = stock_model(model, args, task)
    batch, mask = padded_batch(task)
    original = logprobs(model, batch)

    vector = scheme in ("admin-parameter", "post-ln-parameter")
    assert fold.unshared == vector
    assert bool(fold.eps_scales) == (scheme in ("admin-buffer", "deepnorm"))
    expected_kind = {"sinusoidal": "learned" if vector else "sinusoidal",
                     "scaled-sinusoidal": "learned", "learned": "learned", "none": "none"}
    kinds = [expected_kind[p] for p in positions]
    if "none" in kinds and kinds != ["none", "none"]:
        kinds = [k if k != "none" else "learned" for k in kinds]  # the all-zero table
    assert [fold.positions["encoder"], fold.positions["decoder"]] == kinds

    full = logprobs(stock, batch)
    step_batch = unpadded_targets(batch, task)
    if fold.exact:
        assert max_diff(full, original, mask) <= EXACT
    else:
        assert max_diff(full, original, mask) <= eps_tolerance(stock, fold, batch, mask)
        set_eps(stock, fold, exact=True)
        assert max_diff(logprobs(stock, batch), original, mask) <= EXACT
    # incremental decoding of the stock model == the original's full forward
    step = incremental_logprobs(stock, step_batch)
    assert max_diff(step, logprobs(model, step_batch), torch.ones_like(mask)) <= EXACT


@pytest.mark.parametrize("scheme", ["admin-buffer", "deepnorm"])
def test_scalar_fold_input_is_exact(tiny_data, scheme):
    """--scalar-fold input: a scalar omega folded like a vector (LayerNorm before, q/k/v/fc1)
    is exact with fairseq's own eps, at the price of per-side tables."""
    model, task, args = build(tiny_data, "admin_transformer",
                              SMALL + SCHEMES[scheme] + ["--share-all-embeddings"])
    randomize_(model)
    stock, fold = stock_model(model, args, task, scalar_fold="input")
    assert fold.exact and fold.unshared and fold.positions["encoder"] == "learned"
    batch, mask = padded_batch(task)
    assert max_diff(logprobs(stock, batch), logprobs(model, batch), mask) <= EXACT


def test_layernorm_embedding_is_the_first_producer(tiny_data):
    """With --layernorm-embedding the first sub-layer's omega vector goes into that
    LayerNorm: the token tables stay shared and the sinusoid stays a sinusoid."""
    model, task, args = build(tiny_data, "admin_transformer", SMALL + SCHEMES["admin-parameter"]
                              + ["--layernorm-embedding", "--share-all-embeddings"])
    randomize_(model)
    stock, fold = stock_model(model, args, task)
    assert not fold.unshared and fold.positions == {"encoder": "sinusoidal",
                                                    "decoder": "sinusoidal"}
    assert stock.encoder.embed_tokens.weight is stock.decoder.embed_tokens.weight
    batch, mask = padded_batch(task)
    assert max_diff(logprobs(stock, batch), logprobs(model, batch), mask) <= EXACT


@pytest.mark.parametrize("scheme", ["deepnorm", "admin-buffer"])
def test_eps_error_is_the_derived_term(tiny_data, scheme):
    """6L-6L scalar folds in float64, where rounding is far below the eps term:

    * per LayerNorm and token, the measured relative error of the stock LayerNorm's output
      is the closed form 1 - sqrt((var + eps/w^2)/(var + eps)), below its first-order
      value eps |1 - 1/w^2| / (2 var) (1 + its own size), and a few 1e-6 (var about 1);
    * with eps / w^2 in those LayerNorms the export equals the original (1e-10);
    * with fairseq's eps the log-probability difference is not zero, within the tolerance
      derived from the per-LayerNorm errors, and first order in the eps gap: halving every
      gap (eps_k = eps/w^2 + (eps - eps/w^2) / 2) halves it (to 1% of its size)."""
    model, task, args = build(tiny_data, "admin_transformer", SMALL + SCHEMES[scheme] + [
        "--encoder-layers", "6", "--decoder-layers", "6", "--share-all-embeddings"])
    randomize_(model)
    model.double()
    stock, fold = stock_model(model, args, task)
    batch, mask = padded_batch(task)
    original = logprobs(model, batch)
    assert len(fold.eps_scales) == 2 * 6 + 3 * 6

    errors = layer_norm_errors(stock, fold, batch)
    for name, (measured, closed, first) in errors.items():
        torch.testing.assert_close(measured, closed, rtol=1e-6, atol=1e-13, msg=name)
        assert bool((closed <= first * (1 + first * 4) + 1e-15).all()), name
    assert 1e-7 < max(float(c.max()) for _, c, _ in errors.values()) < 2e-5

    set_eps(stock, fold, exact=True)
    assert max_diff(logprobs(stock, batch), original, mask) <= 1e-10
    set_eps(stock, fold, exact=False)
    stock_diff = logprobs(stock, batch) - original
    size = float(stock_diff.abs()[mask].max())
    assert 1e-7 < size <= eps_tolerance(stock, fold, batch, mask)

    modules = dict(stock.named_modules())
    for name, w in fold.eps_scales.items():
        modules[name].eps = 1e-5 / w ** 2 + 0.5 * (1e-5 - 1e-5 / w ** 2)
    half = logprobs(stock, batch) - original
    torch.testing.assert_close(half[mask], 0.5 * stock_diff[mask], rtol=0, atol=1e-2 * size)


def test_eps_relative_error_closed_form():
    """delta = 1 - sqrt((var + eps/w^2)/(var + eps)): zero at w = 1, positive for w > 1,
    negative for w < 1, eps (1 - 1/w^2)/(2 var) to first order."""
    var = torch.tensor([0.5, 1.0, 4.0])
    assert torch.equal(eps_relative_error(var, 1.0), torch.zeros(3, dtype=torch.float64))
    d = eps_relative_error(var, 2.0)
    first = 1e-5 * (1 - 0.25) / (2 * var.double())
    torch.testing.assert_close(d, first, rtol=1e-4, atol=0)
    assert bool((eps_relative_error(var, 0.8) < 0).all())


def test_sinusoid_table_is_fairseqs(tiny_data):
    """The table a vector fold scales is the one fairseq's sinusoidal module looks up."""
    from fairseq.modules import PositionalEmbedding

    module = PositionalEmbedding(30, 16, padding_idx=1, learned=False)
    torch.testing.assert_close(fairseq_sinusoid_table(30, 16, 1), module.weights[:32],
                               rtol=0, atol=0)


@pytest.mark.parametrize("flags,refused,reason", [
    (["--admin-residual", "rezero"], "--admin-residual rezero", "no sub-layer LayerNorm"),
    (["--admin-residual", "b2t"], "--admin-residual b2t", "skips a sub-layer"),
    (["--admin-residual", "resi-dual"], "--admin-residual resi-dual",
     "second (dual) residual stream"),
    (["--admin-residual", "peri-ln"], "--admin-residual peri-ln", "each sub-layer's output"),
    (["--admin-residual", "mix-ln"], "--admin-residual mix-ln",
     "mixes Post-LN and Pre-LN layers within a stack"),
    # the scheme's reason first when both are refused
    (["--admin-residual", "mix-ln", "--admin-norm", "dyt"], "--admin-residual mix-ln",
     "one placement (--encoder/--decoder-normalize-before) per stack"),
    (["--admin-init", "none", "--admin-norm", "dyt"], "--admin-norm dyt", "is no LayerNorm"),
])
def test_refused_schemes(tiny_data, flags, refused, reason):
    model, task, args = build(tiny_data, "admin_transformer", SMALL + flags)
    with pytest.raises(NotExportable, match=re.escape(refused) + " cannot be exported.*"
                                            + re.escape(reason)):
        fold_state_dict(model.state_dict(), model_layout(model, args))


def test_pre_ln_with_trained_omega_is_refused(tiny_data):
    """Pre-LN with --admin-omega parameter (allowed with --admin-init none): the shortcut is
    not normalised, so an omega vector away from 1 cannot be folded."""
    model, task, args = build(tiny_data, "admin_transformer", SMALL + SCHEMES["pre-ln"]
                              + ["--admin-omega", "parameter"])
    state = model.state_dict()
    assert model_layout(model, args).encoder.normalize_before
    fold_state_dict(state, model_layout(model, args))  # omega = 1: stock Pre-LN
    randomize_(model)
    with pytest.raises(NotExportable, match="Pre-LN encoder has shortcut weights other than 1"):
        fold_state_dict(model.state_dict(), model_layout(model, args))
