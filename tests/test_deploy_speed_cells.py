"""benchmarks/deploy_speed.py's issue-41 modes and the study's deep-shallow publishing.

* ``--study-out OUT --cells ... --quick`` on a study folder laid out as depth_study.py writes
  it (results.csv, runs/<run>/ckpt/checkpoint_best.pt, data/{bin,spm,raw}) with tiny trained
  checkpoints: the CSV has the expected columns, one row per cell x engine x precision x batch
  x threads; each cell's timed seed is its lowest trained one; a scheme the export refuses
  (b2t) is timed through the plugin only and says so; ratios to 6L-6L and milliseconds per
  sentence are the division of the row's own figures;
* ``--wmt-shapes --quick``: every output of CTranslate2 has exactly the requested length
  (checked on a trained model whose own outputs are shorter and longer than requested, and
  through the whole mode), and batches never mix lengths;
* ``depth_study.py``'s publish (``publish.publish``) on hand-made rows: the deep-shallow block
  with means and sample stds recomputed here with ``statistics``, the "fastest within 0.5
  BLEU" line of a constructed case, the figure; and nothing changed without the plan's rows;
  the warmup plan's table beside the demo recipe's rows, with the distances recomputed.
"""
from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import re
import shutil
import statistics
from pathlib import Path

import pytest

from fairseq_cli_utils import REPO, TINY_MODEL, run, train, write_reversal_corpus
from study_utils import publish_folders, published_block

ctranslate2 = pytest.importorskip("ctranslate2")

BENCH = REPO / "benchmarks" / "deploy_speed.py"
FIELDS = ["kind", "shape", "encoder_layers", "decoder_layers", "embed_dim", "ffn_dim", "heads",
          "vocab", "scheme", "seed", "train_status", "engine", "precision", "batch", "threads",
          "sentences", "mean_batch", "rounds", "sentences_per_s", "ms_per_sentence",
          "ratio_to_6l6l", "round_values", "bleu", "note", "cpu", "checkpoint"]


