"""What the depth study runs: the residual schemes and position variants (their
``fairseq-train`` flags), the recipes, the predefined grids, and the key that names a run."""
from __future__ import annotations

import argparse
import sys

from .common import REPO

# this checkout's package (the one fairseq-train gets through --user-dir), also when another
# checkout is installed in the interpreter
sys.path.insert(0, str(REPO))
# the package's one table of scheme names (imports neither torch nor fairseq)
from fairseq_admin_pos.scheme_flags import TABLE  # noqa: E402

SCHEMES = {name: TABLE[name].flags
           for name in ("post-ln", "pre-ln", "admin", "admin-profile", "admin-paper",
                        "deepnorm")}
# the factorial of why the paper's Admin fails at 24L-3L: omega source {closed form, eval
# profile, Clinic profile} x optimizer {Adam, RAdam with Clinic's early steps}; admin, admin-profile and admin-paper are three of
# its six cells, these the other three
_RADAM = ["--optimizer", "radam", "--radam-early-steps", "skip"]
SCHEMES["admin-radam"] = SCHEMES["admin"] + _RADAM
SCHEMES["admin-profile-radam"] = SCHEMES["admin-profile"] + _RADAM
SCHEMES["admin-paper-adam"] = [f for f in SCHEMES["admin-paper"] if f not in _RADAM]
SCHEMES = {k: SCHEMES[k] for k in ("post-ln", "pre-ln", "admin", "admin-profile",
                                    "admin-paper", "deepnorm", "admin-radam",
                                    "admin-profile-radam", "admin-paper-adam")}

# position variants (both sides); "sinusoidal" is the default and leaves run keys unchanged
POSITIONS = {
    "sinusoidal": [],
    # fairseq's [sin | cos] table times a learnable scalar that starts at 1: at initialisation
    # the same model as "sinusoidal", so the row differs from it by the learnable scale alone
    "scaled-sinusoidal": [
        "--encoder-pos-emb", "scaled-sinusoidal", "--decoder-pos-emb", "scaled-sinusoidal",
        "--pos-emb-scaled-table", "fairseq", "--pos-emb-scale-init", "1",
    ],
    # the seed module as it is: the seed's own table, scale starting at 1/sqrt(d)
    "scaled-sinusoidal-seed": [
        "--encoder-pos-emb", "scaled-sinusoidal", "--decoder-pos-emb", "scaled-sinusoidal",
        "--pos-emb-scaled-table", "seed",
    ],
    "learned": ["--encoder-pos-emb", "learned", "--decoder-pos-emb", "learned"],
}

# recipes: the demo's (default) and the first, d=64 study's (rows kept in the docs)
PRESETS = {
    "demo": dict(embed_dim=128, ffn_dim=512, heads=4, lr=2e-3, warmup=400, max_tokens=4096,
                 max_update=700),
    "d64": dict(embed_dim=64, ffn_dim=256, heads=4, lr=2e-3, warmup=100, max_tokens=4096,
                max_update=200),
}

