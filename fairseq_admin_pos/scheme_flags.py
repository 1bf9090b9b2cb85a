"""The residual schemes by name: the one table that ``make demo``, the depth study
(``benchmarks/depth_study.py``), ``fairseq-admin-analyze`` and the recipes in ``examples/``
read, so that a name means one model everywhere.

A scheme is the ``admin_transformer`` flags that build its model (:attr:`Scheme.model`) and,
where the scheme needs its own, the optimizer flags it trains with (:attr:`Scheme.optimizer`;
``admin-paper`` brings RAdam as Transformer-Clinic trains it). A scheme without optimizer
flags trains with the caller's default, Adam (:data:`DEFAULT_OPTIMIZER`). The caller adds
its own recipe (sizes, depths, schedule, batch). The schemes are described in
``docs/schemes.md``.

Pure python: importing it loads neither torch nor fairseq. From the shell::

    python -m fairseq_admin_pos.scheme_flags admin            # model and optimizer flags
    python -m fairseq_admin_pos.scheme_flags --part model admin-paper
    python -m fairseq_admin_pos.scheme_flags --part lines admin   # model, optimizer: 2 lines
    python -m fairseq_admin_pos.scheme_flags --list

print the flags as shell words (quoted where needed), or one ``error:`` line naming the valid
choices (exit status 2).
"""
from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Scheme", "TABLE", "SCHEMES", "DEFAULT_OPTIMIZER", "SchemeNameError", "scheme",
           "flags", "optimizer_flags", "train_flags", "main"]


@dataclass(frozen=True)
class Scheme:
    """One residual scheme: ``model`` are ``admin_transformer`` flags, ``optimizer`` the
    optimizer flags the scheme brings (empty: the caller's default)."""

    label: str
    summary: str
    model: Tuple[str, ...]
    optimizer: Tuple[str, ...] = ()

    @property
    def flags(self) -> List[str]:
        """The model flags, then the scheme's own optimizer flags."""
        return [*self.model, *self.optimizer]


_NONE = ("--admin-init", "none")
_PRE_LN = (*_NONE, "--encoder-normalize-before", "--decoder-normalize-before")
_DYT = ("--admin-norm", "dyt")
_CLINIC_RADAM = ("--optimizer", "radam", "--radam-early-steps", "skip")


def _rival(name: str, *extra: str) -> Tuple[str, ...]:
    return ("--admin-residual", name, *extra)


