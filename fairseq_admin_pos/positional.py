r"""Absolute position embeddings (pure torch; this module never imports fairseq).

Two modules with the constructor arguments, defaults, state-dict keys and
forward contract of the seed ``absolute_positional_embeddings.py``:

* :class:`SinusoidalEmbeddings` -- a fixed sinusoid table (Vaswani et al. 2017,
  "Attention Is All You Need"), optionally multiplied by one learned scalar as
  in FLASH (Hua et al. 2022, "Transformer Quality in Linear Time",
  arXiv 2202.10447, Appendix D, Code 2);
* :class:`PositionalEmbeddings` -- a learned table (``nn.Embedding``).

Both map integer position indices of any shape ``(*)`` to ``(*, H)``.  They
take the positions themselves (0 .. n_position-1), not tokens: computing
positions (e.g. fairseq's ``make_positions``, which starts at
``padding_idx + 1`` and gives pads ``padding_idx``) is the caller's job.

Differences from the seed (all deliberate, see the class docstrings):
arguments are validated (``ValueError`` naming the argument, never
``assert``), out-of-range indices raise an ``IndexError`` naming
``n_position`` instead of an opaque index error (or a CUDA device assert),
the ``padding_idx`` row of the sinusoid table is zero (the seed overwrote the
row zeroed by ``nn.Embedding``), the table is built vectorised, the
frequency layout is selectable (``frequency_layout``, default ``"standard"``;
``"fairseq"`` is fairseq's own table), and the learned scale's initial value
is an optional argument (``scaling_init``, default the seed's
``1/sqrt(hidden_width)``).

Host-device synchronisation: the range check reads the positions back only
when they are on the CPU (where reading them is free); on an accelerator it is
an asynchronous device assertion, so a forward never waits for the device.
"""
import math
import numbers
from typing import Optional

import torch
import torch.nn as nn

__all__ = ["SinusoidalEmbeddings", "PositionalEmbeddings", "FREQUENCY_LAYOUTS"]

#: Accepted values of ``frequency_layout``.
FREQUENCY_LAYOUTS = ("standard", "seed", "fairseq")


# --------------------------------------------------------------------------- #
# validation helpers (ValueError/TypeError/IndexError, never assert)
# --------------------------------------------------------------------------- #
def _check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return int(value)


def _check_padding_idx(padding_idx, n_position: int) -> Optional[int]:
    """Same semantics as ``nn.Embedding``: ``None`` or an int in
    ``[-n_position, n_position)``; negative values count from the end."""
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, numbers.Integral):
        raise ValueError(f"padding_idx must be None or an int; got {padding_idx!r}")
    padding_idx = int(padding_idx)
    if not -n_position <= padding_idx < n_position:
        raise ValueError(
            f"padding_idx must lie in [-n_position, n_position) = [{-n_position}, {n_position}); "
            f"got {padding_idx}"
        )
    return padding_idx + n_position if padding_idx < 0 else padding_idx


def _check_frequency_layout(frequency_layout) -> str:
    if not isinstance(frequency_layout, str) or frequency_layout not in FREQUENCY_LAYOUTS:
        raise ValueError(
            "frequency_layout must be one of "
            + ", ".join(repr(s) for s in FREQUENCY_LAYOUTS)
            + f"; got {frequency_layout!r}"
        )
    return frequency_layout


def _check_scaling_init(scaling_init, learnable_scaling: bool) -> Optional[float]:
    if scaling_init is None:
        return None
    if not learnable_scaling:
        raise ValueError(
            "scaling_init is the initial value of the learned scale and needs "
            f"learnable_scaling=True; got scaling_init={scaling_init!r} with "
            "learnable_scaling=False"
        )
    if isinstance(scaling_init, bool) or not isinstance(scaling_init, numbers.Real) \
            or not math.isfinite(scaling_init):
        raise ValueError(f"scaling_init must be a finite real number or None; got {scaling_init!r}")
    return float(scaling_init)