# the grid of the demo-scale study, most informative runs first: a run that is not reached
# before the machine is taken away costs the least
_ALL5 = ("post-ln", "admin", "pre-ln", "deepnorm", "admin-paper")
_DEEP_ENC = "24L-3L"
PLANS = {
    "demo-scale": (
        [(s, "12L-12L", 1, "sinusoidal") for s in _ALL5]
        # the shallow reference next: half the cost of a 12L-12L run, and it answers "is
        # deep Admin better than shallow Admin" for seed 1
        + [(s, "6L-6L", 1, "sinusoidal") for s in ("admin", "pre-ln", "post-ln", "deepnorm",
                                                   "admin-paper")]
        + [("admin", "12L-3L", 1, p) for p in ("sinusoidal", "scaled-sinusoidal", "learned")]
        + [("admin", "12L-3L", 2, p) for p in ("sinusoidal", "scaled-sinusoidal", "learned")]
        + [("admin", "12L-3L", seed, "scaled-sinusoidal-seed") for seed in (1, 2)]
        # then the two claims in turn, Admin and Pre-LN first: the deep encoder, the spread
        # of the 12L-12L headline, the other schemes; a second seed of each before a third
        + [(s, _DEEP_ENC, 1, "sinusoidal") for s in ("admin", "pre-ln")]
        + [(s, "12L-12L", 2, "sinusoidal") for s in ("post-ln", "admin", "pre-ln")]
        + [(s, _DEEP_ENC, 1, "sinusoidal") for s in ("post-ln", "deepnorm", "admin-paper")]
        + [("deepnorm", "12L-12L", 2, "sinusoidal")]
        # the three seeds the claims rest on (Admin vs Pre-LN at 12L-12L and the deep
        # encoder) before the rows that only tighten a verdict already seen
        + [(s, _DEEP_ENC, 2, "sinusoidal") for s in ("admin", "pre-ln")]
        + [(s, "12L-12L", 3, "sinusoidal") for s in ("admin", "pre-ln")]
        + [(s, _DEEP_ENC, 3, "sinusoidal") for s in ("admin", "pre-ln")]
        + [("admin-paper", "12L-12L", 2, "sinusoidal")]
        + [(s, "12L-12L", 3, "sinusoidal") for s in ("post-ln", "deepnorm", "admin-paper")]
        + [("admin-paper", _DEEP_ENC, seed, "sinusoidal") for seed in (2, 3)]
    ),
}

# --quick: the d=64 study's headline pair (7 minutes on two cores), so its rows are that grid's
QUICK = dict(schemes="post-ln,admin", depths="12L-12L", preset="d64")


def run_key(scheme, depth, seed, args, positions: str = "sinusoidal") -> str:
    key = (f"{scheme}|{depth}|seed{seed}|{args.max_update}upd|d{args.embed_dim}"
           f"|lr{args.lr:g}|wu{args.warmup}|mt{args.max_tokens}")
    # written only when not the default, so the keys of earlier rows stay valid
    if args.dropout != 0.1:
        key += f"|do{args.dropout:g}"
    if args.vocab != 8000:
        key += f"|v{args.vocab}"
    if args.clip_norm:
        key += f"|clip{args.clip_norm:g}"
    # a fixed validation (and checkpoint) interval picks checkpoint_best among other updates
    if getattr(args, "validate_every", 0):
        key += f"|ve{args.validate_every}"
    return key if positions == "sinusoidal" else f"{key}|pos-{positions}"


def study_name(args) -> str:
    return f"d{args.embed_dim}-{args.max_update}upd"


def item_args(args, item):
    """The study's arguments for one grid item. An item is ``(scheme, depth, seed,
    positions)`` or, in a plan that trains runs of two lengths, ``(..., updates)``: that item
    trains for its own number of updates (the same recipe otherwise)."""
    if len(item) < 5 or item[4] == args.max_update:
        return args
    return argparse.Namespace(**{**vars(args), "max_update": item[4]})


def item_key(item, args) -> str:
    """The CSV key of a grid item (see :func:`item_args`)."""
    return run_key(*item[:3], item_args(args, item), item[3])


# --------------------------------------------------------------------------- omega variants
#: which of the paper's omegas matter. Each variant trains admin-paper (Clinic
#: profile, omega vectors, RAdam) from omegas that are the run's own Clinic profile (measured
#: for the same depth and seed, so the same as admin-paper's), changed per stack by the rule
#: below, and read through ``--admin-profile-path`` (see ``depthstudy.omegas``). "closed" is
#: admin-torch's O(logn) closed form of that stack (the ``admin`` scheme's value), "profile"
#: the measured omegas (1 at the bottom, growing with depth).
OMEGA_VARIANTS = {
    # every sub-layer at least the closed form: the profile's small bottom omegas removed
    "admin-paper-floor": "profile floored at the closed form, both stacks",
    # the bottom quarter of each stack's sub-layers at the closed form, the profile above
    "admin-paper-closed-bottom": "closed form on the bottom quarter of each stack, profile above",
    # the profile's largest omega on every sub-layer of the stack (its shape removed)
    "admin-paper-max": "the profile's largest omega on every sub-layer of each stack",
    # one stack profiled, the other at the closed form
    "admin-paper-enc": "profile in the encoder, closed form in the decoder",
    "admin-paper-dec": "closed form in the encoder, profile in the decoder",
}
for _name in OMEGA_VARIANTS:
    SCHEMES[_name] = list(SCHEMES["admin-paper"])