#: name -> scheme. The first five are ``make demo``'s choices and the depth study's main
#: schemes (their flags name the study's runs: change them and the recorded rows no longer
#: match).
TABLE: Dict[str, Scheme] = {
    "post-ln": Scheme("Post-LN", "stock fairseq Post-LN: LN(x + f(x))", _NONE),
    "pre-ln": Scheme("Pre-LN", "stock fairseq Pre-LN: x + f(LN(x))", _PRE_LN),
    "admin": Scheme(
        "Admin (closed form)", "the recommended Admin: admin-torch's closed-form O(log N) omega per stack, "
        "a trainable vector; Adam",
        ("--admin-init", "closed-form", "--admin-omega", "parameter")),
    "admin-paper": Scheme(
        "Admin (paper: profiled)", "the paper's Admin as Transformer-Clinic runs it: omegas profiled "
        "on the first batch in training mode, a trainable vector; RAdam",
        ("--admin-init", "profile", "--admin-profile-mode", "clinic", "--admin-omega",
         "parameter"), _CLINIC_RADAM),
    "deepnorm": Scheme("DeepNorm", "DeepNet: LN(alpha x + f(x)), beta-scaled initialisation",
                       _rival("deepnorm")),
    "admin-profile": Scheme(
        "Admin profiled (eval mode)", "omegas profiled on the first batch without dropout, "
        "padding excluded (comparable across depths), a trainable vector; Adam",
        ("--admin-init", "profile", "--admin-profile-mode", "eval", "--admin-omega",
         "parameter")),
    "rezero": Scheme("ReZero (no LN)", "x + a f(x), a trainable scalar from 0, no LayerNorm",
                     _rival("rezero")),
    "rezero-post-ln": Scheme("ReZero Post-LN", "LN(x + a f(x))", _rival("rezero-post-ln")),
    "b2t": Scheme("B2T connection", "Post-LN plus the layer input added into its last LN",
                  _rival("b2t")),
    "resi-dual": Scheme("ResiDual", "a Post-LN stream and a Pre-LN-like dual sum",
                        _rival("resi-dual")),
    "peri-ln": Scheme("Peri-LN", "x + LN(f(LN(x))), a final LN per stack", _rival("peri-ln")),
    "mix-ln": Scheme("Mix-LN (alpha 0.25)", "Post-LN in the bottom quarter, Pre-LN above",
                     _rival("mix-ln")),
    "post-ln-dyt": Scheme("Post-LN, DyT", "Post-LN with DyT in place of LayerNorm",
                          (*_NONE, *_DYT)),
    "pre-ln-dyt": Scheme("Pre-LN, DyT", "Pre-LN with DyT in place of LayerNorm",
                         (*_PRE_LN, *_DYT)),
    "peri-ln-dyt": Scheme("Peri-LN, DyT", "Peri-LN with DyT in place of LayerNorm",
                          _rival("peri-ln", *_DYT)),
    "mix-ln-dyt": Scheme("Mix-LN (alpha 0.25), DyT", "Mix-LN with DyT in place of LayerNorm",
                         _rival("mix-ln", *_DYT)),
    # the Admin paper's baselines as Transformer-Clinic trained them (RAdam, like admin-paper)
    "post-ln-paper": Scheme("Post-LN (paper's training)", "stock Post-LN with RAdam, as "
                            "Transformer-Clinic trained the paper's baselines", _NONE,
                            _CLINIC_RADAM),
    "pre-ln-paper": Scheme("Pre-LN (paper's training)", "stock Pre-LN with RAdam, as "
                           "Transformer-Clinic trained the paper's baselines", _PRE_LN,
                           _CLINIC_RADAM),
    "kasai": Scheme(
        "Post-LN (Kasai et al.)", "stock Post-LN with the optimizer of Kasai et al.'s "
        "deep-encoder, shallow-decoder training (gradient clipping at 25)", _NONE,
        ("--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "25.0")),
}

#: ``make demo``'s schemes (and the depth study's first five), name -> flags
SCHEMES: Dict[str, List[str]] = {name: TABLE[name].flags
                                 for name in ("post-ln", "pre-ln", "admin", "admin-paper",
                                              "deepnorm")}

#: the optimizer of a scheme that brings none (admin-torch's and the demo's)
DEFAULT_OPTIMIZER = ("--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "0.0")

#: names that meant a scheme before the table, and what they are now
RENAMED = {"admin-closed-form": "admin"}


class SchemeNameError(ValueError):
    """A scheme name that is not in the table (or not among the caller's choices)."""


def scheme(name: str, choices: Optional[Sequence[str]] = None, setting: str = "scheme") -> Scheme:
    """The scheme called ``name``; an unknown name (or one outside ``choices``) raises
    :class:`SchemeNameError` with one line naming ``setting`` and the valid choices."""
    valid = list(choices) if choices is not None else list(TABLE)
    unknown = [c for c in valid if c not in TABLE]
    if unknown:
        raise SchemeNameError(f"unknown scheme names among the choices: {', '.join(unknown)}")
    if name in valid:
        return TABLE[name]
    hint = f" ({name} is now called {RENAMED[name]})" if name in RENAMED else ""
    raise SchemeNameError(f"{setting} '{name}' is not valid{hint}; valid choices: "
                          f"{' '.join(valid)}")


def flags(name: str) -> List[str]:
    """The model flags of ``name``, then its own optimizer flags (if any)."""
    return scheme(name).flags


def _groups(words: Sequence[str]) -> List[List[str]]:
    # ["--a", "1", "--b"] -> [["--a", "1"], ["--b"]]
    out: List[List[str]] = []
    for word in words:
        if word.startswith("--") or not out:
            out.append([word])
        else:
            out[-1].append(word)
    return out


def optimizer_flags(name: str, default: Sequence[str] = DEFAULT_OPTIMIZER) -> List[str]:
    """The scheme's own optimizer flags, then every flag of ``default`` it does not set."""
    own = list(scheme(name).optimizer)
    given = {g[0] for g in _groups(own)}
    return own + [w for g in _groups(default) if g[0] not in given for w in g]


def train_flags(name: str, default: Sequence[str] = DEFAULT_OPTIMIZER) -> List[str]:
    """Everything a scheme adds to ``fairseq-train``: its model flags and its optimizer
    flags over ``default``."""
    return [*scheme(name).model, *optimizer_flags(name, default)]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fairseq_admin_pos.scheme_flags",
        description="Print a residual scheme's fairseq-train flags as shell words.")
    p.add_argument("name", nargs="?", help="the scheme (--list shows them)")
    p.add_argument("--part", choices=("all", "model", "optimizer", "lines"), default="all",
                   help="model flags, optimizer flags (over Adam's defaults), both on one line "
                   "(default), or both on two lines (model, then optimizer)")
    p.add_argument("--choices", default=None,
                   help="space-separated names the caller accepts (default: every scheme)")
    p.add_argument("--setting", default="scheme",
                   help="what the caller calls the name, for the error line (e.g. SCHEME)")
    p.add_argument("--list", action="store_true", help="list the schemes and stop")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        for name, s in TABLE.items():
            print(f"{name:<15} {s.summary}\n{'':<15} {' '.join(map(shlex.quote, s.flags))}")
        return 0
    choices = args.choices.split() if args.choices is not None else None
    try:
        if args.name is None:
            raise SchemeNameError(f"no {args.setting} given; valid choices: "
                                  f"{' '.join(choices or TABLE)}")
        s = scheme(args.name, choices, args.setting)
    except SchemeNameError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parts = {"model": [list(s.model)], "optimizer": [optimizer_flags(args.name)],
             "all": [train_flags(args.name)],
             "lines": [list(s.model), optimizer_flags(args.name)]}[args.part]
    for words in parts:
        print(" ".join(shlex.quote(w) for w in words))
    return 0


if __name__ == "__main__":
    sys.exit(main())
