"""``fairseq-admin-analyze``: omegas and output change at initialisation, and of a trained
checkpoint (``--checkpoint``).

A small CPU run of the real tool (subprocess, as a user runs it) must show the shape the
paper predicts: Post-LN's output change grows at least proportionally to depth, Admin's
clearly slower. The measurement itself is checked against an independent computation
(``torch.func.functional_call`` with separately perturbed weights) and the closed-form
omegas against the formula written out here. ``--checkpoint`` runs on a checkpoint that
``fairseq-train`` wrote; its numbers are recomputed from the checkpoint file and from the
initial model rebuilt with the training seed.
"""
import csv
import math
import tempfile
from collections import defaultdict

import pytest
import torch

from fairseq_cli_utils import TINY_MODEL, cos_by_matrix, load_model_state, run, train
from model_utils import build

from fairseq_admin_pos.cli import analyze

SMALL = ["--embed-dim", "16", "--ffn-dim", "32", "--heads", "2"]
DEPTHS = [1, 2, 4, 8]


def run_tool(args, check=True):
    proc = run("fairseq_admin_pos.cli.analyze", args, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stdout[-3000:] + proc.stderr[-3000:])
    return proc


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("analysis")
    proc = run_tool([*SMALL, "--depths", ",".join(map(str, DEPTHS)), "--seeds", "1,2,3",
                     "--trials", "2", "--out-dir", out])
    return out, proc.stdout


def mean_by_variant(out):
    acc = defaultdict(lambda: defaultdict(list))
    with open(out / "output_change.csv") as f:
        for row in csv.DictReader(f):
            acc[row["variant"]][int(row["encoder_layers"])].append(
                (float(row["encoder_change"]), float(row["decoder_change"])))
    return {v: {n: tuple(sum(x) / len(x) for x in zip(*rows)) for n, rows in by_n.items()}
            for v, by_n in acc.items()}


def test_post_ln_grows_with_depth_admin_clearly_slower(small_run):
    out, stdout = small_run
    m = mean_by_variant(out)
    assert set(m) == {"post-ln", "pre-ln", "admin", "admin-profile"}
    depth_ratio = DEPTHS[-1] / DEPTHS[0]
    growth = {v: m[v][DEPTHS[-1]][0] / m[v][DEPTHS[0]][0] for v in m}  # encoder output
    # Post-LN: at least proportional to depth (the paper: O(N))
    assert growth["post-ln"] >= depth_ratio, growth
    # Admin closed-form: clearly slower (O(log N)); profiled Admin and Pre-LN: slower
    assert growth["admin"] <= 0.5 * growth["post-ln"], growth
    assert growth["admin"] < depth_ratio, growth
    assert growth["admin-profile"] < growth["post-ln"], growth
    assert growth["pre-ln"] < growth["post-ln"], growth
    # at the largest depth Admin changes the output less than Post-LN (both outputs)
    for which in (0, 1):
        assert m["admin"][DEPTHS[-1]][which] < m["post-ln"][DEPTHS[-1]][which]
    # the printed table has the same growth figures
    for v in m:
        line = next(l for l in stdout.splitlines() if l.startswith(v) and "encoder" in l)
        assert f"{growth[v]:.2f}x" in line


