"""The cause-finding parts of benchmarks/depth_study.py on a tiny corpus: the factorial cells, the
omega variants (each run's logged omegas against the rule applied to admin-paper's own
profile), and every new column recomputed independently: the probe's validation nll against
fairseq's, the other-source nll against fairseq-validate on a rotated validation set, the
final omegas against the checkpoint, the gradient norms against the log."""
import json
import math
import re

import pytest

from fairseq_cli_utils import cos_by_matrix, load_model_state, run, write_fake_multi30k
from study_utils import TINY, load_study_module, schedule_row, study

DEPTH = ["--depths", "2L-2L"]  # the decoder needs 4+ sub-layers for a "bottom quarter"
VARIANTS = ("admin-paper-floor", "admin-paper-closed-bottom", "admin-paper-max",
            "admin-paper-enc", "admin-paper-dec")
TRAINED_VARIANTS = ("admin-paper-closed-bottom",)  # the file route, both stacks changed

# the module fixture runs the study end to end: the file goes to a worker first (conftest.py)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def module():
    return load_study_module()


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("causes")
    write_fake_multi30k(tmp / "m30k")
    out = tmp / "out"
    study("--data", tmp / "m30k", "--out", out, "--schemes",
          ",".join(("admin-paper",) + TRAINED_VARIANTS), "--seeds", "1",
          *TINY, *DEPTH, "--keep-checkpoints")
    # as the study reads them: commands relative to the repository (the newest row of the
    # file itself is written as it ran)
    rows = {r["scheme"]: r for r in load_study_module().read_rows(out / "results.csv")}
    return dict(out=out, rows=rows)


def run_dir(grid, scheme):
    return grid["out"] / "runs" / re.sub(r"[^A-Za-z0-9_.-]+", "_", grid["rows"][scheme]["key"])


def logged_omegas(grid, scheme):
    """The omegas the run's model started from, as the package logs them."""
    text = (run_dir(grid, scheme) / "train.log").read_text()
    return {m.group(1): [float(x) for x in m.group(2).split()]
            for m in re.finditer(r"admin profile: (encoder|decoder) omegas ([0-9. ]+)", text)}


RADAM = ["--optimizer", "radam", "--radam-early-steps", "skip"]


@pytest.mark.parametrize("adam,radam", [("admin", "admin-radam"),
                                        ("admin-profile", "admin-profile-radam"),
                                        ("admin-paper-adam", "admin-paper")])
def test_factorial_cells_differ_in_the_optimizer_only(module, adam, radam):
    assert module.SCHEMES[radam] == module.SCHEMES[adam] + RADAM
    assert "--optimizer" not in module.SCHEMES[adam]


@pytest.mark.parametrize("scheme,init,mode", [
    ("admin", "closed-form", None), ("admin-profile", "profile", "eval"),
    ("admin-paper-adam", "profile", "clinic")])
def test_factorial_cells_differ_in_the_omega_source(module, scheme, init, mode):
    flags = module.SCHEMES[scheme]
    assert flags[flags.index("--admin-init") + 1] == init
    assert (flags[flags.index("--admin-profile-mode") + 1] if mode else None) == mode
    assert flags[flags.index("--admin-omega") + 1] == "parameter"


def closed(n):
    return math.sqrt((n + 1) / math.log(n + 1) - 1)  # admin-torch's O(logn), N sub-layers


