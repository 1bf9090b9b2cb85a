r"""Admin residual rescaling (pure torch; this module never imports fairseq).

Admin ("Adaptive model initialization") is the residual rescaling of

    Liyuan Liu, Xiaodong Liu, Jianfeng Gao, Weizhu Chen, Jiawei Han.
    *Understanding the Difficulty of Training Transformers.* EMNLP 2020.

A Post-LN sub-layer ``i`` computes ``x_i = LN(x_{i-1} * omega_i + f_i(x_{i-1}))``
instead of ``LN(x_{i-1} + f_i(x_{i-1}))``; the shortcut weight ``omega`` keeps the
dependency of the output on the residual branches small enough for very deep
stacks to train.  The paper obtains omega by profiling one forward pass; the
``admin-torch`` package replaced profiling by a closed form that depends only on
the number ``N`` of residual sub-layers of the stack (2 per encoder layer:
self-attention and FFN; 3 per decoder layer: self-attention, cross-attention and
FFN) and on the desired order of the output change at initialisation:

=================  =====================================  =====================
``output_change``  ``omega ** 2``                          omega, N = 12/18/36
=================  =====================================  =====================
``'O(logn)'``      ``(N + 1) / ln(N + 1) - 1`` (default)   2.017 / 2.335 / 3.04
``'O(1)'``         ``N``                                   3.464 / 4.243 / 6.0
``'O(n)'``         ``1`` (plain residual)                  1 / 1 / 1
=================  =====================================  =====================

This module keeps the public API of ``admin_torch.admin`` (same names,
arguments, defaults and results) so that code written for admin-torch runs
after ``import fairseq_admin_pos.admin as admin_torch``, and fixes its defects:
arguments are validated with ``ValueError``/``TypeError`` (never ``assert``,
so ``python -O`` keeps the checks), :func:`calculate_init` returns a Python
``float``, omega follows ``.to()/.half()/.bfloat16()`` and survives
``state_dict`` save/load, and :class:`OmegaResidual` no longer rebinds
``self.forward`` on the instance (which broke ``deepcopy``, pickling,
``torch.compile`` and state loading).
"""
import math
import numbers

import torch

__all__ = [
    "OmegaResidual",
    "calculate_init",
    "as_module",
    "as_buffer",
    "as_parameter",
    "OUTPUT_CHANGE_SCALES",
]

#: Accepted values of ``output_change_scale`` (``'default'`` is ``'O(logn)'``).
OUTPUT_CHANGE_SCALES = ("O(logn)", "default", "O(1)", "O(n)")


# --------------------------------------------------------------------------- #
# argument validation (ValueError/TypeError, never assert: must survive -O)
# --------------------------------------------------------------------------- #
def _check_num_res_layers(num_res_layers) -> int:
    if isinstance(num_res_layers, bool) or not isinstance(num_res_layers, numbers.Integral):
        raise ValueError(
            "num_res_layers must be a positive int (the number of residual sub-layers "
            "of the stack: 2 per encoder layer, 3 per decoder layer); got "
            f"{num_res_layers!r} of type {type(num_res_layers).__name__}"
        )
    num_res_layers = int(num_res_layers)
    if num_res_layers < 1:
        raise ValueError(
            f"num_res_layers must be a positive int (>= 1); got {num_res_layers}"
        )
    return num_res_layers


def _check_output_change_scale(output_change_scale) -> str:
    if not isinstance(output_change_scale, str) or output_change_scale not in OUTPUT_CHANGE_SCALES:
        raise ValueError(
            "output_change_scale must be one of "
            + ", ".join(repr(s) for s in OUTPUT_CHANGE_SCALES)
            + f" ('default' means 'O(logn)'); got {output_change_scale!r}"
        )
    return "O(logn)" if output_change_scale == "default" else output_change_scale


def _check_embed_dim(embed_dim, why: str) -> int:
    if embed_dim is None:
        raise ValueError(f"embed_dim is required {why} (the hidden size of the shortcut)")
    if isinstance(embed_dim, bool) or not isinstance(embed_dim, numbers.Integral) or embed_dim < 1:
        raise ValueError(f"embed_dim must be a positive int; got {embed_dim!r}")
    return int(embed_dim)


def _check_init_value(init_value) -> float:
    if isinstance(init_value, torch.Tensor) and init_value.numel() == 1 \
            and init_value.is_floating_point():
        init_value = init_value.item()  # admin-torch accepted one-element tensors too
    if isinstance(init_value, bool) or not isinstance(init_value, numbers.Real):
        raise ValueError(f"init_value must be a real number; got {init_value!r}")
    init_value = float(init_value)
    if not math.isfinite(init_value):
        raise ValueError(f"init_value must be finite; got {init_value!r}")
    return init_value


