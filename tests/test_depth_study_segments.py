"""A depth-study run trained in segments (benchmarks/depthstudy/segments.py): a longer run that
continues the same configuration's shorter run, and a run resumed from its own checkpoint
after its process stopped, each give the losses of one uninterrupted fairseq-train run."""
import csv
import json
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from fairseq_cli_utils import REPO, env, write_fake_multi30k
from study_utils import TINY, load_study_module, study

# the tiny recipe, 4 updates for the shorter run (TINY's --max-update is replaced)
_RECIPE = [a for i, a in enumerate(TINY) if a != "--max-update" and TINY[i - 1] != "--max-update"]
_SHORT, _LONG = 4, 8

# the module fixture runs the study end to end: the file goes to a worker first (conftest.py)
pytestmark = pytest.mark.slow


def _rows(out):
    with open(out / "results.csv", newline="") as fh:
        return {r["key"]: r for r in csv.DictReader(fh)}


def _folder(out, key):
    return out / "runs" / re.sub(r"[^A-Za-z0-9_.-]+", "_", key)


def _losses(text):
    """Every logged train / valid loss of a fairseq json log, by update."""
    out = {}
    for line in text.splitlines():
        m = re.search(r"\| (train_inner|valid) \| (\{.*\})\s*$", line)
        if m:
            stats = json.loads(m.group(2))
            if m.group(1) == "train_inner":
                out[("train", int(stats["num_updates"]))] = stats["loss"]
            else:
                out[("valid", int(stats["valid_num_updates"]))] = stats["valid_loss"]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """admin 2L-1L seed 1: 4 updates, then 8 updates (continuing it), then the same 8-update
    command in a fresh folder (one uninterrupted process: the reference)."""
    tmp = tmp_path_factory.mktemp("segments")
    write_fake_multi30k(tmp / "m30k")
    out = tmp / "out"
    common = ["--data", tmp / "m30k", "--out", out, "--schemes", "admin", *_RECIPE,
              "--keep-checkpoints"]
    study(*common, "--max-update", _SHORT)
    proc = study(*common, "--max-update", _LONG)
    rows = _rows(out)
    long_key = next(k for k in rows if f"|{_LONG}upd|" in k)
    short_key = long_key.replace(f"|{_LONG}upd|", f"|{_SHORT}upd|")
    long_dir = _folder(out, long_key)
    cmd = shlex.split((long_dir / "command.txt").read_text())
    ref_dir = tmp / "reference"
    cmd[cmd.index("--save-dir") + 1] = str(ref_dir / "ckpt")
    ref = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return dict(tmp=tmp, out=out, rows=rows, long_key=long_key, short_key=short_key,
                long_dir=long_dir, stdout=proc.stdout, reference=_losses(ref.stdout + ref.stderr))


def test_the_longer_run_continues_the_shorter_one(runs):
    assert f"continuing {runs['short_key']} from update {_SHORT}" in runs["stdout"]
    segments = json.loads((runs["long_dir"] / "segments.json").read_text())
    assert [(s["start"], s["from"]) for s in segments] == [(0, None),
                                                           (_SHORT, runs["short_key"])]
    row = runs["rows"][runs["long_key"]]
    assert row["resumed_at"] == f"{_SHORT} (continues {runs['short_key']})"
    assert row["updates"] == str(_LONG)
    assert runs["rows"][runs["short_key"]]["resumed_at"] == ""


def test_continued_losses_are_those_of_one_uninterrupted_run(runs):
    curve = json.loads((runs["long_dir"] / "curve.json").read_text())
    got = {("train", p["update"]): p["loss"] for p in curve["train"]}
    got.update({("valid", p["update"]): p["loss"] for p in curve["valid"]})
    want = {k: float(v) for k, v in runs["reference"].items()}
    assert sorted(got) == sorted(want)
    assert got == want


def test_training_time_sums_the_segments(runs):
    row = runs["rows"][runs["long_key"]]
    short = runs["rows"][runs["short_key"]]
    # the first segment is the shorter run: its time is part of the longer run's
    assert float(row["train_wall_s"]) > float(short["train_wall_s"])