# --------------------------------------------------------------------------- the rivals
#: the later rivals of Admin, same recipe (fairseq_admin_pos.schemes)
SCHEMES["b2t"] = TABLE["b2t"].flags
SCHEMES["resi-dual"] = TABLE["resi-dual"].flags

_FACTORIAL = ("admin-paper-adam", "admin-radam", "admin-profile", "admin-profile-radam")
PLANS["admin-causes"] = (
    # seed 1 of what is not yet known at the deep encoder: the eval profile with
    # either optimizer, then which omegas matter (admin-paper's profile changed per variant)
    [(s, _DEEP_ENC, 1, "sinusoidal") for s in ("admin-profile", "admin-profile-radam")]
    # (at 24L-3L seed 1 the Clinic profile is below the closed form on 47 of 48 encoder and 8
    # of 9 decoder sub-layers and tops out at it, so floor and max are both close to the
    # closed form: max comes last)
    # (enc and dec first: they split the question by stack before closed-bottom splits it by
    # height)
    + [(s, _DEEP_ENC, 1, "sinusoidal") for s in ("admin-paper-floor", "admin-paper-enc",
                                                 "admin-paper-dec",
                                                 "admin-paper-closed-bottom",
                                                 "admin-paper-max")]
    # the seeds of the factorial (Clinic profile + Adam and closed form + RAdam: the
    # numbers stand for seed 1 until their rows are run at the end)
    + [(s, _DEEP_ENC, seed, "sinusoidal") for seed in (2, 3) for s in _FACTORIAL]
    # 12L-12L, where admin-paper trails the closed form: the optimizer swapped both ways
    + [(s, "12L-12L", seed, "sinusoidal") for seed in (1, 2, 3)
       for s in ("admin-paper-adam", "admin-radam")]
    + [(s, _DEEP_ENC, 2, "sinusoidal") for s in OMEGA_VARIANTS]
    + [(s, _DEEP_ENC, 1, "sinusoidal") for s in ("admin-paper-adam", "admin-radam")]
)
#: the schedule factor: the same models at Transformer-Clinic's WMT14 peak lr
PLANS["admin-schedule"] = [(s, _DEEP_ENC, seed, "sinusoidal") for seed in (1, 2)
                           for s in ("admin-paper", "admin")]
PLANS["rivals"] = (
    # the deep encoder first, then the 6L-6L column (one seed, half the time of a
    # 12L-12L run), then 12L-12L
    [(s, _DEEP_ENC, 1, "sinusoidal") for s in ("b2t", "resi-dual")]
    + [(s, "6L-6L", 1, "sinusoidal") for s in ("b2t", "resi-dual")]
    + [(s, "12L-12L", 1, "sinusoidal") for s in ("b2t", "resi-dual")]
    + [(s, d, seed, "sinusoidal") for seed in (2, 3) for d in (_DEEP_ENC, "12L-12L")
       for s in ("b2t", "resi-dual")]
)
#: a plan's own recipe, over the preset's (an explicit flag still wins)
PLAN_RECIPES = {"admin-schedule": dict(lr=1e-3)}
#: the longer warmup: the same pair at lr 1e-3 with 2000 warmup updates (five times the
#: demo's; the papers use 8000 at 4.5M pairs) and 400 updates after it (the demo has 300), so
#: a failure that starts when the warmup ends has room to show; about 2.5 h per run here
PLANS["admin-warmup"] = list(PLANS["admin-schedule"])
PLAN_RECIPES["admin-warmup"] = dict(lr=1e-3, warmup=2000, max_update=2400)

