"""The converged-schedule page (benchmarks/depthstudy/converged.py): every number of its
blocks recomputed here from the rows and curves it was given."""
import json
import statistics
import sys

import pytest

from fairseq_cli_utils import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from depthstudy import converged  # noqa: E402


def _row(scheme, depth, seed, updates, bleu, status="trained", lr="0.001", ve="200"):
    key = f"{scheme}|{depth}|seed{seed}|{updates}upd|d128|lr{lr}|wu2000|mt4096|ve{ve}"
    return {"key": key, "scheme": scheme, "depth": depth, "seed": str(seed),
            "max_update": str(updates), "lr": lr, "warmup": "2000", "validate_every": ve,
            "embed_dim": "128", "positions": "sinusoidal", "dropout": "0.1",
            "clip_norm": "0", "status": status, "bleu": f"{bleu:.2f}",
            "best_valid_nll": "3.100", "final_train_nll": "2.900",
            "curve_file": f"runs/{key.replace('|', '_')}/curve.json"}


@pytest.fixture
def page(tmp_path):
    out, docs = tmp_path / "out", tmp_path / "docs"
    docs.mkdir()
    text = "# t\n" + "".join(f"{converged.MARK.format(n, 'start')}\nold\n"
                             f"{converged.MARK.format(n, 'end')}\n"
                             for n in ("check", "table", "nll", "collapse"))
    (docs / "depth_converged.md").write_text(text)
    rows = [_row("admin", "6L-6L", 1, 2400, 31.0), _row("admin", "6L-6L", 1, 4800, 31.8),
            _row("admin", "6L-6L", 2, 2400, 30.2), _row("pre-ln", "48L-1L", 1, 2400, 12.0),
            _row("admin", "48L-1L", 1, 2400, 1.5, status="stuck"),
            # another schedule: not part of the page
            _row("admin", "6L-6L", 3, 2400, 10.0, lr="0.002"),
            _row("admin", "6L-6L", 3, 2400, 10.0, ve="")]
    curves = {
        # validation nll rises after its best: over-fitting
        rows[0]["key"]: dict(train=[], valid=[dict(update=u, nll=n, loss=n, ppl=1) for u, n in
                                              ((200, 5.0), (400, 3.0), (600, 3.2))]),
        # best at the last validation: still improving
        rows[1]["key"]: dict(train=[], valid=[dict(update=u, nll=n, loss=n, ppl=1) for u, n in
                                              ((200, 5.0), (400, 3.0), (4800, 2.8))]),
        # the encoder cosine above 0.9 for every logged interval after the warmup
        rows[4]["key"]: dict(train=[dict(update=u, loss=1, nll=1, enc_tok_cos=c) for u, c in
                                    ((1990, 0.5), (2000, 0.6), (2010, 0.97), (2020, 0.99),
                                     (2400, 0.98))],
                             valid=[dict(update=2400, nll=7.0, loss=7.0, ppl=1)]),
        rows[3]["key"]: dict(train=[dict(update=u, loss=1, nll=1, enc_tok_cos=c) for u, c in
                                    ((1000, 0.95), (2010, 0.5), (2400, 0.4))],
                             valid=[dict(update=2400, nll=3.5, loss=3.5, ppl=1)]),
    }
    for r in rows:
        if r["key"] in curves:
            path = out / r["curve_file"]
            path.parent.mkdir(parents=True)
            path.write_text(json.dumps(curves[r["key"]]))
    converged.fill(docs / "depth_converged.md", rows, out, docs)
    return (docs / "depth_converged.md").read_text()


def _block(text, name):
    return text.split(converged.MARK.format(name, "start"))[1].split(
        converged.MARK.format(name, "end"))[0]


def test_check_gives_both_lengths_and_the_gain(page):
    line = next(l for l in _block(page, "check").splitlines() if l.startswith("| 6L-6L"))
    assert "| 31.00 | 31.80 | +0.80 |" in line
    assert "18L-18L | not run yet | not run yet | - |" in _block(page, "check")


def test_table_cells_are_mean_and_sample_std_over_the_recipes_seeds(page):
    line = next(l for l in _block(page, "table").splitlines() if l.startswith("| admin"))
    cells = [c.strip() for c in line.strip("|").split("|")][1:]
    mean, std = statistics.mean([31.0, 30.2]), statistics.stdev([31.0, 30.2])
    assert cells[0] == f"{mean:.2f} +- {std:.2f} (n=2); paper 27.90"
    assert cells[4] == "1.50 (n=1), 1 stuck"
    assert cells[1] == "not run yet; paper 28.58"
    assert "admin 6L-6L seed 2 (4800)" not in page  # not part of the plan
    assert "admin 18L-18L seed 1 (2400)" in _block(page, "table")


def test_nll_block_tells_over_fitting_from_under_training(page):
    block = _block(page, "nll")
    assert "| admin | 6L-6L | 1 | 2400 | 2.900 | 3.000 (400) | 3.200 | over-fitting" in block
    assert "| admin | 6L-6L | 1 | 4800 | 2.900 | 2.800 (4800) | 2.800 | still improving" in block


def test_collapse_block_replays_the_monitor_warning(page):
    block = _block(page, "collapse")
    # whole logged intervals above 0.9 after the 2000-update warmup start at update 2010
    assert "| admin | 1 | 1.50 | 0.990 (2020) | 0.980 | 2010 |" in block
    assert "| pre-ln | 1 | 12.00 | 0.950 (1000) | 0.400 | not warned |" in block
