"""benchmarks/depth_study.py end to end on a tiny Multi30k-shaped corpus: every number of a
row recomputed from the run's own files, the summary's mean +- std, publishing, and a second
call that finds the grid done."""
import csv
import json
import math
import re
import shutil
import statistics
from collections import Counter
from pathlib import Path

import pytest
import sacrebleu

from fairseq_cli_utils import REPO, write_fake_multi30k
from study_utils import TINY, load_study_module, study

# the module fixture runs the study end to end: the file goes to a worker first (conftest.py)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """post-ln and admin, seeds 1 and 2, published into a docs folder of its own."""
    tmp = tmp_path_factory.mktemp("depth_study")
    write_fake_multi30k(tmp / "m30k")
    docs = tmp / "docs"
    docs.mkdir()
    (docs / "results.md").write_text("# page\n\nbefore\n\n<!-- depth_study table: start -->\n"
                                     "old table\n<!-- depth_study table: end -->\n\nafter\n")
    out = tmp / "out"
    proc = study("--data", tmp / "m30k", "--out", out, "--schemes", "post-ln,admin",
                 "--seeds", "1,2", *TINY, "--publish", docs)
    with open(out / "results.csv", newline="") as fh:
        rows = {(r["scheme"], r["seed"]): r for r in csv.DictReader(fh)}
    return dict(tmp=tmp, out=out, docs=docs, rows=rows, stdout=proc.stdout)


def run_dir(grid, scheme, seed):
    return grid["out"] / "runs" / re.sub(r"[^A-Za-z0-9_.-]+", "_", grid["rows"][scheme, seed]["key"])


def test_every_run_of_the_grid_is_a_row(grid):
    assert sorted(grid["rows"]) == [("admin", "1"), ("admin", "2"), ("post-ln", "1"),
                                    ("post-ln", "2")]
    for (scheme, _), r in grid["rows"].items():
        assert r["updates"] == "4" and r["depth"] == "2L-1L" and r["embed_dim"] == "16"
        flag = "--admin-init none" if scheme == "post-ln" else "--admin-init closed-form"
        assert flag in r["train_command"]