def _check_network(network, func: str) -> None:
    if not isinstance(network, torch.nn.Module):
        raise TypeError(
            f"{func}: network must be a torch.nn.Module (omega is registered on it); "
            f"got {type(network).__name__}"
        )


def _factory_kwargs(network: torch.nn.Module) -> dict:
    """Device/dtype for a new omega: those of the first floating-point tensor
    already held by ``network`` (so adding omega to a model that was already
    moved with ``.to(...)``/``.half()`` does not mix devices or dtypes);
    the torch defaults otherwise."""
    for tensor in list(network.parameters()) + list(network.buffers()):
        if tensor.is_floating_point():
            return {"device": tensor.device, "dtype": tensor.dtype}
    return {}


# --------------------------------------------------------------------------- #
# public API
# --------------------------------------------------------------------------- #
class OmegaResidual(torch.nn.Module):
    r"""Residual connection with a rescaled shortcut: ``out = x * omega + f_x``.

    Admin (Liu et al. 2020, "Understanding the Difficulty of Training
    Transformers", EMNLP; closed-form initialisation from ``admin-torch``).
    Use :func:`as_module` to get one initialised from the depth of the stack.

    Parameters
    ----------
    init_value: ``float``, required.
        The initial value of the shortcut rescalar omega (a finite real number,
        or a one-element floating-point tensor).
    as_parameter: ``bool``, optional (default = False).
        ``False``: omega is a persistent *buffer* of shape ``(1,)`` (not
        trained, saved in ``state_dict`` under ``'omega'``).
        ``True``: omega is a trainable *parameter* of shape ``(embed_dim,)``
        filled with ``init_value`` (like the weight of a layer norm);
        ``embed_dim`` is then required.
    embed_dim: ``int``, optional (default = None).
        Hidden size of the shortcut; required (positive int) and only used
        when ``as_parameter`` is True.

    Shapes
    ------
    ``x`` and ``f_x``: ``(*, embed_dim)`` (any leading shape; for the buffer
    form the last dimension is free); output: the broadcast shape of
    ``x`` and ``f_x``, i.e. the input shape.

    Notes
    -----
    * omega is an ordinary buffer/parameter, so it follows ``.to(device)``,
      ``.half()``, ``.bfloat16()``, ``.double()`` and is restored by
      ``load_state_dict``.  In :meth:`forward` omega is cast to ``x.dtype``
      when they differ, so the result has the dtype ``x + f_x`` would have.
    * Unlike admin-torch, :meth:`forward` is a normal method that always
      computes ``x * omega + f_x`` from the *current* value of omega
      (nothing is decided at construction time).  Hence a buffer-form module
      built with ``1.0`` and then loaded with a state dict holding ``2.0``
      computes ``x * 2 + f_x``, and vice versa.  When omega equals ``1`` the
      result is bitwise identical to ``x + f_x`` (the seed switched to
      :meth:`forward_original` for that): in IEEE-754 arithmetic ``x * 1.0``
      is exact for every ``x`` (signed zeros, subnormals and infinities
      included), so ``x * 1.0 + f_x`` and ``x + f_x`` perform the same single
      rounded addition.  :meth:`forward_original` (``x + f_x``) and
      :meth:`forward_omega` (``x * omega + f_x``) remain available.
    """

    def __init__(self, init_value, as_parameter=False, embed_dim=None):
        super().__init__()
        init_value = _check_init_value(init_value)
        self.init_value = init_value
        self.as_parameter = bool(as_parameter)
        if self.as_parameter:
            self.embed_dim = _check_embed_dim(embed_dim, "when as_parameter is True")
            self.omega = torch.nn.Parameter(torch.full((self.embed_dim,), init_value))
        else:
            # embed_dim is ignored for the buffer form (as in admin-torch)
            self.embed_dim = None
            self.register_buffer("omega", torch.full((1,), init_value), persistent=True)

    def forward(self, x, f_x):
        """Return ``x * omega + f_x`` (same shape as the inputs).

        With omega == 1 (``O(n)`` output change, or ``init_value=1``) the
        result is bitwise ``x + f_x``; see the class notes.
        """
        return self.forward_omega(x, f_x)

    def forward_original(self, x, f_x):
        """Plain residual ``x + f_x`` (omega ignored)."""
        return x + f_x

    def forward_omega(self, x, f_x):
        """Rescaled residual ``x * omega + f_x``; omega is cast to ``x.dtype``."""
        omega = self.omega
        if x.is_floating_point() and omega.dtype != x.dtype:
            if omega.numel() == 1:
                # a 0-dim tensor does not promote a tensor of its own category (a float32
                # omega leaves a half x half): the kernel converts it to x's dtype on the
                # fly, with no separate cast kernel and the same rounding as .to(x.dtype)
                omega = omega.reshape(())
            else:
                omega = omega.to(x.dtype)
        # one fused kernel (f_x + x * omega) instead of a multiply, a temporary and an add;
        # with omega == 1 it is still bitwise x + f_x (x * 1 is exact, one rounding)
        return torch.addcmul(f_x, x, omega)

    def extra_repr(self) -> str:
        if self.as_parameter:
            return (f"init_value={self.init_value:.6g}, as_parameter=True, "
                    f"embed_dim={self.embed_dim}")
        return f"init_value={self.init_value:.6g}, as_parameter=False"


