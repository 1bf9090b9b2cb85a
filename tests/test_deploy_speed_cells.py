"""benchmarks/deploy_speed.py's depth modes on tiny models (runs merged into a CSV, the
published CSVs and publishing: test_deploy_speed_runs.py, test_deploy_speed_publish.py).

* ``--study-out OUT --cells ... --quick`` on a study folder laid out as depth_study.py writes
  it (results.csv, runs/<run>/ckpt/checkpoint_best.pt, data/{bin,spm,raw}) with tiny trained
  checkpoints, merged into a CSV that holds an earlier run: the earlier run's rows are kept as
  they were, the new run's rows carry one new run id; the CSV has the expected columns, one
  row per cell x engine x precision x batch x threads; each cell's timed seed is its lowest
  trained one; a scheme the export refuses (b2t) is timed through the plugin only and says
  so; ratios to 6L-6L (within the new run only) and milliseconds per sentence are the
  division of the row's own figures; CTranslate2's fairseq last step is counted (the
  sentences that reach the length limit, recounted here through ``score_batch`` calls) and
  timed within the row's seconds;
* ``--wmt-shapes --quick``: every output of CTranslate2 has exactly the requested length
  (checked on a trained model whose own outputs are shorter and longer than requested, and
  through the whole mode), batches never mix lengths, and the batch column is a cap whose
  real mean is ``mean_batch``; ``--run-label`` is checked.
"""
from __future__ import annotations

import contextlib
import csv
import io
import re
import shutil
from pathlib import Path

import pytest

from deploy_speed_utils import FIELDS, bench, read_csv, recipe_key, run_folder  # noqa: F401
from fairseq_cli_utils import TINY_MODEL, run, train, write_reversal_corpus

ctranslate2 = pytest.importorskip("ctranslate2")