def test_files_and_omegas(small_run):
    out, stdout = small_run
    png = (out / "output_change.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10000
    assert "wrote" in stdout and "growth" in stdout
    rows = list(csv.DictReader(open(out / "omegas.csv")))
    # one row per sub-layer: 2N encoder + 3N decoder, per variant, depth and seed
    assert len(rows) == 4 * 3 * sum(5 * n for n in DEPTHS)
    om = defaultdict(list)
    for r in rows:
        om[(r["variant"], int(r["encoder_layers"]), r["seed"], r["stack"])].append(float(r["omega"]))
    for n in DEPTHS:
        for stack, subl in (("encoder", 2 * n), ("decoder", 3 * n)):
            closed = math.sqrt((subl + 1) / math.log(subl + 1) - 1)  # admin-torch O(log N)
            assert om[("admin", n, "1", stack)] == pytest.approx([closed] * subl, abs=1e-6)
            assert om[("post-ln", n, "1", stack)] == [1.0] * subl
            assert om[("pre-ln", n, "1", stack)] == [1.0] * subl
            prof = om[("admin-profile", n, "2", stack)]
            assert len(prof) == subl and prof[0] == 1.0
            assert all(b > a for a, b in zip(prof, prof[1:]))


def _tiny_model(depth=2, variant="post-ln", seed=1, tmp=None):
    analyze._write_dicts(str(tmp), 50)
    size = ["--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim",
            "32", "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2",
            "--decoder-attention-heads", "2", "--encoder-layers", str(depth), "--decoder-layers",
            str(depth)]
    model, task = analyze.build_model(str(tmp), ("src", "tgt"),
                                      size + list(analyze.VARIANTS[variant].model_args), seed)
    return model, analyze.random_batch(task, 6, 9, seed)


def functional_change(model, n, eps, seed):
    """The output change recomputed independently of the tool: perturbed copies of the branch
    weights (attention and FFN weights and biases of every layer, drawn in parameter order),
    fed through ``torch.func.functional_call``. Returns ``(encoder, decoder, n_perturbed)``."""
    g = torch.Generator().manual_seed(seed)
    perturbed = {}
    for name, p in model.named_parameters():
        if ".layers." in name and "layer_norm" not in name and not name.endswith("omega"):
            rms = float(torch.sqrt(torch.mean(p.detach().double() ** 2)))
            perturbed[name] = p.detach() + eps * rms * torch.randn(p.shape, generator=g)

    def outputs(params):
        sub = lambda prefix: {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}
        with torch.no_grad():
            e = torch.func.functional_call(model.encoder, sub("encoder."), (n["src_tokens"],),
                                           {"src_lengths": n["src_lengths"]})
            d = torch.func.functional_call(model.decoder, sub("decoder."),
                                           (n["prev_output_tokens"],),
                                           {"encoder_out": e, "features_only": True})[0]
        return e["encoder_out"][0].transpose(0, 1), d

    e0, d0 = outputs({})
    e1, d1 = outputs(perturbed)
    ms = n["src_tokens"] != model.encoder.padding_idx
    mt = n["prev_output_tokens"] != model.decoder.padding_idx
    ref_enc = ((e1 - e0)[ms].double() ** 2).sum() / (e0[ms].double() ** 2).sum()
    ref_dec = ((d1 - d0)[mt].double() ** 2).sum() / (d0[mt].double() ** 2).sum()
    return float(ref_enc), float(ref_dec), len(perturbed)


@pytest.mark.parametrize("variant", ["post-ln", "admin", "b2t", "resi-dual",
                                     "peri-ln", "mix-ln-dyt", "post-ln-dyt"])
def test_output_change_matches_functional_recomputation(tmp_path, variant):
    model, n = _tiny_model(3, variant, tmp=tmp_path)
    before = {k: v.clone() for k, v in model.named_parameters()}
    eps, seed = 0.05, 11
    enc, dec = analyze.output_change(model, n, eps, 1, "branches", seed)
    # the weights are restored exactly
    assert all(torch.equal(before[k], v) for k, v in model.named_parameters())
    ref_enc, ref_dec, n_perturbed = functional_change(model, n, eps, seed)
    # per layer: (q, k, v, out) x (weight, bias) per attention + fc1/fc2 (weight, bias)
    assert n_perturbed == 3 * (8 + 4) + 3 * (16 + 4)
    assert enc == pytest.approx(ref_enc, rel=1e-4)
    assert dec == pytest.approx(ref_dec, rel=1e-4)
    assert enc > 0 and dec > 0


def test_output_change_is_quadratic_in_small_eps(tmp_path):
    model, n = _tiny_model(2, "post-ln", tmp=tmp_path)
    small = analyze.output_change(model, n, 1e-4, 2, "branches", 3)
    double = analyze.output_change(model, n, 2e-4, 2, "branches", 3)
    for a, b in zip(small, double):
        assert b / a == pytest.approx(4.0, rel=0.02)
    # perturbing every parameter (LayerNorms and embeddings too) changes the output more
    every = analyze.output_change(model, n, 1e-4, 2, "all", 3)
    assert every[0] > small[0]


def test_variants_registry_takes_new_entries(monkeypatch, tmp_path):
    monkeypatch.setitem(analyze.VARIANTS, "admin-o1", analyze.Variant(
        "Admin O(1)", ("--admin-init", "closed-form", "--admin-output-change-scale", "O(1)")))
    args = analyze.get_parser().parse_args(
        [*SMALL, "--depths", "1,2", "--variants", "admin-o1,post-ln", "--trials", "1",
         "--out-dir", str(tmp_path)])
    results = analyze.run_analysis(args)
    r = next(r for r in results if r.variant == "admin-o1" and r.encoder_layers == 2)
    assert r.omegas["encoder"] == pytest.approx([2.0] * 4)  # omega^2 = N = 4
    assert r.omegas["decoder"] == pytest.approx([math.sqrt(6)] * 6)


def test_random_token_mode_leaves_no_temporary_folder(monkeypatch, tmp_path):
    # its dictionaries are written to a temporary folder, which must go when the run ends
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    args = analyze.get_parser().parse_args(
        [*SMALL, "--depths", "1", "--variants", "post-ln", "--trials", "1",
         "--out-dir", str(tmp_path / "out")])
    assert len(analyze.run_analysis(args)) == 1
    assert list(scratch.iterdir()) == []


def test_admin_paper_profiles_as_transformer_clinic(tmp_path):
    """``admin-paper`` (the paper's Admin) is profiled on the analysis batch in Clinic's
    training mode, with the dropout masks of one step and the padding counted: each stack
    starts at 1 and grows, to other values than the dropout-free, padding-free profile of the
    same model and batch (``admin-profile``), and the caller's random stream is left as it
    was."""
    from model_utils import residuals

    tops = {}
    for name in ("admin-paper", "admin-profile"):
        model, n = _tiny_model(3, name, tmp=tmp_path)
        assert model.admin_profile.mode == ("clinic" if name == "admin-paper" else "eval")
        before = torch.random.get_rng_state()
        analyze.VARIANTS[name].prepare(model, n)
        assert torch.equal(torch.random.get_rng_state(), before)
        for stack in ("encoder", "decoder"):
            w = analyze.shortcut_weights(residuals(getattr(model, stack)))
            assert w[0] == 1.0 and all(b > a for a, b in zip(w, w[1:])), (name, w)
            tops[name, stack] = w[-1]
    for stack in ("encoder", "decoder"):
        assert abs(tops["admin-paper", stack] - tops["admin-profile", stack]) > 1e-3, tops


def test_batch_from_a_binarized_data_dir(tiny_data, tmp_path):
    proc = run_tool([*SMALL, "--depths", "1,2", "--variants", "post-ln,admin-profile",
                     "--data", tiny_data, "--subset", "valid", "--trials", "1", "--no-plot",
                     "--out-dir", tmp_path])
    rows = list(csv.DictReader(open(tmp_path / "output_change.csv")))
    assert len(rows) == 4 and all(float(r["encoder_change"]) > 0 for r in rows)
    assert not (tmp_path / "output_change.png").exists()
    assert "admin-profile" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--variants", "post-ln,bogus"], "valid choices: post-ln, pre-ln"),
    (["--depths", "2,0"], "--depths"),
    (["--embed-dim", "30", "--heads", "4"], "divisible by --heads"),
    (["--decoder-layers", "x"], "--decoder-layers"),
    (["--perturbation", "-1"], "--perturbation"),
])
def test_bad_arguments_name_the_flag(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        analyze.cli_main([*args, "--out-dir", str(tmp_path)])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "output_change.csv").exists()