def calculate_init(
        num_res_layers,
        output_change_scale='O(logn)',
    ) -> float:
    r"""Closed-form Admin initialisation of omega for a stack of residual sub-layers.

    Returns ``omega = sqrt(omega2)`` where, with ``N = num_res_layers``:

    * ``'O(logn)'`` / ``'default'``: ``omega2 = (N + 1) / ln(N + 1) - 1``
      (N=12 -> 2.017, N=18 -> 2.335, N=36 -> 3.04);
    * ``'O(1)'``: ``omega2 = N``;
    * ``'O(n)'``: ``omega2 = 1`` (omega = 1, the plain residual).

    These are the closed forms of ``admin-torch`` for Admin (Liu et al. 2020,
    "Understanding the Difficulty of Training Transformers", EMNLP), chosen so
    that the change of the model output caused by a parameter update grows as
    ``O(log N)``, ``O(1)`` or ``O(N)`` in the depth.

    Parameters
    ----------
    num_res_layers: ``int``, required.
        The total number of residual sub-layers N of the stack (positive int):
        an n-layer Transformer encoder has 2n, an n-layer decoder 3n.
    output_change_scale: ``str``, optional (default = ``'O(logn)'``).
        One of ``'O(logn)'`` (alias ``'default'``), ``'O(1)'``, ``'O(n)'``.

    Returns
    -------
    float: the initial value of omega (a Python ``float``, >= 1).

    Raises
    ------
    ValueError: ``num_res_layers`` is not a positive int (bools, floats and
        values < 1 are rejected) or ``output_change_scale`` is not one of the
        values above.

    Example
    -------
    >>> import fairseq_admin_pos.admin as admin_torch
    >>> round(admin_torch.calculate_init(12), 3)
    2.017
    >>> admin_torch.calculate_init(16, 'O(1)')
    4.0
    """
    n = _check_num_res_layers(num_res_layers)
    scale = _check_output_change_scale(output_change_scale)
    if scale == "O(logn)":
        omega_value = (n + 1) / math.log(n + 1) - 1
    elif scale == "O(n)":
        omega_value = 1.0
    else:  # 'O(1)'
        omega_value = float(n)
    return float(math.sqrt(omega_value))