#: the run already in the CSV the fixture's run is merged into: an admin 6L-6L far slower
#: than the new run's, so a ratio across the two runs would show
EARLIER = "20200101T000000Z-earlier"
EARLIER_ROWS = [
    dict(run=EARLIER, kind="cells", shape=shape, scheme="admin", seed=seed, engine="CTranslate2",
         precision="int8", batch="64", threads="1", sentences="24", rounds="1",
         sentences_per_s=sps, ms_per_sentence=f"{1000 / float(sps):.6g}", ratio_to_6l6l=ratio,
         round_values=sps, fallback_sentences="", fallback_seconds="", note="", cpu="old CPU")
    for shape, seed, sps, ratio in (("6L-6L", "2", "1.5", "1.000"), ("12L-1L", "1", "3", "2.000"))]


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

    from fairseq_admin_pos.export import ct2

    scored = []  # the sentences of each score_batch call: one per sentence at the limit
    real_translate = ct2.translate

    def counting(translator, *a, **kw):
        class Counted:
            def translate_batch(self, *a, **kw):
                return translator.translate_batch(*a, **kw)

            def score_batch(self, sources, targets):
                scored.append(sources[0])
                return translator.score_batch(sources, targets)

        return real_translate(Counted(), *a, **kw)

    work = tmp_path_factory.mktemp("deploy_work")
    csv_path = work / "deploy_speed_cells.csv"
    with open(csv_path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(EARLIER_ROWS)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.MonkeyPatch.context() as mp:
        mp.setattr(deployspeed.timing, "run_process", forked)
        mp.setattr(ct2, "translate", counting)
        bench.main(["--study-out", str(study_out), "--cells",
                    "admin:6L-6L,admin:12L-1L,b2t:6L-6L,post-ln:24L-1L", "--quick",
                    "--work", str(work)])
    every = read_csv(csv_path)
    return dict(rows=[r for r in every if r["run"] != EARLIER], every=every, work=work,
                stdout=printed.getvalue(), scored=len(scored))


def test_cells_run_is_merged_into_the_csv(cells_run):
    """The earlier run's rows first and unchanged, then the new run's, one run id (UTC start
    time and the default label), printed with the merge's counts."""
    every, rows = cells_run["every"], cells_run["rows"]
    assert every[:2] == [{f: r.get(f, "") for f in FIELDS} for r in EARLIER_ROWS]
    assert every[2:] == rows and len(rows) == 14
    (run_id,) = {r["run"] for r in rows}
    assert re.fullmatch(r"\d{8}T\d{6}Z-cells", run_id), run_id
    assert (f"14 rows of run {run_id} merged into {cells_run['work'] / 'deploy_speed_cells.csv'} "
            "(16 rows, 2 runs)") in cells_run["stdout"]


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
    """Within the new run: the earlier run's admin 6L-6L (1.5 sentences/s) is never the
    base."""
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


def test_fallback_is_counted_and_timed_apart(cells_run):
    """CTranslate2's rows count the sentences that took translate()'s fairseq last step (all
    of them together: the score_batch calls made, one per such sentence) and its seconds,
    within the row's own seconds; the plugin's rows have no such step."""
    ct2_rows = [r for r in cells_run["rows"] if r["engine"] == "CTranslate2"]
    assert len(ct2_rows) == 8
    assert sum(int(r["fallback_sentences"]) for r in ct2_rows) == cells_run["scored"] >= 1
    for r in ct2_rows:
        seconds = int(r["sentences"]) / float(r["sentences_per_s"])  # one round
        assert 0 <= float(r["fallback_seconds"]) < seconds
        assert (float(r["fallback_seconds"]) > 0) == (int(r["fallback_sentences"]) > 0)
    for r in cells_run["rows"]:
        if r["engine"] == "fairseq + plugin":
            assert (r["fallback_sentences"], r["fallback_seconds"]) == ("0", "0")


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
    """Every shape x precision x batch; the batch column is the cap, ``mean_batch`` the
    batches' real mean size (one output length each), and the note says so."""
    bench.main(["--wmt-shapes", "--quick", "--text", str(study_out / "data" / "spm"),
                "--work", str(tmp_path), "--run-label", "tiny.shapes"])
    rows = read_csv(tmp_path / "deploy_speed_shapes.csv")
    (run_id,) = {r["run"] for r in rows}
    assert re.fullmatch(r"\d{8}T\d{6}Z-tiny\.shapes", run_id), run_id
    for r in rows:  # fixed lengths: no sentence reaches a limit
        assert (r["fallback_sentences"], r["fallback_seconds"]) == ("0", "0")
        assert f"at most {r['batch']} sentence(s) each (their mean size: mean_batch)" in r["note"]
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


def test_run_label_is_checked(bench, study_out, tmp_path, capsys):
    with pytest.raises(SystemExit, match="--run-label: 'a b' is not letters, digits"):
        bench.main(["--wmt-shapes", "--quick", "--text", str(study_out / "data" / "spm"),
                    "--work", str(tmp_path), "--run-label", "a b"])
    with pytest.raises(SystemExit):
        bench.main(["--run-label", "x"])  # the demo's comparison has no runs
    assert "--run-label apply to --study-out and --wmt-shapes" in capsys.readouterr().err


def test_converged_plan_times_the_grid_length_of_each_cell(bench, tmp_path):
    """``--plan converged``: a cell's checkpoint is the run at the grid's length, not the
    convergence check's longer (or shorter) run of the same configuration."""
    from depthstudy.deepshallow import plan_args, plan_cells
    from depthstudy.plan import CONVERGED_LONG, CONVERGED_UPDATES, run_key
    from depthstudy.report import write_rows
    from deployspeed.cells import pick_checkpoints

    # at a length above the first, 12L-12L is Admin's alone
    shared = () if CONVERGED_LONG else ("12L-12L",)
    assert {c[:2] for c in plan_cells("converged")} == {
        (s, d) for s in ("admin", "pre-ln") for d in ("6L-6L", "18L-18L", "12L-1L", "48L-1L")
        + shared} | {("post-ln", d) for d in ("6L-6L", "18L-18L") + shared} | {
        ("admin", "12L-12L")}
    rows = []
    for updates in sorted({CONVERGED_UPDATES, 2 * CONVERGED_UPDATES, CONVERGED_UPDATES // 2}):
        args = plan_args("converged")
        args.max_update = updates
        key = run_key("admin", "6L-6L", 1, args)
        (tmp_path / run_folder(key) / "ckpt").mkdir(parents=True)
        (tmp_path / run_folder(key) / "ckpt" / "checkpoint_best.pt").write_bytes(b"x")
        rows.append(dict(key=key, scheme="admin", positions="sinusoidal", depth="6L-6L",
                         seed=1, status="trained", max_update=updates))
    write_rows(tmp_path / "results.csv", rows)
    picked, missing = pick_checkpoints([tmp_path], "converged", "admin:6L-6L,admin:12L-1L")
    assert [p["row"]["max_update"] for p in picked] == [str(CONVERGED_UPDATES)]
    assert [m[:2] for m in missing] == [("admin", "12L-1L")]