# --------------------------------------------------------------------------------------- #
# --checkpoint: a model fairseq-train trained
# --------------------------------------------------------------------------------------- #
CKPT_MODEL = TINY_MODEL + ["--admin-omega", "parameter", "--encoder-pos-emb", "scaled-sinusoidal"]
TRAIN_SEED = 3  # fairseq_cli_utils.TRAIN_COMMON


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """3 Adam updates (lr 1e-3) of a 2L-2L model with trainable omegas, then the tool on it."""
    root = tmp_path_factory.mktemp("ckpt")
    train(tiny_data, root / "ck", "admin_transformer", CKPT_MODEL, max_update=3)
    ckpt = root / "ck" / "checkpoint_last.pt"
    proc = run_tool(["--checkpoint", ckpt, "--trials", "1", "--seeds", "1,2", "--batch-size", "6",
                     "--max-len", "9", "--perturbation", "0.05", "--out-dir", root / "out"])
    return ckpt, root / "out", proc.stdout


@pytest.mark.parametrize("which", ["initialisation", "checkpoint"])
def test_checkpoint_output_change_matches_recomputation(trained, tiny_data, which):
    ckpt, out, stdout = trained
    rows = [r for r in csv.DictReader(open(out / "checkpoint_output_change.csv"))
            if r["model"] == which]
    assert [int(r["seed"]) for r in rows] == [1, 2]
    # independently: the model built as fairseq-train builds it (its seed), with the
    # checkpoint's weights loaded for the trained one
    model, task, _ = build(tiny_data, "admin_transformer", CKPT_MODEL, seed=TRAIN_SEED)
    if which == "checkpoint":
        model.load_state_dict(load_model_state(ckpt))
    model.eval()
    for r in rows:
        seed = int(r["seed"])
        n = analyze.random_batch(task, 6, 9, seed)
        enc, dec, _ = functional_change(model, n, 0.05, 1000 * seed + 7)
        assert float(r["encoder_change"]) == pytest.approx(enc, rel=1e-4)
        assert float(r["decoder_change"]) == pytest.approx(dec, rel=1e-4)
    assert "checkpoint/init" in stdout and "3 updates (training seed 3)" in stdout