def test_published_commands_are_relative_to_the_repository(grid):
    with open(grid["docs"] / "depth_study_results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    for r in rows:
        assert r["train_command"].startswith("python -m fairseq_cli.train OUT/data/bin "
                                             "--user-dir fairseq_admin_pos ")
        for text in (r["train_command"], r["generate_command"], r["study_command"]):
            assert str(REPO) not in text and str(grid["out"]) not in text


def test_unigram_entropy_recomputed_from_the_encoded_training_side(grid):
    counts = Counter()
    lines = (grid["out"] / "data" / "spm" / "train.de").read_text().splitlines()
    for line in lines:
        counts.update(line.split())
    counts["</s>"] += len(lines)
    total = sum(counts.values())
    h = -sum(c / total * math.log2(c / total) for c in counts.values())
    for r in grid["rows"].values():
        assert float(r["unigram_entropy_bits"]) == pytest.approx(h, abs=5e-4)


@pytest.mark.parametrize("scheme,seed", [("post-ln", "1"), ("admin", "2")])
def test_losses_and_status_recomputed_from_fairseqs_log(grid, scheme, seed):
    r = grid["rows"][scheme, seed]
    valid, train = [], []
    for line in (run_dir(grid, scheme, seed) / "train.log").read_text().splitlines():
        if "| valid | {" in line:
            valid.append(json.loads(line.split("| valid | ", 1)[1]))
        elif "| train_inner | {" in line:
            train.append(json.loads(line.split("| train_inner | ", 1)[1]))
    assert [int(v["valid_num_updates"]) for v in valid] == [2, 4]
    best = min(valid, key=lambda v: float(v["valid_loss"]))  # fairseq's checkpoint_best
    assert float(r["best_valid_nll"]) == pytest.approx(float(best["valid_nll_loss"]), abs=5e-4)
    assert float(r["final_train_nll"]) == pytest.approx(float(train[-1]["nll_loss"]), abs=5e-4)
    best_nll = min(float(v["valid_nll_loss"]) for v in valid)
    nll = [float(t["nll_loss"]) for t in train]
    h = float(r["unigram_entropy_bits"])
    expected = ("diverged" if nll[-1] > min(nll) + 1.0
                else "stuck" if best_nll > h - 1.0 else "trained")
    assert r["status"] == expected
    # the curve keeps the monitor's encoder token cosine of every logged update
    curve = json.loads((run_dir(grid, scheme, seed) / "curve.json").read_text())
    assert [p["enc_tok_cos"] for p in curve["train"]] == [float(t["enc_tok_cos"])
                                                          for t in train]


@pytest.mark.parametrize("scheme,seed", [("post-ln", "2"), ("admin", "1")])
def test_bleu_recomputed_from_the_hypotheses(grid, scheme, seed):
    hyps = (run_dir(grid, scheme, seed) / "test.hyp.de").read_text().splitlines()
    refs = (grid["out"] / "data" / "raw" / "test.de").read_text().splitlines()
    assert len(hyps) == len(refs) == 20
    score = sacrebleu.corpus_bleu(hyps, [refs]).score
    assert float(grid["rows"][scheme, seed]["bleu"]) == pytest.approx(score, abs=0.006)


@pytest.mark.parametrize("scheme,seed", [("post-ln", "1"), ("admin", "2")])
def test_distinct_translations_counted_from_the_hypotheses(grid, scheme, seed):
    hyps = (run_dir(grid, scheme, seed) / "test.hyp.de").read_text().splitlines()
    assert int(grid["rows"][scheme, seed]["distinct_hyps"]) == len(set(hyps))


def test_distinct_translations_of_an_older_row_come_from_its_run(depth_study_module, tmp_path):
    # a row written before the column existed: counted from the run's translations if the
    # run folder is still there, left empty otherwise
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    (run / "test.hyp.de").write_text("Ein Hund.\nEin Hund.\nEine Katze.\nEin Hund.\n")
    fields = [f for f in depth_study_module.CSV_FIELDS if f != "distinct_hyps"]
    with open(tmp_path / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerow({"key": "a", "curve_file": "runs/a/curve.json"})
        writer.writerow({"key": "gone", "curve_file": "runs/gone/curve.json"})
    rows = depth_study_module.read_rows(tmp_path / "results.csv")
    assert [r["distinct_hyps"] for r in rows] == ["2", ""]


def test_summary_gives_mean_and_sample_std_over_seeds(grid):
    table = (grid["out"] / "results_table.md").read_text()
    for scheme in ("post-ln", "admin"):
        bleus = [float(grid["rows"][scheme, s]["bleu"]) for s in ("1", "2")]
        # TINY validates every 2 updates: the label says so
        line = next(l for l in table.splitlines()
                    if l.startswith(f"| 2L-1L | sinusoidal | {scheme} (valid every 2) | 1,2 "))
        expected = (f"{statistics.mean(bleus):.2f} +- {statistics.stdev(bleus):.2f} "
                    f"({min(bleus):.2f}-{max(bleus):.2f})")
        assert expected in line


@pytest.mark.parametrize("values,expected", [
    (["-0.00001", "0.00002"], "0.000 +- 0.000 (0.000-0.000)"),  # a source gain of a failed run
    (["-0.00004"], "0.000"),
    (["1.5", "2.5", "x", ""], "2.000 +- 0.707 (1.500-2.500)"),  # non-numbers are skipped
])
def test_summary_cell_prints_no_negative_zero(depth_study_module, values, expected):
    from depthstudy.report import _mean_spread
    assert _mean_spread(values, 3) == expected


@pytest.mark.parametrize("other,label", [
    ({"validate_every": "200"}, "admin (lr 0.001, warmup 2000, valid every 200)"),
    ({"clip_norm": "1"}, "admin (lr 0.001, warmup 2000, clip-norm 1)"),
])
def test_runs_of_one_seed_validated_or_clipped_otherwise_are_not_averaged(
        depth_study_module, other, label):
    # the same seed validated at other updates picks another checkpoint_best: its own line,
    # never a "seeds 1,1" mean with the run validated at the epochs' ends
    from depthstudy.report import summary_lines
    base = {"study": "d128-2400upd", "depth": "12L-1L", "positions": "sinusoidal",
            "scheme": "admin", "seed": "1",
            "embed_dim": "128", "max_update": "2400", "lr": "0.001", "warmup": "2000",
            "clip_norm": "0", "status": "trained", "bleu": "32.64", "best_valid_nll": "3.174",
            "distinct_hyps": "1000", "validate_every": "", "encoder_layers": "12"}
    rows = [base, {**base, "bleu": "33.00", **other}]
    body = summary_lines(rows)[2:]
    assert [line.split(" | ")[2:5] for line in body] == [
        ["admin (lr 0.001, warmup 2000)", "1", "1 trained"], [label, "1", "1 trained"]]
    assert [line.split(" | ")[5] for line in body] == ["32.64", "33.00"]


def test_published_summary_prints_no_negative_zero_and_no_per_run_rows(depth_study_module,
                                                                      grid, tmp_path):
    # the summary shows a cell's source gain to 3 decimals: a failed run's -0.00001 (written
    # "-0.0000") is shown as 0.000; per-run detail stays in the CSV, so no row per run
    rows = depth_study_module.read_rows(grid["out"] / "results.csv")
    for r in rows:
        r["source_gain"] = "-0.0000"
    depth_study_module.write_table(rows, tmp_path / "table.md", [])
    text = (tmp_path / "table.md").read_text()
    cells = [line.split(" | ")[-1] for line in text.splitlines() if line.startswith("| 2L-1L")]
    assert cells == ["0.000 +- 0.000 (0.000-0.000) |"] * 2
    assert "train: `" not in text and "| # |" not in text


def test_publish_fills_the_table_block_and_keeps_the_curves(grid):
    docs = grid["docs"]
    page = (docs / "results.md").read_text()
    assert "old table" not in page and page.startswith("# page\n\nbefore\n")
    assert page.rstrip().endswith("after")
    assert (grid["out"] / "results_table.md").read_text() in page
    with open(docs / "depth_study_results.csv", newline="") as fh:
        assert len(list(csv.DictReader(fh))) == 4
    for scheme, seed in grid["rows"]:
        published = docs / "depth_study_curves" / f"{run_dir(grid, scheme, seed).name}.json"
        assert published.read_text() == (run_dir(grid, scheme, seed) / "curve.json").read_text()


def test_figure_is_drawn_from_published_curves_when_the_runs_are_gone(grid, tmp_path):
    # a new machine: the CSV and the published curves, nothing of the runs
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.csv").write_text((grid["docs"] / "depth_study_results.csv").read_text())
    study("--data", grid["tmp"] / "m30k", "--out", out, "--schemes", "post-ln,admin",
          "--seeds", "1,2", *TINY, "--report-only", "--publish", grid["docs"])
    assert (out / "depth_study_loss.png").stat().st_size > 10_000


@pytest.mark.parametrize("studies, expected", [
    # the single warmup row of the longer schedule (d128, 2400 updates) sorts before the
    # demo grid's recipe
    (["d128-700upd"] * 3 + ["d128-2400upd"], "d128-700upd"),
    (["d64-200upd"] * 2 + ["d128-700upd"] * 2, "d128-700upd"),
    (["d64-200upd"] * 3 + ["d128-700upd"] * 2, "d64-200upd"),
])
def test_the_loss_figure_shows_the_study_with_the_most_rows(depth_study_module, studies,
                                                            expected):
    assert depth_study_module.plotted_study([{"study": s} for s in studies]) == expected


def test_a_second_call_runs_nothing(grid):
    proc = study("--data", grid["tmp"] / "m30k", "--out", grid["out"], "--schemes",
                 "post-ln,admin", "--seeds", "1,2", *TINY)
    assert "grid: 4 runs, 4 already in" in proc.stdout + proc.stderr
    # each command the study runs is printed as "$ command"
    assert not [l for l in proc.stdout.splitlines() if l.startswith("$ ") and "fairseq_cli" in l]


# what a run's row says about when and how fast it ran and the call that ran it, not what
# it computed
_NOT_COMPUTED = {"train_wall_s", "updates_per_s", "generate_wall_s", "finished_utc",
                 "study_command"}


def test_forked_commands_give_the_rows_of_new_interpreters(grid, tmp_path, depth_study_module):
    """The grid's fairseq commands were forked from a process that had imported torch and
    fairseq (tests/study_forked.py); the study run as a user runs it, each command a new
    interpreter, gives the same row: losses, BLEU, omegas, probe, translations."""
    out = tmp_path / "out"
    shutil.copytree(grid["out"] / "data", out / "data")
    proc = study("--data", grid["tmp"] / "m30k", "--out", out, "--schemes", "admin",
                 "--seeds", "1", *TINY, fresh=True)
    assert "data ready in" in proc.stdout + proc.stderr
    with open(out / "results.csv", newline="") as fh:
        (fresh,) = list(csv.DictReader(fh))
    forked = grid["rows"]["admin", "1"]
    assert sorted(fresh) == sorted(forked)
    # the CSV's newest row holds its commands as they ran, the others relative (OUT, python)
    relative = depth_study_module.relative
    same = {k: relative(fresh[k], out) for k in fresh if k not in _NOT_COMPUTED}
    assert same == {k: relative(forked[k], grid["out"]) for k in same}
    assert float(forked["bleu"]) >= 0 and forked["final_omegas"] and forked["probe_valid_nll"]
    folder = out / Path(fresh["curve_file"]).parent
    for name in ("curve.json", "test.hyp.de"):
        assert (folder / name).read_text() == (run_dir(grid, "admin", "1") / name).read_text()


def test_publish_into_a_page_without_the_markers_is_an_error(grid, tmp_path):
    (tmp_path / "results.md").write_text("# no markers\n")
    proc = study("--out", grid["out"], "--report-only", "--publish", tmp_path, check=False)
    assert proc.returncode != 0
    assert "lacks the lines" in proc.stderr and "depth_study table: start" in proc.stderr


@pytest.fixture(scope="module")
def depth_study_module():
    return load_study_module()


def test_every_planned_variant_is_known_to_this_checkout(depth_study_module):
    # admin-paper's --radam-early-steps is listed by fairseq only once --optimizer radam is
    # chosen: the check must not pass such a variant over. One help text per chosen
    # optimizer serves every variant of a grid (the cache run_grid passes).
    env, helps = depth_study_module.fairseq_env(1), {}
    for scheme, positions in [("admin-paper", "sinusoidal"), ("admin", "scaled-sinusoidal"),
                              ("mix-ln-dyt", "sinusoidal"), ("post-ln", "sinusoidal")]:
        assert depth_study_module.unsupported_flags(scheme, positions, env, helps) == [], scheme
    assert sorted(helps) == [(), ("--optimizer", "radam")]
    assert "--radam-early-steps" in helps["--optimizer", "radam"]
    assert "--radam-early-steps" not in helps[()] and "--admin-init" in helps[()]


def test_a_flag_this_checkout_lacks_is_reported(depth_study_module, monkeypatch):
    monkeypatch.setitem(depth_study_module.SCHEMES, "future",
                        ["--admin-init", "none", "--optimizer", "radam", "--radam-future", "1"])
    assert depth_study_module.unsupported_flags("future", "sinusoidal",
                                                depth_study_module.fairseq_env(1)) == ["--radam-future"]


def test_demo_scale_plan_is_its_grid_once_each(depth_study_module):
    # 5 schemes x {6L-6L, 12L-12L, deep encoder}; 3 seeds at 12L-12L and for the
    # deep-encoder admin, pre-ln (and admin-paper) rows, 1 elsewhere; 4 position variants of
    # Admin at the demo's 12L-3L with 2 seeds each
    plan = depth_study_module.PLANS["demo-scale"]
    schemes = ("post-ln", "pre-ln", "admin", "admin-paper", "deepnorm")
    deep = depth_study_module._DEEP_ENC
    expected = {(s, "6L-6L", 1, "sinusoidal") for s in schemes}
    expected |= {(s, "12L-12L", seed, "sinusoidal") for s in schemes for seed in (1, 2, 3)}
    expected |= {(s, deep, seed, "sinusoidal") for s in schemes
                 for seed in ((1, 2, 3) if s in ("admin", "pre-ln", "admin-paper") else (1,))}
    expected |= {("admin", "12L-3L", seed, p) for seed in (1, 2)
                 for p in ("sinusoidal", "scaled-sinusoidal", "learned", "scaled-sinusoidal-seed")}
    assert len(plan) == len(set(plan)) == 39
    assert set(plan) == expected


def test_norms_2025_plan_is_its_grid_seed_one_first(depth_study_module):
    # Peri-LN, Mix-LN and DyT in Pre-LN (with the pre-ln/post-ln baselines) at the
    # deep encoder and 12L-12L, 3 seeds; seed 1 of every new scheme before any other run. DyT
    # in the other placements is a plan of its own, the same cells and seeds
    m = depth_study_module
    plan, deep = m.PLANS["norms-2025"], m._DEEP_ENC
    new = ("peri-ln", "mix-ln", "pre-ln-dyt")
    cells = [(d, seed) for d in (deep, "12L-12L") for seed in (1, 2, 3)]
    expected = {(s, d, seed, "sinusoidal") for s in new + ("pre-ln", "post-ln")
                for d, seed in cells}
    assert len(plan) == len(set(plan)) == 30 and set(plan) == expected
    assert set(plan[:6]) == {(s, d, 1, "sinusoidal") for s in new for d in (deep, "12L-12L")}
    assert [r[1] for r in plan[:6]] == [deep] * 3 + ["12L-12L"] * 3
    dyt = m.PLANS["norms-2025-dyt"]
    assert len(dyt) == len(set(dyt)) == 18 and set(dyt) == {
        (s, d, seed, "sinusoidal") for s in ("peri-ln-dyt", "mix-ln-dyt", "post-ln-dyt")
        for d, seed in cells}
    assert m.SCHEMES["mix-ln-dyt"] == ["--admin-residual", "mix-ln", "--admin-norm", "dyt"]
    assert m.SCHEMES["pre-ln-dyt"] == m.SCHEMES["pre-ln"] + ["--admin-norm", "dyt"]
    assert "admin-dyt" not in m.SCHEMES  # refused: Admin's omegas assume LayerNorm


def test_clip_norm_reaches_fairseq_and_labels_the_row(grid, tmp_path):
    # B2T's authors clip gradients at 0.1 beyond 18 layers. fairseq's own log says whether it
    # clipped ("clip": the percentage of updates whose norm exceeded the bound). A new --out
    # holding a copy of the grid's prepared data: the study reuses it (same --data, vocab)
    out = tmp_path / "out"
    shutil.copytree(grid["out"] / "data", out / "data")
    proc = study("--data", grid["tmp"] / "m30k", "--out", out, "--schemes", "admin", "--seeds",
                 "1", *TINY, "--clip-norm", "0.01")
    assert "data ready in" in proc.stdout + proc.stderr
    with open(out / "results.csv", newline="") as fh:
        (row,) = list(csv.DictReader(fh))
    assert "clip0.01" in row["key"].split("|") and row["clip_norm"] == "0.01"
    assert "--clip-norm 0.01 " in row["train_command"]
    log_text = (out / Path(row["curve_file"]).parent / "train.log").read_text()
    logged = [json.loads(line.split("| train_inner | ", 1)[1])
              for line in log_text.splitlines() if "| train_inner | " in line]
    assert logged and all(float(p["gnorm"]) > 0.01 and float(p["clip"]) == 100.0 for p in logged)
    assert "| admin (clip-norm 0.01, valid every 2) |" in (out / "results_table.md").read_text()


def test_negative_clip_norm_is_an_error_naming_the_flag(tmp_path):
    proc = study("--out", tmp_path, "--report-only", "--clip-norm", "-1", check=False)
    assert proc.returncode == 2 and "--clip-norm" in proc.stderr


MULTI30K_FILES = [f"{split}.{lang}.gz" for split in ("train", "val", "test_2016_flickr")
                  for lang in ("en", "de")]


@pytest.mark.parametrize("case", ["no-folder", "empty-folder", "one-file-missing"])
def test_deep_shallow_plan_with_bad_data_is_one_line_and_leaves_nothing(tmp_path, case):
    """`--plan deep-shallow` with a --data folder that is not Multi30k's: one
    `depth_study.py: error:` line naming --data and the files it must hold, exit status 2,
    nothing printed on stdout, and no --out folder (nor anything else) written."""
    data = tmp_path / "m30k"
    if case == "empty-folder":
        data.mkdir()
    elif case == "one-file-missing":
        write_fake_multi30k(data)
        (data / "val.de.gz").unlink()
    before = sorted(tmp_path.rglob("*"))
    out = tmp_path / "out"
    proc = study("--plan", "deep-shallow", "--data", data, "--out", out, check=False)
    assert proc.returncode == 2, proc.stderr
    if case == "no-folder":
        want = (f"--data {data}: not a directory. It must hold Multi30k Task 1 raw text: "
                + ", ".join(MULTI30K_FILES))
    else:
        missing = MULTI30K_FILES if case == "empty-folder" else ["val.de.gz"]
        want = (f"--data {data}: missing {', '.join(missing)} (expected the gzip files of "
                "multi30k/dataset data/task1/raw: train, val, test_2016_flickr x .en/.de)")
    assert proc.stderr.splitlines() == [f"depth_study.py: error: {want}"]
    assert proc.stdout == ""
    assert not out.exists() and sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("depth", ["12L-0L", "0L-1L", "12-1"])
def test_bad_depth_is_an_error_naming_the_flag_and_leaves_nothing(tmp_path, depth):
    out = tmp_path / "out"
    proc = study("--depths", depth, "--out", out, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"depth_study.py: error: --depths: {depth!r} is not of the form <enc>L-<dec>L with at "
        "least one layer per side, e.g. 6L-6L, 12L-12L, 24L-1L")
    assert not out.exists()