def expected_variant(variant, profile):
    out = {}
    for stack, v in profile.items():
        c, n = closed(len(v)), len(v)
        out[stack] = {
            "admin-paper-floor": [max(x, c) for x in v],
            "admin-paper-closed-bottom": [c] * (n // 4) + v[n // 4:],
            "admin-paper-max": [max(v)] * n,
            "admin-paper-enc": v if stack == "encoder" else [c] * n,
            "admin-paper-dec": v if stack == "decoder" else [c] * n,
        }[variant]
    return out


# closed form: N=8 (encoder) sqrt(9/ln 9 - 1) = 1.7596, N=6 (decoder) sqrt(7/ln 7 - 1) = 1.6116
PROFILE = {"encoder": [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5],
           "decoder": [1.0, 0.9, 1.2, 1.7, 1.1, 1.65]}
C8, C6 = 1.7596, 1.6116


@pytest.mark.parametrize("variant,want", [
    ("admin-paper-floor", {"encoder": [C8, C8, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5],
                           "decoder": [C6, C6, C6, 1.7, C6, 1.65]}),
    ("admin-paper-closed-bottom", {"encoder": [C8, C8, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5],
                                   "decoder": [C6, 0.9, 1.2, 1.7, 1.1, 1.65]}),
    ("admin-paper-max", {"encoder": [4.5] * 8, "decoder": [1.7] * 6}),
    ("admin-paper-enc", {"encoder": PROFILE["encoder"], "decoder": [C6] * 6}),
    ("admin-paper-dec", {"encoder": [C8] * 8, "decoder": PROFILE["decoder"]}),
])
def test_variant_rule(module, variant, want):
    got = module.variant_omegas(variant, PROFILE)
    assert got == {s: pytest.approx(v, abs=1e-4) for s, v in want.items()}


def test_unknown_variant_is_an_error(module):
    with pytest.raises(ValueError, match="unknown omega variant 'admin-paper-top'"):
        module.variant_omegas("admin-paper-top", {"encoder": [1.0]})


@pytest.mark.parametrize("variant", TRAINED_VARIANTS)
def test_variant_starts_from_its_rule_applied_to_admin_papers_profile(grid, variant):
    profile = logged_omegas(grid, "admin-paper")
    assert len(profile["encoder"]) == 4 and len(profile["decoder"]) == 6
    assert profile["encoder"][0] == 1.0 and profile["encoder"][-1] > 1.1  # a real profile
    got = logged_omegas(grid, variant)
    want = expected_variant(variant, profile)
    for stack in ("encoder", "decoder"):
        assert got[stack] == pytest.approx(want[stack], abs=2e-4), stack
    assert json.loads(grid["rows"][variant]["init_omegas"]) == pytest.approx(
        {s: pytest.approx(v, abs=2e-4) for s, v in want.items()})


@pytest.mark.parametrize("variant", TRAINED_VARIANTS)
def test_variant_trains_admin_papers_recipe(grid, variant):
    paper = grid["rows"]["admin-paper"]["train_command"]
    command = grid["rows"][variant]["train_command"]
    assert command.startswith(paper.split(" --save-dir ")[0] + " --save-dir ")
    assert command.endswith(f"--admin-profile-path OUT/runs/{variant}_2L-2L_seed1_4upd_d16_"
                            "lr0.002_wu2_mt600_v60_ve2/omegas.json")


@pytest.mark.parametrize("enc,dec", [(24, 3), (12, 12)])
def test_init_omegas_of_the_closed_form_are_the_packages(module, enc, dec):
    from fairseq_admin_pos.admin import calculate_init  # admin-torch's API, the model's value

    got = module.init_omegas(module.SCHEMES["admin"], "", enc, dec)
    assert got == {"encoder": [round(calculate_init(2 * enc), 4)] * (2 * enc),
                   "decoder": [round(calculate_init(3 * dec), 4)] * (3 * dec)}


def test_init_omegas_of_post_ln_are_not_recorded(module):
    assert module.init_omegas(module.SCHEMES["post-ln"], "", 2, 2) == {}


@pytest.mark.parametrize("extra,missing", [([], 3), (["--lr=0.0007"], 4)])
def test_a_plans_recipe_sets_the_lr_and_an_explicit_flag_wins(module, tmp_path, extra, missing):
    # one admin-schedule run done at its lr 1e-3: with the plan's lr 3 of 4 runs are missing,
    # with another lr given on the command line all 4 are
    module.append_row(tmp_path / "results.csv", schedule_row("admin-paper", 1, 700, "0.001", 400))
    proc = study("--out", tmp_path, "--report-only", "--plan", "admin-schedule", *extra)
    assert f"Still missing from the plan ({missing} runs)" in proc.stdout
    assert "| 24L-3L | sinusoidal | admin-paper (lr 0.001, warmup 400) | 1 |" in proc.stdout


def test_the_warmup_plan_sets_lr_warmup_and_updates_and_labels_its_rows(module, tmp_path):
    # one admin-warmup run done: its key has the plan's lr, warmup and updates, so 3 of 4 runs
    # are missing; its schedule is not the demo's (the same model size), so the label names it
    module.append_row(tmp_path / "results.csv", schedule_row("admin", 2, 2400, "0.001", 2000))
    proc = study("--out", tmp_path, "--report-only", "--plan", "admin-warmup")
    assert "Still missing from the plan (3 runs): admin-paper 24L-3L seed 1, admin 24L-3L " \
           "seed 1, admin-paper 24L-3L seed 2." in proc.stdout
    assert "| 24L-3L | sinusoidal | admin (lr 0.001, warmup 2000) | 2 |" in proc.stdout


@pytest.mark.parametrize("scheme", ["admin-paper", "admin-paper-closed-bottom"])
def test_probe_valid_nll_is_fairseqs_best_valid_nll(grid, scheme):
    r = grid["rows"][scheme]
    assert float(r["probe_valid_nll"]) == pytest.approx(float(r["best_valid_nll"]), abs=6e-4)
    assert float(r["source_gain"]) == pytest.approx(
        float(r["valid_nll_other_source"]) - float(r["probe_valid_nll"]), abs=2e-4)


def test_other_source_nll_is_fairseq_validate_on_rotated_sources(grid, tmp_path):
    data = grid["out"] / "data"
    src = (data / "spm" / "valid.en").read_text().splitlines()
    (tmp_path / "valid.en").write_text("\n".join(src[1:] + src[:1]) + "\n")  # i gets i+1's
    (tmp_path / "valid.de").write_text((data / "spm" / "valid.de").read_text())
    dest = tmp_path / "bin"
    run("fairseq_cli.preprocess", [
        "--source-lang", "en", "--target-lang", "de", "--validpref", tmp_path / "valid",
        "--destdir", dest, "--srcdict", data / "bin" / "dict.en.txt",
        "--tgtdict", data / "bin" / "dict.de.txt", "--workers", "1"])
    ckpt = run_dir(grid, "admin-paper") / "ckpt" / "checkpoint_best.pt"
    proc = run("fairseq_cli.validate", [
        dest, "--task", "translation", "--user-dir", "fairseq_admin_pos", "--path", ckpt, "--cpu",
        "--valid-subset", "valid", "--max-tokens", "4000", "--num-workers", "0",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"])
    nll = float(re.search(r"nll_loss ([0-9.]+)", proc.stdout + proc.stderr).group(1))
    assert float(grid["rows"]["admin-paper"]["valid_nll_other_source"]) == pytest.approx(nll,
                                                                                   abs=6e-4)


@pytest.mark.parametrize("scheme", ["admin-paper", "admin-paper-closed-bottom"])
def test_final_omegas_are_the_last_checkpoints(grid, scheme):
    state = load_model_state(run_dir(grid, scheme) / "ckpt" / "checkpoint_last.pt")
    want = {}
    for stack, names, layers in (("encoder", ("self_attn", "final"), 2),
                                 ("decoder", ("self_attn", "encoder_attn", "final"), 2)):
        want[stack] = [state[f"{stack}.layers.{i}.{n}_residual.omega"].double().mean().item()
                       for i in range(layers) for n in names]
    got = json.loads(grid["rows"][scheme]["final_omegas"])
    assert got == {s: pytest.approx(v, abs=1e-4) for s, v in want.items()}


def test_gradient_norms_are_the_logged_means(grid):
    r = grid["rows"]["admin-paper"]
    lines = [json.loads(line.split("| train_inner | ", 1)[1])
             for line in (run_dir(grid, "admin-paper") / "train.log").read_text().splitlines()
             if "| train_inner | {" in line]
    warmup = int(r["warmup"])
    got = json.loads(r["gnorms"])
    for key in ("enc_gnorm", "dec_gnorm", "emb_gnorm"):
        early = [float(x[key]) for x in lines if int(x["num_updates"]) <= warmup]
        late = [float(x[key]) for x in lines if int(x["num_updates"]) > warmup]
        assert got[key] == pytest.approx([sum(early) / len(early), sum(late) / len(late)],
                                         abs=1e-3)


def test_a_run_claimed_by_one_study_process_is_passed_over_by_another(module, tmp_path):
    with module.claim(tmp_path, "admin|24L-3L|seed1") as first:
        with module.claim(tmp_path, "admin|24L-3L|seed1") as second:
            assert (first, second) == (True, False)
        with module.claim(tmp_path, "admin|24L-3L|seed2") as other:
            assert other
    with module.claim(tmp_path, "admin|24L-3L|seed1") as again:  # released with the run
        assert again


@pytest.mark.parametrize("scheme", ["admin-paper", "admin-paper-closed-bottom"])
def test_encoder_cos_is_the_pairwise_cosine_of_the_checkpoints_encoder(grid, scheme):
    from argparse import Namespace

    import torch
    from fairseq import checkpoint_utils, utils

    utils.import_user_module(Namespace(user_dir="fairseq_admin_pos"))
    ckpt = run_dir(grid, scheme) / "ckpt" / "checkpoint_best.pt"
    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(ckpt)], arg_overrides={"data": str(grid["out"] / "data" / "bin")})
    model = models[0].eval()
    task.load_dataset("valid")
    ds = task.dataset("valid")
    batch = ds.collater([ds[i] for i in range(len(ds))])["net_input"]
    outs = []  # each layer's output, caught by hooks rather than return_all_hiddens
    for layer in model.encoder.layers:
        layer.register_forward_hook(lambda _m, _i, out: outs.append(out))
    with torch.no_grad():
        emb, _ = model.encoder.forward_embedding(batch["src_tokens"])
        final = model.encoder(batch["src_tokens"], src_lengths=batch["src_lengths"])
    keep = batch["src_tokens"].ne(task.source_dictionary.pad())  # (B, T)
    want = [cos_by_matrix(emb[keep])] + [
        cos_by_matrix(o.transpose(0, 1)[keep]) for o in outs]
    row = grid["rows"][scheme]
    assert json.loads(row["encoder_cos_layers"]) == pytest.approx(want, abs=1e-3)
    assert float(row["encoder_cos"]) == pytest.approx(
        cos_by_matrix(final["encoder_out"][0].transpose(0, 1)[keep]), abs=1e-4)
    assert -1.0 <= float(row["encoder_cos_init"]) <= 1.0


def test_backfill_fills_the_encoder_columns_of_a_row_without_them(grid, module, tmp_path):
    import shutil

    from depthstudy.report import write_rows  # on the path since the study module loaded

    out = tmp_path / "out"
    shutil.copytree(grid["out"], out)
    rows = module.read_rows(out / "results.csv")
    want = {r["key"]: (r["encoder_cos"], r["encoder_cos_layers"]) for r in rows}
    assert all(v[0] for v in want.values())
    for r in rows:
        r.update(encoder_cos="", encoder_cos_init="", encoder_cos_layers="")
    write_rows(out / "results.csv", rows)
    proc = study("--out", out, "--report-only")
    assert "encoder-collapse columns filled" in proc.stdout + proc.stderr
    got = {r["key"]: (r["encoder_cos"], r["encoder_cos_layers"])
           for r in module.read_rows(out / "results.csv")}
    assert got == want