# --------------------------------------------------------------------------- deep-shallow
#: the encoder/decoder allocation at the demo recipe (Kasai et al. 2021, "Deep
#: Encoder, Shallow Decoder"). Cells 6-6, 12-3 (the demo), 12-1, 24-1, 48-1 for the four
#: schemes whose stability is in question; most informative runs first: seed 1 of every
#: 1-layer-decoder cell, then the 12-3 references, then the seeds, the 48-1 cells (three
#: demo runs each) last.
_DS_SCHEMES = ("admin", "post-ln", "pre-ln", "admin-paper")
_DS_SHAPES = ("6L-6L", "12L-3L", "12L-1L", "24L-1L", "48L-1L")
PLANS["deep-shallow"] = (
    [(s, "12L-1L", 1, "sinusoidal") for s in _DS_SCHEMES]
    + [(s, "24L-1L", 1, "sinusoidal") for s in _DS_SCHEMES]
    + [(s, "12L-3L", 1, "sinusoidal") for s in _DS_SCHEMES]
    + [(s, d, 2, "sinusoidal") for d in ("12L-1L", "24L-1L", "12L-3L") for s in _DS_SCHEMES]
    + [(s, "48L-1L", 1, "sinusoidal") for s in _DS_SCHEMES]
    + [(s, d, 3, "sinusoidal") for d in ("12L-1L", "24L-1L", "12L-3L") for s in _DS_SCHEMES]
    + [(s, "6L-6L", seed, "sinusoidal") for seed in (1, 2, 3) for s in _DS_SCHEMES]
    + [(s, "48L-1L", seed, "sinusoidal") for seed in (2, 3) for s in _DS_SCHEMES]
)
#: the paper's Admin at the longer warmup, where it trains at 24L-3L (lr 1e-3, 2000 warmup
#: updates, 2400 updates) in the 1-layer-decoder cells, with the closed form beside it: is the
#: reported shallow-decoder divergence the short-warmup cause or another one. Stock Post-LN
#: at 12L-1L beside them: it fails at the demo recipe (also at lr 1e-3 and 5e-4) where Kasai et
#: al. trained it with 10x the warmup, so this recipe asks whether the warmup is the cause.
PLANS["deep-shallow-warmup"] = (
    [(s, "12L-1L", 1, "sinusoidal") for s in ("admin-paper", "admin", "post-ln")]
    + [(s, "24L-1L", 1, "sinusoidal") for s in ("admin-paper", "admin")])
PLAN_RECIPES["deep-shallow-warmup"] = dict(lr=1e-3, warmup=2000, max_update=2400)

# --------------------------------------------------------------------------- norms 2025
#: the LayerNorm placements Peri-LN and Mix-LN (fairseq_admin_pos.placements) and
#: DyT in place of LayerNorm (fairseq_admin_pos.norms) in Post-LN, Pre-LN, Peri-LN and Mix-LN.
#: Admin's omegas are refused with DyT (they give back what a LayerNorm divides out), so
#: there is no admin-dyt.
for _name in ("peri-ln", "mix-ln", "pre-ln-dyt", "post-ln-dyt", "peri-ln-dyt", "mix-ln-dyt"):
    SCHEMES[_name] = TABLE[_name].flags
#: the grid: the three new schemes, DyT in the placement its paper uses (Pre-LN); the
#: two placements with LayerNorm first (the papers' claims)
_NORMS = ("peri-ln", "mix-ln", "pre-ln-dyt")
PLANS["norms-2025"] = (
    # seed 1 of every scheme at the deep encoder, then at 12L-12L
    [(s, d, 1, "sinusoidal") for d in (_DEEP_ENC, "12L-12L") for s in _NORMS]
    # then seeds 2 and 3, a second seed of everything before a third
    + [(s, d, seed, "sinusoidal") for seed in (2, 3) for d in (_DEEP_ENC, "12L-12L")
       for s in _NORMS]
    # the LayerNorm baselines of the same cells last: demo-scale's rows where they exist (a
    # row already in results.csv is not run again), post-ln's deep-encoder seeds 2 and 3 new
    + [(s, d, seed, "sinusoidal") for seed in (1, 2, 3) for d in (_DEEP_ENC, "12L-12L")
       for s in ("pre-ln", "post-ln")]
)
#: beyond that grid: DyT in the other placements it can take (the new ones, then
#: Post-LN, expected to fail where Post-LN fails); published in the same block
PLANS["norms-2025-dyt"] = (
    [(s, d, seed, "sinusoidal") for seed in (1, 2, 3) for d in (_DEEP_ENC, "12L-12L")
     for s in ("peri-ln-dyt", "mix-ln-dyt", "post-ln-dyt")]
)