def test_a_stopped_run_resumes_from_its_checkpoint(runs):
    """The shorter run's folder, taken as an 8-update run whose process stopped after its
    checkpoint at update 4, is resumed there and ends with the uninterrupted run's losses."""
    out2 = runs["tmp"] / "out2"
    (out2 / "runs").mkdir(parents=True)
    (out2 / "data").symlink_to(runs["out"] / "data")
    stopped = _folder(out2, runs["long_key"])
    shutil.copytree(_folder(runs["out"], runs["short_key"]), stopped)
    (stopped / "segments.json").unlink()
    log = stopped / "train.log"
    log.write_text(re.sub(r".*done training in.*\n", "", log.read_text()))
    cmd = (runs["long_dir"] / "command.txt").read_text()
    (stopped / "command.txt").write_text(cmd.replace(str(runs["out"]), str(out2)))
    proc = study("--data", runs["tmp"] / "m30k", "--out", out2, "--schemes", "admin",
                 *_RECIPE, "--max-update", _LONG, "--keep-checkpoints")
    assert f"resuming from its checkpoint at update {_SHORT}" in proc.stdout
    row = _rows(out2)[runs["long_key"]]
    assert row["resumed_at"] == str(_SHORT)
    curve = json.loads((stopped / "curve.json").read_text())
    got = {("train", p["update"]): p["loss"] for p in curve["train"]}
    got.update({("valid", p["update"]): p["loss"] for p in curve["valid"]})
    assert got == {k: float(v) for k, v in runs["reference"].items()}