def as_module(
        num_res_layers,
        output_change_scale='default',
        as_parameter=False,
        embed_dim=None
    ) -> OmegaResidual:
    r"""Return an :class:`OmegaResidual` (``out = x * omega + f_x``) whose omega
    is initialised by :func:`calculate_init`.

    Admin (Liu et al. 2020, "Understanding the Difficulty of Training
    Transformers", EMNLP; closed form of admin-torch): for ``N`` residual
    sub-layers, ``omega**2 = (N+1)/ln(N+1) - 1`` ('O(logn)', default),
    ``N`` ('O(1)') or ``1`` ('O(n)').

    Parameters
    ----------
    num_res_layers: ``int``, required.
        The total number of residual sub-layers of the stack (2 per encoder
        layer, 3 per decoder layer).
    output_change_scale: ``str``, optional (default = ``'default'``, i.e. ``'O(logn)'``).
        One of ``'O(logn)'`` / ``'default'``, ``'O(1)'``, ``'O(n)'``.
    as_parameter: ``bool``, optional (default = False).
        False: omega is a buffer of shape ``(1,)``; True: a trainable
        parameter of shape ``(embed_dim,)`` (``embed_dim`` then required).
    embed_dim: ``int``, optional (default = None).
        Hidden size of the shortcut; required and only used when
        ``as_parameter`` is True.

    Returns
    -------
    OmegaResidual: called as ``module(x, f_x)`` with ``x, f_x`` of shape
    ``(*, embed_dim)``; returns ``x * omega + f_x`` of the same shape.

    Example
    -------

    .. code-block:: python

        import types
        import torch
        import torch.nn as nn
        import fairseq_admin_pos.admin as admin_torch

        class TransformerEncoderLayer(nn.Module):

            def __init__(self, cfg):
                super().__init__()

                num_layer = 2 * cfg.encoder_layers  # number of residual layers

                self.attn = nn.MultiheadAttention(cfg.embed_dim, cfg.num_heads)
                self.residual_attn = admin_torch.as_module(num_layer)
                self.ln_attn = nn.LayerNorm(cfg.embed_dim)

                self.ffn = nn.Sequential(
                    nn.Linear(cfg.embed_dim, cfg.feedforward_dim),
                    nn.ReLU(),
                    nn.Linear(cfg.feedforward_dim, cfg.embed_dim)
                )
                self.residual_ffn = admin_torch.as_module(num_layer)
                self.ln_ffn = nn.LayerNorm(cfg.embed_dim)

            def forward(self, x):

                # nn.MultiheadAttention needs query, key and value
                f_x, _ = self.attn(x, x, x)
                x = self.residual_attn(x, f_x)
                x = self.ln_attn(x)

                f_x = self.ffn(x)
                x = self.residual_ffn(x, f_x)
                x = self.ln_ffn(x)

                return x

        cfg = types.SimpleNamespace(encoder_layers=6, embed_dim=16, num_heads=2,
                                    feedforward_dim=32)
        layer = TransformerEncoderLayer(cfg)
        y = layer(torch.randn(5, 3, cfg.embed_dim))  # (time, batch, embed_dim)
        assert y.shape == (5, 3, cfg.embed_dim)
    """
    omega_value = calculate_init(num_res_layers, output_change_scale)
    return OmegaResidual(omega_value, as_parameter=as_parameter, embed_dim=embed_dim)


def as_buffer(
        network,
        buffer_name,
        num_res_layers,
        output_change_scale='default',
    ) -> None:
    r"""Compute omega with :func:`calculate_init` and *register* it on ``network``
    as a persistent buffer (not trainable) of shape ``(1,)``.

    The caller then writes the Admin residual ``x * omega + f_x`` itself
    (Liu et al. 2020, "Understanding the Difficulty of Training
    Transformers", EMNLP; closed form of admin-torch: ``omega**2 =
    (N+1)/ln(N+1) - 1`` for 'O(logn)', ``N`` for 'O(1)', ``1`` for 'O(n)').
    The buffer is saved in ``state_dict`` and follows ``.to()``/``.half()``;
    it is created on the device/dtype of the first floating-point tensor
    ``network`` already holds (torch defaults if none).

    Parameters
    ----------
    network: ``torch.nn.Module``, required.
        The module holding the residual computation; omega is registered on it.
    buffer_name: ``str``, required.
        Attribute name of omega on ``network``.
    num_res_layers: ``int``, required.
        The total number of residual sub-layers of the stack (2 per encoder
        layer, 3 per decoder layer).
    output_change_scale: ``str``, optional (default = ``'default'``, i.e. ``'O(logn)'``).
        One of ``'O(logn)'`` / ``'default'``, ``'O(1)'``, ``'O(n)'``.

    Returns
    -------
    None. ``getattr(network, buffer_name)`` is a tensor of shape ``(1,)``.

    Raises
    ------
    TypeError: ``network`` is not a ``torch.nn.Module``.
    ValueError: invalid ``num_res_layers`` / ``output_change_scale``.

    Example
    -------

    .. code-block:: python

        import types
        import torch
        import torch.nn as nn
        import fairseq_admin_pos.admin as admin_torch

        class TransformerEncoderLayer(nn.Module):

            def __init__(self, cfg):
                super().__init__()

                num_layer = 2 * cfg.encoder_layers  # number of residual layers

                self.attn = nn.MultiheadAttention(cfg.embed_dim, cfg.num_heads)
                admin_torch.as_buffer(self, 'attn_omega', num_layer)
                self.ln_attn = nn.LayerNorm(cfg.embed_dim)

                self.ffn = nn.Sequential(
                    nn.Linear(cfg.embed_dim, cfg.feedforward_dim),
                    nn.ReLU(),
                    nn.Linear(cfg.feedforward_dim, cfg.embed_dim)
                )
                admin_torch.as_buffer(self, 'ffn_omega', num_layer)
                self.ln_ffn = nn.LayerNorm(cfg.embed_dim)

            def forward(self, x):

                # nn.MultiheadAttention needs query, key and value
                f_x, _ = self.attn(x, x, x)
                x = x * self.attn_omega + f_x
                x = self.ln_attn(x)

                f_x = self.ffn(x)
                x = x * self.ffn_omega + f_x
                x = self.ln_ffn(x)

                return x

        cfg = types.SimpleNamespace(encoder_layers=6, embed_dim=16, num_heads=2,
                                    feedforward_dim=32)
        layer = TransformerEncoderLayer(cfg)
        y = layer(torch.randn(5, 3, cfg.embed_dim))  # (time, batch, embed_dim)
        assert y.shape == (5, 3, cfg.embed_dim)
    """
    _check_network(network, "as_buffer")
    omega_value = calculate_init(num_res_layers, output_change_scale)
    network.register_buffer(
        buffer_name,
        torch.full((1,), omega_value, **_factory_kwargs(network)),
        persistent=True,
    )