def load_bench():
    spec = importlib.util.spec_from_file_location("deploy_speed", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # puts benchmarks/ on sys.path: depthstudy, deployspeed
    return module


def read_csv(path: Path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def recipe_key(scheme, depth, seed):
    from depthstudy.deepshallow import plan_args
    from depthstudy.plan import run_key

    return run_key(scheme, depth, seed, plan_args("deep-shallow"))


def run_folder(key: str) -> str:
    return "runs/" + re.sub(r"[^A-Za-z0-9_.-]+", "_", key)


@pytest.fixture(scope="module")
def bench():
    return load_bench()


@pytest.fixture(scope="module")
def study_out(tmp_path_factory, bench):
    """A depth-study output folder: en/de data (the reversal corpus), two tiny trained
    checkpoints (admin, b2t) placed as the runs of several cells and seeds, their rows."""
    from depthstudy.report import write_rows

    tmp = tmp_path_factory.mktemp("deploy_cells")
    write_reversal_corpus(tmp / "rev")
    out = tmp / "out"
    for sub in ("raw", "spm"):
        (out / "data" / sub).mkdir(parents=True)
    for split in ("train", "valid", "test"):
        for side, lang in (("src", "en"), ("tgt", "de")):
            text = (tmp / "rev" / f"{split}.{side}").read_text()
            for sub in ("raw", "spm"):
                (out / "data" / sub / f"{split}.{lang}").write_text(text)
    spm = out / "data" / "spm"
    run("fairseq_cli.preprocess", [
        "--source-lang", "en", "--target-lang", "de", "--trainpref", spm / "train",
        "--validpref", spm / "valid", "--testpref", spm / "test",
        "--destdir", out / "data" / "bin", "--joined-dictionary", "--workers", "1"])
    ckpts = {}
    for scheme, flags in (("admin", ["--admin-omega", "parameter"]),
                          ("b2t", ["--admin-residual", "b2t"])):
        train(out / "data" / "bin", tmp / scheme, "admin_transformer",
              [*TINY_MODEL, *flags, "--share-all-embeddings", "--lr", "5e-3"], max_update=60)
        ckpts[scheme] = tmp / scheme / "checkpoint_last.pt"
    # (scheme, shape, seed, status): admin 6L-6L seed 1 failed, so seed 2 is timed; admin
    # 12L-1L seed 2 failed, seed 1 is timed; b2t is refused by the export
    runs = [("admin", "6L-6L", 1, "diverged"), ("admin", "6L-6L", 2, "trained"),
            ("admin", "12L-1L", 1, "trained"), ("admin", "12L-1L", 2, "diverged"),
            ("b2t", "6L-6L", 1, "trained")]
    rows = []
    for scheme, shape, seed, status in runs:
        key = recipe_key(scheme, shape, seed)
        folder = out / run_folder(key)
        (folder / "ckpt").mkdir(parents=True)
        shutil.copyfile(ckpts[scheme], folder / "ckpt" / "checkpoint_best.pt")
        rows.append(dict(key=key, study="d128-700upd", scheme=scheme, positions="sinusoidal",
                         depth=shape, seed=seed, status=status, embed_dim=128, ffn_dim=512,
                         heads=4, max_update=700, lr="0.002", warmup=400, bleu="1.00",
                         curve_file=f"{run_folder(key)}/curve.json"))
    write_rows(out / "results.csv", rows)
    return out


@pytest.fixture(scope="module")
def cells_run(study_out, bench, tmp_path_factory):
    """``--study-out OUT --cells ... --quick`` (post-ln 24L-1L has no run); fairseq-generate
    is forked from the tests' zygote (``fairseq_cli_utils.run``), the rest as it runs."""
    import deployspeed.timing

    def forked(cmd, env):  # fairseq-generate forked from the tests' zygote (1 thread)
        assert Path(cmd[0]).name == "fairseq-generate" and env["OMP_NUM_THREADS"] == "1"
        return run("fairseq_cli.generate", cmd[1:], check=False)

    work = tmp_path_factory.mktemp("deploy_work")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.MonkeyPatch.context() as mp:
        mp.setattr(deployspeed.timing, "run_process", forked)
        bench.main(["--study-out", str(study_out), "--cells",
                    "admin:6L-6L,admin:12L-1L,b2t:6L-6L,post-ln:24L-1L", "--quick",
                    "--work", str(work)])
    return dict(rows=read_csv(work / "deploy_speed_cells.csv"), work=work,
                stdout=printed.getvalue())


def test_cells_csv_rows_and_columns(cells_run):
    rows = cells_run["rows"]
    with open(cells_run["work"] / "deploy_speed_cells.csv", newline="") as fh:
        assert next(csv.reader(fh)) == FIELDS
    got = sorted((r["scheme"], r["shape"], r["engine"], r["precision"], r["batch"], r["threads"])
                 for r in rows)
    want = sorted([(s, shape, e, p, b, "1") for s, shape in (("admin", "6L-6L"),
                                                              ("admin", "12L-1L"))
                   for e, p in (("fairseq + plugin", "float32"), ("CTranslate2", "float32"),
                                ("CTranslate2", "int8")) for b in ("64", "1")]
                  + [("b2t", "6L-6L", "fairseq + plugin", "float32", b, "1") for b in ("64", "1")])
    assert got == want
    for r in rows:
        assert r["kind"] == "cells" and r["sentences"] == "24" and r["rounds"] == "1"
        assert r["cpu"] and float(r["bleu"]) >= 0
        assert r["checkpoint"] == f"{run_folder(recipe_key(r['scheme'], r['shape'], r['seed']))}" \
                                  "/ckpt/checkpoint_best.pt"


def test_each_cell_times_its_lowest_trained_seed(cells_run):
    seeds = {(r["scheme"], r["shape"]): (r["seed"], r["train_status"]) for r in cells_run["rows"]}
    assert seeds == {("admin", "6L-6L"): ("2", "trained"), ("admin", "12L-1L"): ("1", "trained"),
                     ("b2t", "6L-6L"): ("1", "trained")}
    assert "no checkpoint for post-ln 24L-1L" in cells_run["stdout"]


def test_refused_scheme_is_timed_through_the_plugin_only(cells_run):
    b2t = [r for r in cells_run["rows"] if r["scheme"] == "b2t"]
    assert {r["engine"] for r in b2t} == {"fairseq + plugin"}
    for r in b2t:
        assert r["note"].startswith("CTranslate2 not exported: --admin-residual b2t cannot be "
                                    "exported")
    assert "b2t 6L-6L: plugin speed only, the export refuses it" in cells_run["stdout"]
    assert not any(r["note"] for r in cells_run["rows"] if r["scheme"] == "admin")


def test_ratios_and_latency_are_the_rows_own_division(cells_run):
    rows = cells_run["rows"]
    base = {(r["scheme"], r["engine"], r["precision"], r["batch"], r["threads"]):
            float(r["sentences_per_s"]) for r in rows if r["shape"] == "6L-6L"}
    for r in rows:
        sps = float(r["sentences_per_s"])
        assert float(r["round_values"]) == pytest.approx(sps, abs=1e-3)  # one round
        assert float(r["ms_per_sentence"]) == pytest.approx(1000 / sps, rel=1e-3)
        expected = sps / base[r["scheme"], r["engine"], r["precision"], r["batch"], r["threads"]]
        assert float(r["ratio_to_6l6l"]) == pytest.approx(expected, abs=6e-4)
        if r["shape"] == "6L-6L":
            assert r["ratio_to_6l6l"] == "1.000"
    assert "| 12L-1L | admin | 1 | CTranslate2 | int8 | 64 | 1 |" in cells_run["stdout"]


# -- fixed output lengths ----------------------------------------------------------------
def test_fixed_length_outputs_have_exactly_the_requested_length(cells_run, study_out, bench):
    """On the trained admin model (which ends its own translations with EOS): lengths
    above and below its own, at batch 64 and 1, float32 and int8."""
    from deployspeed.shapes import translate_fixed
    from fairseq_admin_pos.export.ct2 import translate

    folder = cells_run["work"] / Path(run_folder(recipe_key("admin", "6L-6L", 2))).name
    sources = [ln.split() for ln in (study_out / "data" / "spm" / "test.en").read_text()
               .splitlines()]
    for precision in ("float32", "int8"):
        tr = ctranslate2.Translator(str(folder / f"ct2-{precision}"), compute_type=precision)
        own = [len(t) for t, _ in translate(tr, sources, beam=4, lenpen=0.6, max_len_b=30)]
        assert sum(n < 30 for n in own) > len(own) // 2  # it ends most with EOS itself
        lengths = [n + 3 if i % 2 else max(1, n - 2) for i, n in enumerate(own)]
        assert lengths != own
        for batch in (64, 1):
            out, calls = translate_fixed(tr, sources, lengths, batch)
            assert [len(o) for o in out] == lengths
            assert "</s>" not in {tok for o in out for tok in o}
            assert calls == (len(set(lengths)) if batch == 64 else len(sources))


def test_fixed_length_batches_hold_one_length():
    from types import SimpleNamespace

    from deployspeed.shapes import translate_fixed

    calls = []

    class Stub:
        def translate_batch(self, batch, min_decoding_length, max_decoding_length, **kw):
            calls.append((min_decoding_length, max_decoding_length, [s for s, in batch]))
            return [SimpleNamespace(hypotheses=[["x"] * max_decoding_length]) for _ in batch]

    lengths = [3, 1, 3, 3, 2, 3, 1]
    out, n = translate_fixed(Stub(), [[str(i)] for i in range(7)], lengths, batch_size=2)
    assert [len(o) for o in out] == lengths and n == len(calls) == 4
    # sorted by length (ties in input order), at most 2 per batch, a new batch at each length
    assert calls == [(1, 1, ["1", "6"]), (2, 2, ["4"]), (3, 3, ["0", "2"]), (3, 3, ["3", "5"])]


def test_wmt_shapes_quick(bench, study_out, tmp_path, capsys):
    bench.main(["--wmt-shapes", "--quick", "--text", str(study_out / "data" / "spm"),
                "--work", str(tmp_path)])
    rows = read_csv(tmp_path / "deploy_speed_shapes.csv")
    assert sorted((r["shape"], r["precision"], r["batch"]) for r in rows) == sorted(
        (s, p, b) for s in ("6L-6L", "12L-3L", "12L-1L", "24L-1L") for p in ("float32", "int8")
        for b in ("64", "1"))
    lengths = [len(ln.split()) for ln in (study_out / "data" / "spm" / "test.de").read_text()
               .splitlines()]
    base = {(r["precision"], r["batch"]): float(r["sentences_per_s"]) for r in rows
            if r["shape"] == "6L-6L"}
    for r in rows:
        assert r["kind"] == "wmt-shapes" and r["engine"] == "CTranslate2"
        assert (r["vocab"], r["embed_dim"], r["train_status"]) == ("64", "16", "untrained")
        assert "reference length" in r["note"] and r["sentences"] == str(len(lengths))
        assert float(r["ratio_to_6l6l"]) == pytest.approx(
            float(r["sentences_per_s"]) / base[r["precision"], r["batch"]], abs=6e-4)
        groups = len(set(lengths))  # batches of 64 never mix lengths: one per length here
        assert float(r["mean_batch"]) == pytest.approx(
            1.0 if r["batch"] == "1" else len(lengths) / groups, abs=0.05)
    # the untrained models were exported by the package and built at the requested sizes
    assert (tmp_path / "d16-f32-h2-v64" / "24L-1L" / "ct2-int8" / "model.bin").is_file()
    assert not (tmp_path / "d16-f32-h2-v64" / "24L-1L" / "checkpoint.pt").exists()


# -- publishing ----------------------------------------------------------------------------
PAGE = ("# page\n\n<!-- depth_study table: start -->\nold\n<!-- depth_study table: end -->\n\n"
        "## Deep encoder, shallow decoder (issue 41)\n\n<!-- deep_shallow table: start -->\n"
        "placeholder\n<!-- deep_shallow table: end -->\n\nafter\n")

# (scheme, shape): [(seed, status, bleu, best valid nll)]
CELLS = {
    ("admin", "6L-6L"): [(1, "trained", 28.0, 3.40), (2, "trained", 28.6, 3.38)],
    ("admin", "12L-3L"): [(1, "trained", 30.2, 3.30), (2, "trained", 29.6, 3.36),
                          (3, "trained", 30.2, 3.31)],
    ("admin", "12L-1L"): [(1, "trained", 29.9, 3.35), (2, "trained", 29.5, 3.39)],
    ("admin", "24L-1L"): [(1, "trained", 29.7, 3.37)],
    ("pre-ln", "48L-1L"): [(1, "trained", 29.4, 3.50)],
    ("post-ln", "12L-1L"): [(1, "diverged", 2.1, 5.10), (2, "stuck", 0.5, 7.80),
                            (3, "trained", 20.0, 4.00)],
}
# (scheme, shape, seed): source gain in bits; post-ln's seed 3 "trained" but reads no source
GAINS = {("post-ln", "12L-1L", 3): 0.65, ("pre-ln", "48L-1L", 1): 2.05,
         ("admin", "24L-1L", 1): 1.5}
# (scheme, shape, seed): encoder cos of the probed runs (the others were not probed)
COLLAPSE = {("post-ln", "12L-1L", 3): 0.9987, ("pre-ln", "48L-1L", 1): 0.5912,
            ("admin", "12L-1L", 1): 0.4021, ("admin", "12L-1L", 2): 0.4556}
# sentences/s of CTranslate2 int8, batch 64, 1 thread (post-ln 12L-1L: plugin only)
SPEED = {("admin", "6L-6L"): 200.0, ("admin", "12L-3L"): 250.0, ("admin", "12L-1L"): 400.0,
         ("admin", "24L-1L"): 500.0, ("pre-ln", "48L-1L"): 900.0}


def distinct(seed, status):
    """The hand-made rows' count of different test translations."""
    return 1000 - seed if status == "trained" else 3 + seed


# a cell timed in a later run than its 6L-6L: the ratio its own run measured, not 500 / 200
OWN_RATIO = {("admin", "24L-1L"): "2.345"}


def speed_row(kind, scheme, shape, engine, precision, sps, batch="64", threads="1", ratio=""):
    return dict(kind=kind, shape=shape, scheme=scheme, seed="1", engine=engine,
                precision=precision, batch=batch, threads=threads, sentences="1000",
                rounds="3", sentences_per_s=f"{sps:.3f}", ms_per_sentence=f"{1000 / sps:.3f}",
                ratio_to_6l6l=ratio, note="", cpu="Test CPU x 2", vocab="32000", mean_batch="20.0")


def publish_case(tmp_path, with_speed=True, rows=True):
    from depthstudy.report import write_rows

    out, docs = publish_folders(tmp_path, PAGE)
    table = []
    for (scheme, shape), runs in (CELLS.items() if rows else []):
        for seed, status, bleu, nll in runs:
            table.append(dict(key=recipe_key(scheme, shape, seed), study="d128-700upd",
                              scheme=scheme, positions="sinusoidal", depth=shape, seed=seed,
                              status=status, bleu=f"{bleu:.2f}", best_valid_nll=f"{nll:.3f}",
                              distinct_hyps=distinct(seed, status), embed_dim=128,
                              source_gain=GAINS.get((scheme, shape, seed), ""),
                              encoder_cos=COLLAPSE.get((scheme, shape, seed), ""),
                              max_update=700, lr="0.002", warmup=400))
    # a row of another plan's recipe (lr 1e-3) must not be counted
    table.append(dict(key=recipe_key("admin", "6L-6L", 1).replace("lr0.002", "lr0.001"),
                      study="d128-700upd", scheme="admin", positions="sinusoidal",
                      depth="6L-6L", seed=1, status="trained", bleu="40.00", lr="0.001"))
    write_rows(out / "results.csv", table)
    if with_speed:
        speed = [speed_row("cells", s, d, "CTranslate2", "int8", x,
                           ratio=OWN_RATIO.get((s, d), "")) for (s, d), x in SPEED.items()]
        speed += [speed_row("cells", s, d, "fairseq + plugin", "float32", x / 3)
                  for (s, d), x in SPEED.items()]
        speed += [speed_row("cells", "post-ln", "12L-1L", "fairseq + plugin", "float32", 90.0)]
        speed += [speed_row("cells", "admin", "12L-1L", "CTranslate2", "int8", 50.0, batch="1")]
        with open(docs / "deploy_speed_cells.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(speed)
        with open(docs / "deploy_speed_shapes.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows([speed_row("wmt-shapes", "admin", s, "CTranslate2", "int8", x)
                         for s, x in (("6L-6L", 20.0), ("12L-1L", 35.0))])
    from depthstudy.publish import publish

    publish(out, docs)
    block = published_block(docs, "<!-- deep_shallow table: start -->",
                            "<!-- deep_shallow table: end -->")
    return block, docs


def test_publish_writes_the_cells_with_means_and_stds(tmp_path, bench):
    block, docs = publish_case(tmp_path)
    for (scheme, shape), runs in CELLS.items():
        bleus, nlls = [r[2] for r in runs], [r[3] for r in runs]
        if len(runs) > 1:
            bleu = f"{statistics.mean(bleus):.2f} +- {statistics.stdev(bleus):.2f}"
            nll = f"{statistics.mean(nlls):.3f} +- {statistics.stdev(nlls):.3f}"
        else:
            bleu, nll = f"{bleus[0]:.2f}", f"{nlls[0]:.3f}"
        # a trained run under 1.5 bits of source gain counts as one that ignores the source
        bad = sorted(r[1] if r[1] != "trained" else "ignores the source" for r in runs
                     if r[1] != "trained" or GAINS.get((scheme, shape, r[0]), 9) < 1.5)
        fails = ", ".join(f"1 {st}" for st in bad) or "none"
        seeds = ",".join(str(r[0]) for r in runs)
        line = f"| {shape} | {scheme} | {seeds} | {len(runs)} | {bleu} | {nll} | {fails} |"
        assert line in block, line
        # the last columns: the fewest different translations over the cell's seeds, the
        # highest encoder cos over its probed seeds
        full = next(x for x in block.splitlines() if x.startswith(line))
        cos = [COLLAPSE[scheme, shape, r[0]] for r in runs if (scheme, shape, r[0]) in COLLAPSE]
        assert full.endswith(f"| {min(distinct(r[0], r[1]) for r in runs)} | "
                             f"{f'{max(cos):.2f}' if cos else '-'} |"), full
    # every cell of the plan is listed, run or not; the lr 1e-3 row is not counted
    assert "| 48L-1L | admin | - | 0 | not run yet |" in block
    assert "40.00" not in block
    # 12 hand-made runs; the plan: 4 schemes x 5 shapes x 3 seeds
    assert "12 of 60 planned runs recorded" in block
    assert (tmp_path / "docs" / "results.md").read_text().startswith(
        "# page\n\n<!-- depth_study table: start -->\nnew table\n")


@pytest.mark.parametrize("status, gain, why", [
    ("trained", "0.6500", "ignores the source"), ("trained", "-0.0000", "ignores the source"),
    ("trained", "1.4999", "ignores the source"), ("trained", "1.5", ""),
    ("trained", "2.52", ""), ("trained", "", ""), ("diverged", "0.1", "diverged"),
    ("stuck", "", "stuck")])
def test_failure_is_the_status_or_a_decoder_that_ignores_the_source(bench, status, gain, why):
    from depthstudy.deepshallow import failure, failures

    assert failure({"status": status, "source_gain": gain}) == why
    rows = [{"status": status, "source_gain": gain}] * 2 + [{"status": "trained"}]
    assert failures(rows) == (f"2 {why}" if why else "none")


def test_publish_names_the_fastest_model_within_half_a_bleu(tmp_path, bench):
    block, docs = publish_case(tmp_path)
    means = {c: statistics.mean(r[2] for r in runs) for c, runs in CELLS.items()}
    best = max(means, key=means.get)
    near = [c for c in means if means[c] >= means[best] - 0.5 and c in SPEED]
    fastest = max(near, key=SPEED.get)
    # the constructed case: pre-ln 48L-1L is fastest overall but 0.6 BLEU behind
    assert best == ("admin", "12L-3L") and fastest == ("admin", "24L-1L")
    ratio = float(OWN_RATIO[fastest])  # its own run's, not SPEED[fastest] / 6L-6L's
    assert (f"Best model of the study (mean BLEU over seeds): admin 12L-3L, "
            f"{means[best]:.2f}.") in block
    assert (f"**admin 24L-1L**, mean BLEU {means[fastest]:.2f}, {SPEED[fastest]:.1f} "
            f"sentences/s (CTranslate2 int8, batch 64, 1 thread), {ratio:.2f} times the speed "
            "of admin 6L-6L in the same timing run.") in block
    # the cells table: speed and ratio (the rows' division where the CSV has no ratio, the
    # row's own where it has one); plugin speed where CTranslate2 is missing
    assert "| 400.0 | 2.00 |" in block and "| 90.0 (plugin) | - |" in block
    assert f"| 500.0 | {float(OWN_RATIO['admin', '24L-1L']):.2f} |" in block
    # the speed tables of the cells and of the WMT shapes
    assert "| 12L-1L | admin | 1 | CTranslate2 int8 | 400.0 | 20.00 |" in block
    assert "untrained models with the output length held to each sentence's reference " \
           "length" in block
    assert "| 12L-1L | admin | 1 | CTranslate2 int8 | 35.0 |" in block
    png = docs / "deep_shallow_speed_quality.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_publish_without_speed_says_so_and_draws_nothing(tmp_path, bench):
    block, docs = publish_case(tmp_path, with_speed=False)
    assert "Deployed speed: not measured yet" in block
    assert "None of the 3 cells within 0.5 BLEU of it has a deployed speed yet" in block
    assert not (docs / "deep_shallow_speed_quality.png").exists()


def test_publish_without_the_plans_rows_leaves_the_block(tmp_path, bench):
    block, docs = publish_case(tmp_path, rows=False)
    assert block == "placeholder\n"
    assert not (docs / "deep_shallow_speed_quality.png").exists()


def test_plan_args_are_the_studys_keys(bench):
    """The keys the plan's runs get from depth_study.py's own argument handling."""
    from study_utils import load_study_module

    ds = load_study_module()
    args = ds.build_parser().parse_args(["--plan", "deep-shallow"])
    for name, value in ds.PRESETS["demo"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    assert ds.run_key("admin", "12L-1L", 1, args) == recipe_key("admin", "12L-1L", 1)


def test_publish_sets_the_warmup_plan_beside_the_demo_recipe(tmp_path, bench):
    """``--plan deep-shallow-warmup``'s rows (with the same recipe's 24L-3L pair) get their own
    table beside the same cells at the demo recipe, and per shape the paper's Admin's distance
    to the closed form at both recipes, recomputed here."""
    from depthstudy.deepshallow import plan_args
    from depthstudy.plan import run_key
    from depthstudy.publish import publish
    from depthstudy.report import write_rows

    # (scheme, shape, recipe): [(seed, status, bleu, nll, distinct)]
    runs = {("admin-paper", "12L-1L", "warmup"): [(1, "trained", 24.5, 3.80, 990)],
            ("admin", "12L-1L", "warmup"): [(1, "trained", 27.0, 3.60, 1000)],
            ("admin-paper", "24L-3L", "warmup"): [(1, "trained", 33.26, 2.984, 1000),
                                                  (2, "trained", 33.42, 3.017, 1000)],
            ("admin", "24L-3L", "warmup"): [(1, "trained", 34.08, 2.994, 1000)],
            ("admin-paper", "12L-1L", "deep-shallow"): [(1, "trained", 19.2, 4.20, 1000)],
            ("admin", "12L-1L", "deep-shallow"): [(1, "trained", 27.4, 3.70, 1000),
                                                  (2, "trained", 24.4, 3.88, 1000)],
            ("admin-paper", "24L-3L", "deep-shallow"): [(1, "stuck", 3.6, 5.03, 358)],
            ("post-ln", "12L-1L", "warmup"): [(1, "trained", 21.0, 3.90, 980)],
            ("post-ln", "12L-1L", "deep-shallow"): [(1, "trained", 1.5, 5.2, 196)]}
    table = []
    for (scheme, shape, recipe), rs in runs.items():
        args = plan_args("deep-shallow-warmup" if recipe == "warmup" else "deep-shallow")
        for seed, status, bleu, nll, dist in rs:
            table.append(dict(key=run_key(scheme, shape, seed, args), scheme=scheme,
                              positions="sinusoidal", depth=shape, seed=seed, status=status,
                              bleu=f"{bleu:.2f}", best_valid_nll=f"{nll:.3f}",
                              distinct_hyps=dist))
    out, docs = publish_folders(tmp_path, PAGE)
    write_rows(out / "results.csv", table)
    publish(out, docs)
    block = published_block(docs, "<!-- deep_shallow table: start -->",
                            "<!-- deep_shallow table: end -->")
    assert "(lr 0.001, warmup 2000, 2400 updates;" in block, block
    assert "| 12L-1L | admin-paper | 1 | 24.50 | 3.800 | none | 990 | 19.20 (seed 1) |" in block
    demo = statistics.mean([27.4, 24.4]), statistics.stdev([27.4, 24.4])
    assert (f"| 12L-1L | admin | 1 | 27.00 | 3.600 | none | 1000 | {demo[0]:.2f} +- "
            f"{demo[1]:.2f} (seeds 1,2) |") in block
    ref = statistics.mean([33.26, 33.42]), statistics.stdev([33.26, 33.42])
    assert f"| 24L-3L | admin-paper | 1,2 | {ref[0]:.2f} +- {ref[1]:.2f} |" in block
    assert "| 24L-3L | admin | 1 | 34.08 | 2.994 | none | 1000 | - |" in block
    # stock Post-LN at 12L-1L after the Admin pair; no Post-LN 24L-3L reference
    assert block.index("| 12L-1L | admin | 1 |") < block.index(
        "| 12L-1L | post-ln | 1 | 21.00 | 3.900 | none | 980 | 1.50 (seed 1) |")
    assert "| 24L-3L | post-ln |" not in block and "stock Post-LN at 12L-1L" in block
    # the plan's 24L-1L cells are listed, not run
    assert "| 24L-1L | admin-paper | - | not run yet |" in block
    assert (f"- 12L-1L: admin-paper minus admin, mean BLEU: {24.5 - 27.0:+.2f} at lr 0.001, "
            f"warmup 2000, 2400 updates; {19.2 - demo[0]:+.2f} at the demo recipe.") in block
    assert (f"- 24L-3L: admin-paper minus admin, mean BLEU: {ref[0] - 34.08:+.2f} at lr 0.001, "
            "warmup 2000, 2400 updates; not measured at the demo recipe.") in block
    # without a row of the warmup plan's own cells there is no warmup table
    table = [r for r in table if not (r["depth"] == "12L-1L" and "wu2000" in r["key"])]
    write_rows(out / "results.csv", table)
    publish(out, docs)
    assert "deep-shallow-warmup" not in published_block(
        docs, "<!-- deep_shallow table: start -->", "<!-- deep_shallow table: end -->")


@pytest.mark.parametrize("base,why", [(None, "admin 6L-6L has no deployed speed"),
                                      ("plugin", "admin 6L-6L was timed with another engine")])
def test_fastest_line_says_why_a_ratio_is_missing(bench, base, why):
    from depthstudy.deepshallow import X_FALLBACK, X_SPEED, fastest_line

    groups = {("admin", "6L-6L"): [{"bleu": "30.00"}], ("admin", "12L-1L"): [{"bleu": "29.80"}]}
    speed = {("cells", "admin", "12L-1L", *X_SPEED): {"sentences_per_s": "300.0",
                                                      "ratio_to_6l6l": ""}}
    if base:
        speed["cells", "admin", "6L-6L", *X_FALLBACK] = {"sentences_per_s": "100.0"}
    line = fastest_line(groups, speed)
    assert line.endswith(f"**admin 12L-1L**, mean BLEU 29.80, 300.0 sentences/s (CTranslate2 "
                         f"int8, batch 64, 1 thread), {why}, so no ratio is given.")
    speed["cells", "admin", "6L-6L", *X_SPEED] = {"sentences_per_s": "150.0"}
    assert fastest_line(groups, speed).endswith("2.00 times the speed of admin 6L-6L in the "
                                                "same timing run.")
