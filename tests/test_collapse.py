"""The encoder token cosine (fairseq_admin_pos/collapse.py): the training-time tensor form and
the offline float form against the full N x N cosine matrix, pads left out, the collapsed and
degenerate cases, and no host read; the monitor's collapse warning rule."""
import math
import re
from pathlib import Path

import pytest
import torch

from dispatch_utils import NoValueReads
from fairseq_cli_utils import cos_by_matrix
from fairseq_admin_pos import collapse
from fairseq_admin_pos.collapse import collapse_warning, mean_pairwise_cosine, token_cosine
from markdown_utils import anchors

ROOT = Path(__file__).resolve().parent.parent


def padded_batch(seed: int, shared: float):
    """``(x (T, B, C), pad_mask (B, T))``: rows ``shared * d + noise`` (one direction ``d``
    for every token, so the cosine grows with ``shared``), left-padded sentences of 3..T
    tokens whose pad positions hold large values the measure must ignore."""
    g = torch.Generator().manual_seed(seed)
    t, b, c = 7, 5, 16
    d = torch.randn(c, generator=g)
    x = shared * d + torch.randn(t, b, c, generator=g)
    lengths = torch.randint(3, t + 1, (b,), generator=g)
    pad = torch.arange(t).unsqueeze(0) < (t - lengths).unsqueeze(1)  # (B, T), left padding
    x[pad.t()] = 1e3
    return x, pad


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shared", [0.0, 1.0, 4.0])
def test_token_cosine_is_the_mean_of_the_full_cosine_matrix_over_real_tokens(seed, shared):
    x, pad = padded_batch(seed, shared)
    real = x[~pad.t()]  # (N, C), the pads dropped by indexing
    want = cos_by_matrix(real)
    assert token_cosine(x, pad).item() == pytest.approx(want, abs=2e-6)
    assert mean_pairwise_cosine(real) == pytest.approx(want, abs=1e-12)
    # a shared direction makes tokens alike: the value orders the cases
    if shared == 4.0:
        assert want > 0.8
    if shared == 0.0:
        assert abs(want) < 0.1


def test_collapsed_tokens_give_one_and_a_single_token_gives_nan():
    x = torch.randn(16).expand(6, 3, 16) * torch.rand(6, 3, 1).add(0.5)  # one direction
    none = torch.zeros(3, 6, dtype=torch.bool)
    assert token_cosine(x, none).item() == pytest.approx(1.0, abs=1e-6)
    one = torch.ones(3, 6, dtype=torch.bool)
    one[1, 4] = False
    assert math.isnan(token_cosine(x, one).item())
    with pytest.raises(ValueError, match="2 or more rows"):
        mean_pairwise_cosine(x[0, :1])


def test_token_cosine_reads_nothing_back_and_builds_no_graph():
    x, pad = padded_batch(3, 1.0)
    x.requires_grad_(True)
    with NoValueReads():
        value = token_cosine(x, pad)
    assert value.dim() == 0 and value.dtype == torch.float32 and not value.requires_grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_token_cosine_stays_float32_under_autocast(dtype):
    # --amp runs the training forward under autocast: a half-precision product would overflow
    # |sum_i u_i|^2 (about N^2 for alike tokens) past 65504 at a few hundred tokens
    x = torch.randn(16).expand(40, 30, 16) + 0.1 * torch.randn(40, 30, 16)
    pad = torch.zeros(30, 40, dtype=torch.bool)
    want = cos_by_matrix(x.reshape(-1, 16))
    with torch.autocast("cpu", dtype=dtype):
        got = token_cosine(x, pad)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(want, abs=2e-6)


@pytest.mark.parametrize("cos, first, last, warmup, warns", [
    (0.95, 401, 410, 400, True),    # a whole interval after the warmup, above the line
    (0.95, 400, 409, 400, False),   # its first update is still the warmup's last
    (0.9, 401, 410, 400, False),    # on the line is not above it
    (0.9001, 701, 710, 400, True),
    (0.999, 11, 20, 0, False),      # no warmup: nothing says when the early phase ends
    (float("nan"), 401, 410, 400, False),
])
def test_collapse_warning_needs_a_whole_interval_after_the_warmup_above_the_line(
        cos, first, last, warmup, warns):
    message = collapse_warning(cos, first, last, warmup)
    assert (message is not None) == warns
    if warns:
        assert message.startswith(f"enc_tok_cos {cos:.4f} over updates {first}-{last}, after "
                                  f"the {warmup}-update warmup: ")
        assert "\n" not in message and "--lr" in message and "--warmup-updates" in message
        # the rule, and no figure but the interval's own and the line's: the study's counts
        # live on the docs page the message links
        assert f"a whole logging interval after the warmup above {collapse.COLLAPSE_COS}" \
            in message
        numbers = set(re.findall(r"\d+(?:\.\d+)?", message))
        assert numbers <= {f"{cos:.4f}", str(first), str(last), str(warmup),
                           str(collapse.COLLAPSE_COS)}, numbers


def test_the_collapse_rule_links_a_heading_of_the_training_page():
    # the warning and the module docstring point at the page that holds the figures
    message = collapse_warning(0.95, 401, 410, 400)
    link = re.search(r"docs/training\.md#([\w-]+)", message).group(1)
    assert link in anchors(ROOT / "docs" / "training.md")
    assert f"docs/training.md#{link}" in collapse.__doc__
    assert not re.search(r"\b0\.\d\d\b|\b1\.000\b", collapse.__doc__)  # no measured value