# --------------------------------------------------------------------------- converged
#: The depth table at a converged schedule (Liu et al. 2020's 6L/12L/18L; Kasai et al. 2021's
#: 12-1 against 6-6; the 48L-1L collapse). The recipe is the demo's model and data with the
#: package's long schedule: Adam (0.9, 0.98), peak lr 1e-3, inverse_sqrt after 2000 warmup
#: updates. Validation (and a checkpoint) every 200 updates: a run stopped with its session
#: resumes from a checkpoint at most 200 updates old, and the curves tell over-fitting from
#: under-training. Checkpoints are kept: a longer run continues the shorter one, and the
#: deployed speed is timed on the model whose BLEU is quoted.
CONVERGED_RECIPE = dict(lr=1e-3, warmup=2000, max_update=2400, validate_every=200,
                        keep_checkpoints=True)
#: the length of the grid, set by the convergence check (docs/depth_converged.md)
CONVERGED_UPDATES = 4800
#: the convergence check first: Admin 6L-6L and 18L-18L seed 1 at the schedule's length and
#: at twice it (the longer run continues the shorter one's checkpoint: one run, two rows)
#: (6L-6L's longer run before 18L-18L's shorter one: one job trains 6L-6L to its end first;
#: with two jobs the longer run waits for its shorter one and the other job takes 18L-18L)
_CHECK = [("admin", d, 1, "sinusoidal", n) for d in ("6L-6L", "18L-18L") for n in (2400, 4800)]
#: then, most informative first: Admin's deep-shallow shapes, Pre-LN, Post-LN; every cell's
#: first seed before any second. At a length above the first, 12L-12L is Admin's alone.
CONVERGED_LONG = CONVERGED_UPDATES > CONVERGED_RECIPE["max_update"]
_SHARED_12 = () if CONVERGED_LONG else ("12L-12L",)
#: Post-LN 18L-18L: where 12L-12L is shared it runs last, both seeds, and is skipped if Post-LN
#: 12L-12L failed with both (``converged.skipped``); where 12L-12L is Admin's alone it is
#: always run, so it is a cell like the others (its first seed before any second seed)
POST_LN_DEEP = ("post-ln", "18L-18L")
_CONVERGED_CELLS = (
    [("admin", d) for d in ("6L-6L", "18L-18L", "12L-1L", "48L-1L", "12L-12L")]
    + [("pre-ln", d) for d in ("6L-6L", "18L-18L", "12L-1L", "48L-1L") + _SHARED_12]
    + [("post-ln", d) for d in ("6L-6L",) + (("18L-18L",) if CONVERGED_LONG else _SHARED_12)]
)
#: each cell trains to the schedule's first length, then (where the check set a longer one)
#: continues that run: a session that ends between the two still leaves a recorded row
CONVERGED_LENGTHS = tuple(dict.fromkeys((CONVERGED_RECIPE["max_update"],
                                          CONVERGED_UPDATES)))
PLANS["converged"] = list(dict.fromkeys(
    _CHECK + [(s, d, seed, "sinusoidal", n) for seed in (1, 2)
              for s, d in _CONVERGED_CELLS for n in CONVERGED_LENGTHS]
    + ([] if CONVERGED_LONG else [(*POST_LN_DEEP, seed, "sinusoidal", n) for seed in (1, 2)
                                  for n in CONVERGED_LENGTHS])))
PLAN_RECIPES["converged"] = dict(CONVERGED_RECIPE, max_update=CONVERGED_UPDATES)

# --------------------------------------------------------------------------- omega form
#: The closed-form Admin with omega a fixed scalar (``--admin-omega buffer``) against the
#: trainable vector (``admin``) at the demo recipe, in the cells where ``admin``'s rows have
#: three seeds: which form the package's default is.
SCHEMES["admin-buffer"] = ["--admin-init", "closed-form", "--admin-omega", "buffer"]
PLANS["omega-form"] = [(s, d, seed, "sinusoidal") for seed in (1, 2, 3)
                       for d in ("12L-3L", "24L-3L") for s in ("admin-buffer",)]