def test_checkpoint_weights_are_the_checkpoints(trained):
    ckpt, out, stdout = trained
    state = load_model_state(ckpt)
    rows = list(csv.DictReader(open(out / "checkpoint_weights.csv")))
    subl = {"self-attn": "self_attn", "enc-attn": "encoder_attn", "ffn": "final"}
    omegas = [r for r in rows if r["weight"] == "omega"]
    assert [(r["stack"], r["sublayer"]) for r in omegas] == (
        [("encoder", s) for _ in range(2) for s in ("self-attn", "ffn")]
        + [("decoder", s) for _ in range(2) for s in ("self-attn", "enc-attn", "ffn")])
    for r in omegas:
        w = state[f"{r['stack']}.layers.{r['layer']}.{subl[r['sublayer']]}_residual.omega"].double()
        assert w.numel() == 32
        for stat in ("mean", "min", "max"):
            assert float(r[stat]) == pytest.approx(getattr(w, stat)().item(), abs=1e-6)
        n_sub = 4 if r["stack"] == "encoder" else 6  # admin-torch closed form, O(log N)
        assert float(r["init"]) == pytest.approx(math.sqrt((n_sub + 1) / math.log(n_sub + 1) - 1),
                                                 abs=1e-6)
        assert float(r["min"]) < float(r["max"])  # trained: no longer one value
    (pos,) = [r for r in rows if r["weight"] == "pos_scale"]
    assert pos["stack"] == "encoder"
    assert float(pos["init"]) == pytest.approx(1 / math.sqrt(32), abs=1e-6)
    assert float(pos["mean"]) == pytest.approx(
        state["encoder.embed_positions.embed.scaling"].item(), abs=1e-6)
    assert "encoder      0  self-attn omega" in stdout


@pytest.mark.parametrize("which", ["initialisation", "checkpoint"])
def test_checkpoint_encoder_cos_matches_recomputation(trained, tiny_data, which):
    ckpt, out, stdout = trained
    rows = list(csv.DictReader(open(out / "checkpoint_encoder_cos.csv")))
    assert [r["stage"] for r in rows] == ["embedding", "layer 0", "layer 1", "output"]
    # independently: each layer's output caught by a hook, every pair of real tokens of the
    # first seed's batch compared
    model, task, _ = build(tiny_data, "admin_transformer", CKPT_MODEL, seed=TRAIN_SEED)
    if which == "checkpoint":
        model.load_state_dict(load_model_state(ckpt))
    model.eval()
    n = analyze.random_batch(task, 6, 9, 1)
    outs = []
    for layer in model.encoder.layers:
        layer.register_forward_hook(lambda _m, _i, o: outs.append(o.transpose(0, 1)))
    with torch.no_grad():
        emb, _ = model.encoder.forward_embedding(n["src_tokens"])
        final = model.encoder(n["src_tokens"], src_lengths=n["src_lengths"])
    keep = n["src_tokens"].ne(task.source_dictionary.pad())
    want = [cos_by_matrix(t[keep]) for t in
            [emb] + outs + [final["encoder_out"][0].transpose(0, 1)]]
    assert [float(r[which]) for r in rows] == pytest.approx(want, abs=1e-5)
    assert f"{which} {want[-1]:.3f}" in stdout