def _is_compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    is_compiling = getattr(compiler, "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


def _range_message(owner: str, n_position: int) -> str:
    return (f"{owner}: position indices must lie in [0, n_position) = [0, {n_position}) "
            "(increase n_position or clip the positions)")


def _check_positions(x, n_position: int, owner: str) -> None:
    """Type check plus a range check that never stalls an accelerator.

    CPU tensors: one ``aminmax`` read back, and an ``IndexError`` naming ``n_position`` and
    the offending indices. Other devices: reading values back would make the host wait for
    the device on every forward, so the check is ``torch._assert_async`` instead: nothing
    waits, and an out-of-range index fails at the device's next synchronisation (on CUDA a
    device-side assertion, which ends the process's CUDA context, as an out-of-range
    ``nn.Embedding`` lookup would). Run on the CPU to get the exact ``IndexError``.
    Skipped while ``torch.compile`` traces and on the meta device (no values).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{owner}: positions must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"{owner}: positions must be an integer tensor (torch.long or torch.int); got {x.dtype}"
        )
    if x.numel() == 0 or _is_compiling() or x.device.type == "meta":
        return
    if x.device.type != "cpu":
        torch._assert_async(((x >= 0) & (x < n_position)).all(), _range_message(owner, n_position))
        return
    lo, hi = torch.stack(torch.aminmax(x)).tolist()
    if lo < 0 or hi >= n_position:
        raise IndexError(
            f"{_range_message(owner, n_position)}; got max index {hi} and min index {lo}"
        )


# --------------------------------------------------------------------------- #
# sinusoidal
# --------------------------------------------------------------------------- #
class SinusoidalEmbeddings(nn.Module):
    r"""Fixed sinusoidal position embeddings, optionally with a learned scale.

    ``out[..., :] = scaling * table[x[...], :]`` where, for position ``pos``
    and column ``i`` (``H = hidden_width``), with ``frequency_layout``
    ``"standard"`` (default) or ``"seed"``::

        angle(pos, i) = pos / 10000 ** (2 * k(i) / H)
        table[pos, i] = sin(angle(pos, i))   if i is even
                        cos(angle(pos, i))   if i is odd
        table[0, :]   = 0                    (row 0 is kept as a zero vector)

    with ``k(i) = floor(i / 2)`` for ``"standard"`` (Vaswani et al. 2017:
    columns ``2j`` and ``2j+1`` are the sin/cos pair of the same frequency)
    and ``k(i) = i`` for ``"seed"`` (the formula of the seed and of the older
    revision of the repository it cites, where every column gets its own
    exponent).  With an odd ``H`` the last column is a sine.  These two
    tables are computed in float64 and stored as float32.

    ``frequency_layout="fairseq"`` is fairseq's
    ``SinusoidalPositionalEmbedding.get_embedding`` table (after
    tensor2tensor), value for value: with ``h = H // 2``::

        w_j = exp(-j * ln(10000) / (h - 1)),      j = 0 .. h-1
        table[pos, j]     = sin(pos * w_j)        (first half)
        table[pos, h + j] = cos(pos * w_j)        (second half)

    plus a zero last column when ``H`` is odd, computed in float32 with the
    same operations as fairseq so that the values are bitwise fairseq's.
    Row 0 is fairseq's (``[0 ... 0 | 1 ... 1]``); only the ``padding_idx``
    row is zeroed, as fairseq does.  ``H`` must be at least 4 (the spacing
    divides by ``h - 1``).

    **Default layout: "standard"**, because only it and ``"fairseq"`` give
    each sin/cos pair a common frequency, so that ``table[pos + k]`` is a
    fixed rotation of ``table[pos]`` in every pair (the relative-position
    property that motivates sinusoids).  The later revision of the
    repository the seed cites computes exactly this interleaved layout;
    fairseq and tensor2tensor concatenate the halves ``[sin | cos]`` with a
    slightly different frequency spacing (``h - 1`` instead of ``h`` in the
    exponent's denominator).  With the seed layout the sine and cosine of a
    pair have different frequencies.  ``"seed"`` reproduces the seed's table
    value for value.  Note that the table is the weight of
    ``self.embedding`` and is therefore saved in ``state_dict``: loading a
    checkpoint written by the seed restores the seed's table whatever layout
    the module was built with.

    Learned scaling (``learnable_scaling=True``) follows FLASH (Hua et al.
    2022, "Transformer Quality in Linear Time", arXiv 2202.10447, Appendix D,
    Code 2): a single trainable scalar ``scaling`` of shape ``(1,)``,
    initialised to ``scaling_init``; by default, as in the seed (and
    x-transformers' ``ScaledSinusoidalEmbedding``), ``1 / sqrt(hidden_width)``.
    The FLASH-pytorch and ESPnet ``ScaledPositionalEncoding``
    implementations start at 1.0 instead.  fairseq multiplies token
    embeddings by ``sqrt(d)`` (``embed_scale``), so token entries start with
    magnitude about 1 while these position entries start at about
    ``0.7 / sqrt(d)`` (0.03 for d = 512) with the seed's initial scale:
    positions start small relative to tokens and the model can learn to grow
    them; ``scaling_init=1`` starts them at the tokens' magnitude, as
    fairseq's unscaled sinusoid does.

    Parameters
    ----------
    n_position: ``int``
        Number of positions (max position index + 1); positive.
    hidden_width: ``int``
        Width ``H`` of the embeddings (usually the model width); positive,
        odd values allowed (at least 4 with ``frequency_layout="fairseq"``).
    learnable_scaling: ``bool`` (default False)
        Add the trainable scalar ``scaling`` (otherwise ``self.scaling`` is
        the int ``1`` as in the seed and no multiplication happens).
    padding_idx: ``int`` or None (default None)
        As in ``nn.Embedding`` (negative values count from the end): that
        row of the table is zero.  The seed overwrote it with the sinusoid
        after ``nn.Embedding`` had zeroed it; here it stays zero.  The table
        never receives gradients anyway.
    frequency_layout: ``"standard"`` (default), ``"seed"`` or ``"fairseq"``;
        see above.
    scaling_init: ``float`` or None (default None)
        Initial value of ``scaling`` (a finite number; requires
        ``learnable_scaling=True``); None means ``1 / sqrt(hidden_width)``.

    Shapes
    ------
    input: integer tensor (long or int) of any shape ``(*)`` (0-dim included)
    with values in ``[0, n_position)``; output: ``(*, H)`` in the dtype of
    the table (float32 unless the module was converted, e.g. ``.half()``).

    State dict keys: ``embedding.weight`` (``(n_position, H)``, requires_grad
    False) and, with learned scaling, ``scaling`` -- the seed's keys.

    Raises
    ------
    ValueError for invalid constructor arguments (naming the argument);
    TypeError for non-integer positions; IndexError (naming ``n_position``
    and the offending max/min index) for out-of-range positions on the CPU.
    On an accelerator :meth:`forward` does not read the positions back (that
    would stall the device every call): out-of-range indices fail through an
    asynchronous device assertion instead (see ``_check_positions``).
    Callers that bound the positions by construction use :meth:`lookup`.
    """

    def __init__(self, n_position: int, hidden_width: int, learnable_scaling: bool = False,
                 padding_idx: Optional[int] = None, frequency_layout: str = "standard",
                 scaling_init: Optional[float] = None) -> None:
        super().__init__()
        self.n_position = _check_positive_int(n_position, "n_position")
        self.hidden_width = _check_positive_int(hidden_width, "hidden_width")
        self.padding_idx = _check_padding_idx(padding_idx, self.n_position)
        self.frequency_layout = _check_frequency_layout(frequency_layout)
        self.learnable_scaling = bool(learnable_scaling)
        scaling_init = _check_scaling_init(scaling_init, self.learnable_scaling)

        table = self.position_encoding_init(self.n_position, self.hidden_width,
                                            self.frequency_layout)
        if self.padding_idx is not None:
            table[self.padding_idx].zero_()
        # from_pretrained keeps the table as given (it does not re-zero padding_idx)
        # and sets requires_grad=False; the table stays the weight of an nn.Embedding
        # so the state-dict key is the seed's ``embedding.weight``.
        self.embedding = nn.Embedding.from_pretrained(table, freeze=True,
                                                      padding_idx=self.padding_idx)

        if self.learnable_scaling:
            if scaling_init is None:
                scaling_init = 1.0 / math.sqrt(self.hidden_width)
            self.scaling_init = scaling_init
            self.scaling = nn.Parameter(torch.full((1,), scaling_init))
        else:
            self.scaling_init = None
            self.scaling = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Embed position indices of shape ``(*)`` into ``(*, H)`` (table dtype),
        multiplied by the learned ``scaling`` when enabled; indices are range-checked
        (``IndexError`` on the CPU, an asynchronous assertion elsewhere)."""
        _check_positions(x, self.n_position, type(self).__name__)
        return self.lookup(x)

    def lookup(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` without the range check, for callers whose positions are in
        range by construction (e.g. bounded by the input's shape, checked on the host by
        the caller); an out-of-range index fails as ``nn.Embedding`` fails."""
        out = self.embedding(x)
        if self.learnable_scaling:
            out = out * self.scaling.to(out.dtype)
        return out

    @staticmethod
    def position_encoding_init(n_position: int, hidden_width: int,
                               frequency_layout: str = "standard") -> torch.Tensor:
        """Return the ``(n_position, hidden_width)`` float32 sinusoid table.

        ``"seed"``: the seed's table (exponent ``2*i/H`` for every column ``i``);
        ``"standard"`` (default): the Vaswani layout (exponent ``2*floor(i/2)/H``);
        both computed vectorised in float64, row 0 zero.  ``"fairseq"``: fairseq's
        ``[sin | cos]`` table, bitwise (float32, fairseq's operations), row 0 as fairseq
        has it.  See the class docstring.
        """
        n_position = _check_positive_int(n_position, "n_position")
        hidden_width = _check_positive_int(hidden_width, "hidden_width")
        frequency_layout = _check_frequency_layout(frequency_layout)
        if frequency_layout == "fairseq":
            return _fairseq_table(n_position, hidden_width)

        pos = torch.arange(n_position, dtype=torch.float64).unsqueeze(1)      # (P, 1)
        col = torch.arange(hidden_width, dtype=torch.float64)                 # (H,)
        k = col if frequency_layout == "seed" else torch.floor(col / 2)
        denominator = torch.pow(10000.0, 2.0 * k / hidden_width)              # (H,)
        angle = pos / denominator                                             # (P, H)
        table = torch.empty_like(angle)
        table[:, 0::2] = torch.sin(angle[:, 0::2])   # dim 2j
        table[:, 1::2] = torch.cos(angle[:, 1::2])   # dim 2j+1
        table[0] = 0.0                               # row 0: zero vector (seed convention)
        return table.to(torch.float32)

    def extra_repr(self) -> str:
        out = (f"n_position={self.n_position}, hidden_width={self.hidden_width}, "
               f"learnable_scaling={self.learnable_scaling}, padding_idx={self.padding_idx}, "
               f"frequency_layout={self.frequency_layout!r}")
        if self.learnable_scaling:
            out += f", scaling_init={self.scaling_init:.6g}"
        return out


def _fairseq_table(n_position: int, hidden_width: int) -> torch.Tensor:
    # fairseq's get_embedding (tensor2tensor's layout), in float32 and in the same order of
    # operations, so that a model using this table is bitwise the one using fairseq's module
    half = hidden_width // 2
    if half < 2:
        raise ValueError(
            "frequency_layout 'fairseq' needs hidden_width >= 4 (its frequency spacing "
            f"ln(10000) / (hidden_width // 2 - 1) is undefined below); got {hidden_width}"
        )
    step = math.log(10000) / (half - 1)
    freq = torch.exp(torch.arange(half, dtype=torch.float32) * -step)                 # (h,)
    angle = torch.arange(n_position, dtype=torch.float32).unsqueeze(1) * freq.unsqueeze(0)
    table = torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).view(n_position, -1)
    if hidden_width % 2 == 1:
        table = torch.cat([table, torch.zeros(n_position, 1)], dim=1)
    return table


# --------------------------------------------------------------------------- #
# learned
# --------------------------------------------------------------------------- #
class PositionalEmbeddings(nn.Module):
    r"""Learned absolute position embeddings: ``out[...] = weight[x[...]]``.

    A plain ``nn.Embedding(n_position, hidden_width, padding_idx)`` as in the
    seed (state-dict key ``embedding.weight``), initialised like
    ``nn.Embedding`` (``N(0, 1)``; fairseq's learned positions use
    ``N(0, d^-0.5)`` and a table of ``num + padding_idx + 1`` rows instead).
    With ``padding_idx`` (negative values count from the end) that row is
    zero at initialisation and receives no gradient.

    Parameters
    ----------
    n_position: ``int``
        Number of positions (max position index + 1); positive.
    hidden_width: ``int``
        Width ``H`` of the embeddings; positive.
    padding_idx: ``int`` or None (default None)
        Row that is zero and gets no gradient, as in ``nn.Embedding``.

    Shapes
    ------
    input: integer tensor (long or int) of any shape ``(*)`` with values in
    ``[0, n_position)``; output: ``(*, H)`` in the dtype of the weight.

    Raises
    ------
    ValueError for invalid constructor arguments (naming the argument);
    TypeError for non-integer positions; IndexError (naming ``n_position``
    and the offending max/min index) for out-of-range positions on the CPU,
    an asynchronous device assertion on accelerators (no host-device wait).
    """

    def __init__(self, n_position: int, hidden_width: int,
                 padding_idx: Optional[int] = None) -> None:
        super().__init__()
        self.n_position = _check_positive_int(n_position, "n_position")
        self.hidden_width = _check_positive_int(hidden_width, "hidden_width")
        self.padding_idx = _check_padding_idx(padding_idx, self.n_position)
        self.embedding = nn.Embedding(self.n_position, self.hidden_width,
                                      padding_idx=self.padding_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Embed position indices of shape ``(*)`` into ``(*, H)``."""
        _check_positions(x, self.n_position, type(self).__name__)
        return self.embedding(x)

    def extra_repr(self) -> str:
        return (f"n_position={self.n_position}, hidden_width={self.hidden_width}, "
                f"padding_idx={self.padding_idx}")