def as_parameter(
        network,
        parameter_name,
        num_res_layers,
        embed_dim,
        output_change_scale='default',
    ) -> None:
    r"""Compute omega with :func:`calculate_init` and *register* it on ``network``
    as a trainable parameter: a vector of shape ``(embed_dim,)`` filled with
    the initial value (like the weight of a layer norm).

    The caller then writes the Admin residual ``x * omega + f_x`` itself
    (Liu et al. 2020, "Understanding the Difficulty of Training
    Transformers", EMNLP; closed form of admin-torch: ``omega**2 =
    (N+1)/ln(N+1) - 1`` for 'O(logn)', ``N`` for 'O(1)', ``1`` for 'O(n)').
    The parameter is created on the device/dtype of the first floating-point
    tensor ``network`` already holds (torch defaults if none).

    Parameters
    ----------
    network: ``torch.nn.Module``, required.
        The module holding the residual computation; omega is registered on it.
    parameter_name: ``str``, required.
        Attribute name of omega on ``network``.
    num_res_layers: ``int``, required.
        The total number of residual sub-layers of the stack (2 per encoder
        layer, 3 per decoder layer).
    embed_dim: ``int``, required.
        Hidden size of the shortcut (positive int); omega has shape ``(embed_dim,)``.
    output_change_scale: ``str``, optional (default = ``'default'``, i.e. ``'O(logn)'``).
        One of ``'O(logn)'`` / ``'default'``, ``'O(1)'``, ``'O(n)'``.

    Returns
    -------
    None. ``getattr(network, parameter_name)`` is an ``nn.Parameter`` of shape ``(embed_dim,)``.

    Raises
    ------
    TypeError: ``network`` is not a ``torch.nn.Module``.
    ValueError: invalid ``embed_dim`` / ``num_res_layers`` / ``output_change_scale``.

    Example
    -------

    .. code-block:: python

        import types
        import torch
        import torch.nn as nn
        import fairseq_admin_pos.admin as admin_torch

        class TransformerEncoderLayer(nn.Module):

            def __init__(self, cfg):
                super().__init__()

                num_layer = 2 * cfg.encoder_layers  # number of residual layers

                self.attn = nn.MultiheadAttention(cfg.embed_dim, cfg.num_heads)
                admin_torch.as_parameter(self, 'attn_omega', num_layer, cfg.embed_dim)
                self.ln_attn = nn.LayerNorm(cfg.embed_dim)

                self.ffn = nn.Sequential(
                    nn.Linear(cfg.embed_dim, cfg.feedforward_dim),
                    nn.ReLU(),
                    nn.Linear(cfg.feedforward_dim, cfg.embed_dim)
                )
                admin_torch.as_parameter(self, 'ffn_omega', num_layer, cfg.embed_dim)
                self.ln_ffn = nn.LayerNorm(cfg.embed_dim)

            def forward(self, x):

                # nn.MultiheadAttention needs query, key and value
                f_x, _ = self.attn(x, x, x)
                x = x * self.attn_omega + f_x
                x = self.ln_attn(x)

                f_x = self.ffn(x)
                x = x * self.ffn_omega + f_x
                x = self.ln_ffn(x)

                return x

        cfg = types.SimpleNamespace(encoder_layers=6, embed_dim=16, num_heads=2,
                                    feedforward_dim=32)
        layer = TransformerEncoderLayer(cfg)
        y = layer(torch.randn(5, 3, cfg.embed_dim))  # (time, batch, embed_dim)
        assert y.shape == (5, 3, cfg.embed_dim)
    """
    _check_network(network, "as_parameter")
    embed_dim = _check_embed_dim(embed_dim, "by as_parameter")
    omega_value = calculate_init(num_res_layers, output_change_scale)
    network.register_parameter(
        parameter_name,
        torch.nn.Parameter(torch.full((embed_dim,), omega_value, **_factory_kwargs(network))),
    )