def test_checkpoint_init_model_is_the_one_training_started_from(trained, tiny_data):
    ckpt, _, _ = trained
    init_model, model, _, _, num_updates = analyze.load_checkpoint(str(ckpt))
    assert num_updates == 3
    state = load_model_state(ckpt)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items()
               if torch.is_tensor(v))
    # 3 Adam steps of lr 1e-3 move no weight by more than a few lr (Adam's step is about lr
    # per element); another initialisation differs by the weights' own size
    diffs = {k: (v - state[k]).abs().max().item() for k, v in init_model.state_dict().items()
             if torch.is_tensor(v) and v.is_floating_point()}
    assert max(diffs.values()) < 1e-2, max(diffs.items(), key=lambda kv: kv[1])
    assert max(diffs.values()) > 1e-4  # and training did move them
    other, _, _ = build(tiny_data, "admin_transformer", CKPT_MODEL, seed=TRAIN_SEED + 1)
    other_diff = other.encoder.embed_tokens.weight - state["encoder.embed_tokens.weight"]
    assert other_diff.abs().max() > 0.1


def _corrupt(ckpt, path, what):
    state = torch.load(ckpt, map_location="cpu")
    if what == "stock":
        state["cfg"]["model"].arch = state["cfg"]["model"]._name = "transformer"
    torch.save(state, path)


@pytest.mark.parametrize("case, message", [
    ("missing", "no such file"),
    ("garbage", "not a checkpoint torch.load can read"),
    ("stock", "holds a 'transformer' model; --checkpoint needs an admin_transformer"),
    ("model-flag", "--depths cannot be combined with --checkpoint"),
])
def test_checkpoint_errors_name_the_flag(trained, tmp_path, capsys, case, message):
    ckpt, _, _ = trained
    path = tmp_path / "ckpt.pt"
    extra = []
    if case == "garbage":
        path.write_bytes(b"not a checkpoint" * 10)
    elif case == "stock":
        _corrupt(ckpt, path, "stock")
    elif case == "model-flag":
        path, extra = ckpt, ["--depths", "2"]
    with pytest.raises(SystemExit) as e:
        analyze.cli_main(["--checkpoint", str(path), *extra, "--out-dir", str(tmp_path / "out")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--checkpoint" in err and message in err
    assert not (tmp_path / "out").exists()


def test_checkpoint_of_a_profiled_run(tiny_data, tmp_path, capsys):
    """--admin-init profile with fixed omegas: the checkpoint holds the omegas profiled on the
    first training batch; the fresh model is profiled on the analysis batch (first sub-layer
    1, then growing, as Admin's recurrence gives)."""
    train(tiny_data, tmp_path / "ck", "admin_transformer",
          TINY_MODEL + ["--admin-init", "profile", "--admin-omega", "buffer"], max_update=1)
    ckpt = tmp_path / "ck" / "checkpoint_last.pt"
    assert analyze.cli_main(["--checkpoint", str(ckpt), "--trials", "1",
                             "--out-dir", str(tmp_path / "out")]) == 0
    assert "--admin-init profile" in capsys.readouterr().out
    state = load_model_state(ckpt)
    rows = list(csv.DictReader(open(tmp_path / "out" / "checkpoint_weights.csv")))
    subl = {"self-attn": "self_attn", "enc-attn": "encoder_attn", "ffn": "final"}
    for stack in ("encoder", "decoder"):
        mine = [r for r in rows if r["stack"] == stack]
        init = [float(r["init"]) for r in mine]
        assert init[0] == 1.0 and all(b > a for a, b in zip(init, init[1:])), init
        for r in mine:  # fixed buffers: the checkpoint's profiled values
            w = state[f"{stack}.layers.{r['layer']}.{subl[r['sublayer']]}_residual.omega"]
            assert float(r["mean"]) == pytest.approx(w.item(), abs=1e-6)
            assert r["min"] == r["max"] == r["mean"]
        assert [float(r["mean"]) for r in mine] != [1.0] * len(mine)