def test_curve_takes_each_segment_up_to_the_next_start(tmp_path):
    """What a stopped process logged after its last checkpoint is not part of the curve, and
    its training time is counted up to that checkpoint."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from depthstudy import segments

    def line(tag, update, loss, wall):
        key = "num_updates" if tag == "train_inner" else "valid_num_updates"
        stats = ({"loss": loss, "nll_loss": loss, "wall": wall} if tag == "train_inner"
                 else {"valid_loss": loss, "valid_nll_loss": loss, "valid_ppl": 2.0})
        return f"x | INFO | {tag} | {json.dumps(dict(stats, **{key: update}))}\n"

    (tmp_path / "train.log").write_text(
        line("train_inner", 10, 5.0, 30) + line("valid", 10, 4.0, 0)
        + "Saved checkpoint /x/checkpoint_1_10.pt (epoch 1 @ 10 updates, score 4.0)\n"
        + line("train_inner", 20, 3.0, 60))
    (tmp_path / "train.2.log").write_text(line("train_inner", 20, 3.5, 25)
                                          + "done training in 40.5 seconds\n")
    assert segments.saved_update((tmp_path / "train.log").read_text()) == 10
    segments.write(tmp_path, [{"log": "train.log", "start": 0, "from": None}])
    segments.next_log(tmp_path, 10)
    curve = segments.curve(tmp_path)
    assert [(p["update"], p["loss"]) for p in curve["train"]] == [(10, 5.0), (20, 3.5)]
    assert [p["update"] for p in curve["valid"]] == [10]
    assert segments.wall_seconds(tmp_path) == 30 + 40.5
    assert segments.resumed_at(tmp_path) == "10"


def test_a_segment_stopped_before_its_first_update_is_replaced(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from depthstudy import segments

    segments.next_log(tmp_path, 0).write_text("started\n")
    segments.next_log(tmp_path, 0, "shorter")
    assert segments.read(tmp_path) == [{"log": "train.log", "start": 0, "from": "shorter"}]


def test_converged_plan_checks_the_length_before_the_grid():
    module = load_study_module()
    from depthstudy.plan import CONVERGED_LENGTHS, POST_LN_DEEP

    plan = module.PLANS["converged"]
    check = [(s, d, seed, n) for s, d, seed, _, n in plan[:4]]
    assert check == [("admin", "6L-6L", 1, 2400), ("admin", "6L-6L", 1, 4800),
                     ("admin", "18L-18L", 1, 2400), ("admin", "18L-18L", 1, 4800)]
    cells = {(s, d) for s, d, *_ in plan}
    # at a length above the first, 12L-12L is Admin's alone
    shared = ("12L-12L",) if CONVERGED_LENGTHS == (2400,) else ()
    assert cells == ({(s, d) for s in ("post-ln", "pre-ln", "admin")
                      for d in ("6L-6L", "18L-18L") + shared} | {("admin", "12L-12L")}
                     | {(s, d) for s in ("admin", "pre-ln") for d in ("12L-1L", "48L-1L")})
    assert len(plan) == len(set(plan))
    long = CONVERGED_LENGTHS != (2400,)
    # Post-LN 18L-18L after everything else only where it may be skipped (12L-12L shared)
    grid = [item for item in plan[4:] if long or item[:2] != POST_LN_DEEP]
    assert {item[4] for item in plan[4:]} == set(CONVERGED_LENGTHS)
    # every cell's first seed before any second seed
    assert [item[2] for item in grid] == sorted(item[2] for item in grid)
    assert plan[4 + len(grid):] == ([] if long else
                                    [item for item in plan if item[:2] == POST_LN_DEEP])
    recipe = module.PLAN_RECIPES["converged"]
    assert (recipe["lr"], recipe["warmup"], recipe["validate_every"]) == (1e-3, 2000, 200)


@pytest.mark.parametrize("rc,finished,written,ok", [
    (0, True, True, True),
    (-6, True, True, True),     # aborted at exit after it finished and wrote the profile
    (-6, False, True, False),   # aborted before it finished: the file is not trusted
    (-6, True, False, False),   # finished without writing the file
    (0, True, False, False),
])
def test_profile_measurement_survives_only_an_abort_after_it_finished(
        tmp_path, monkeypatch, rc, finished, written, ok):
    module = load_study_module()
    from depthstudy import runner

    def fake_run(cmd, env, log_file=None, echo=False):
        path = cmd[cmd.index("--admin-profile-path") + 1]
        if written:
            open(path, "w").write('{"encoder": [1.0], "decoder": [1.0]}')
        text = "done training in 0.1 seconds\n" if finished else "begin training epoch 1\n"
        return rc, text + "terminate called without an active exception\n", ""

    monkeypatch.setattr(runner, "run_checked", fake_run)
    monkeypatch.setattr(runner, "train_command",
                        lambda *a: ["fairseq-train", "--max-update", "700"])
    args = module.parse_args(["--out", str(tmp_path), "--threads", "1"])[1]
    key = runner.run_key("admin-paper", "2L-2L", 1, args)
    if ok:
        path = runner.measure_profile(args, tmp_path, "admin-paper", "2L-2L", 1, "sinusoidal")
        assert json.loads(path.read_text()) == {"encoder": [1.0], "decoder": [1.0]}
        assert re.sub(r"[^A-Za-z0-9_.-]+", "_", key) + ".json" == path.name
        assert [p.name for p in tmp_path.joinpath("profiles").iterdir()
                if p.is_dir()] == []  # its work folder removed
    else:
        with pytest.raises(RuntimeError, match="measuring the profile"):
            runner.measure_profile(args, tmp_path, "admin-paper", "2L-2L", 1, "sinusoidal")


@pytest.mark.parametrize("cells,expected", [
    # a seed: that cell's runs at every length of the plan, in the plan's order
    ("admin:12L-1L:2,pre-ln:12L-1L:2",
     [("admin", "12L-1L", 2), ("pre-ln", "12L-1L", 2)]),
    # no seed: every seed of the cell; the order is the plan's, not the flag's
    ("pre-ln:48L-1L, admin:48L-1L",
     [("admin", "48L-1L", 1), ("pre-ln", "48L-1L", 1), ("admin", "48L-1L", 2),
      ("pre-ln", "48L-1L", 2)]),
])
def test_cells_narrow_the_plan_to_their_runs_in_plan_order(cells, expected):
    module = load_study_module()
    from depthstudy.plan import CONVERGED_LENGTHS

    plan = module.PLANS["converged"]
    got = module.only_cells(plan, cells)
    assert got == [(s, d, seed, "sinusoidal", n) for s, d, seed in expected
                   for n in CONVERGED_LENGTHS]
    assert got == [g for g in plan if g in got]


def test_cells_reach_the_grid_runner_and_the_report_keeps_the_whole_plan(tmp_path, monkeypatch):
    """``main`` hands only the chosen cells' runs to the runner; the report (its list of
    missing runs) still covers the whole plan."""
    module = load_study_module()
    seen = {}
    monkeypatch.setattr(module, "check_data", lambda data: None)
    monkeypatch.setattr(module, "prepare_data", lambda *a: tmp_path / "data")
    monkeypatch.setattr(module, "unigram_entropy_bits", lambda root: 8.0)
    monkeypatch.setattr(module, "run_grid", lambda args, root, grid, *a: seen.update(run=grid))
    monkeypatch.setattr(module, "report", lambda args, grid, csv: seen.update(report=grid))
    module.main(["--plan", "converged", "--out", str(tmp_path / "out"),
                 "--cells", "post-ln:6L-6L:2"])
    assert [g[:3] for g in seen["run"]] == [("post-ln", "6L-6L", 2)] * len(seen["run"])
    assert len(seen["run"]) >= 1 and seen["report"] == module.PLANS["converged"]


@pytest.mark.parametrize("argv,message", [
    (["--plan", "converged", "--cells", "admin:13L-1L"],
     "--cells: 'admin:13L-1L' is no cell of this grid; valid choices (the seed may be left "
     "out): admin:6L-6L:1, admin:18L-18L:1, "),
    (["--plan", "converged", "--cells", "admin:12L-1L:3"], "--cells: 'admin:12L-1L:3' is no cell"),
    (["--plan", "converged", "--cells", ","], "--cells: no cell given"),
    (["--cells", "admin:12L-1L:1"], "--cells selects runs of a --plan; without one use "
                                    "--schemes, --depths and --seeds"),
])
def test_a_bad_cell_is_one_line_naming_the_flag_and_leaves_nothing(tmp_path, argv, message):
    out = tmp_path / "out"
    proc = study(*argv, "--out", out, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert line.startswith("depth_study.py: error: " + message), line
    assert not out.exists()
