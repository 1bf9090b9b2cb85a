"""fairseq-admin-export on checkpoints written by fairseq-train, read back the ways users do.

* a trained ``--admin-omega parameter`` model (Admin closed form, shared embeddings; its
  omega vectors are no longer uniform) and a profiled one (``--admin-init profile``, scalar
  omegas from the first batch, scaled-sinusoid positions) are exported with the console
  script and the command;
* the exported file loads with ``torch.load``'s default ``weights_only=True`` in a fresh
  interpreter that never imports this package (the package registers an allow-list when
  imported), and plain ``fairseq-generate`` without ``--user-dir`` (forked from
  ``cli_zygote.py``, which does not import the package either) gives the hypotheses the
  plugin gives on the original checkpoint;
* the exported model's log-probabilities match the original's on a padded batch, in full
  and incremental decoding (exact fold: 1e-5; the profiled model's scalar fold: the eps
  tolerance of test_export_fold.py, and 1e-5 with eps / w^2);
* CTranslate2 (the deploy extra) returns fairseq's beam output with the matched settings of
  ``fairseq_admin_pos.export.ct2`` on the tiny test set (fairseq's forced EOS at the length
  limit included), and its forced-decoding log-probabilities equal fairseq's; the forced-EOS
  step (counted apart with ``FallbackTime``, the results unchanged) and fairseq's batching
  are also checked on hand-made CTranslate2 results;
* refused schemes, bad arguments and a CTranslate2 conversion that fails exit non-zero with
  one line and leave no file (nor a temporary one) behind.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from export_utils import (
    EXACT,
    assert_same_hypotheses,
    eps_tolerance,
    incremental_logprobs,
    logprobs,
    max_diff,
    padded_batch,
    set_eps,
    unpadded_targets,
)
from fairseq_cli_utils import REPO, TINY_MODEL, env, hypotheses, run, train
from model_utils import build_trainer

ctranslate2 = pytest.importorskip("ctranslate2")

from fairseq_admin_pos.cli import export as export_cli  # noqa: E402
from fairseq_admin_pos.export.ct2 import FallbackTime, translate  # noqa: E402

BEAM, LENPEN, MAX_LEN_B = 3, 0.6, 30
GENERATE = ["--beam", str(BEAM), "--lenpen", str(LENPEN), "--max-len-a", "0",
            "--max-len-b", str(MAX_LEN_B), "--cpu", "--batch-size", "8", "--num-workers", "0"]


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """Two fairseq-train runs: ``admin`` (closed form, omega vectors, shared embeddings, 60
    updates: it ends its hypotheses with EOS) and ``profile`` (profiled scalar omegas,
    scaled-sinusoid positions, 8 updates)."""
    root = tmp_path_factory.mktemp("export")
    train(tiny_data, root / "admin", "admin_transformer", [
        *TINY_MODEL, "--admin-omega", "parameter", "--share-all-embeddings", "--lr", "5e-3"],
        max_update=60)
    train(tiny_data, root / "profile", "admin_transformer", [
        *TINY_MODEL, "--admin-init", "profile", "--admin-omega", "buffer",
        "--encoder-pos-emb", "scaled-sinusoidal",
        "--decoder-pos-emb", "learned"], max_update=8)
    return root


@pytest.fixture(scope="module")
def exported(runs):
    """The admin run exported by the console script (with a CTranslate2 model) and the
    profiled run by ``python -m fairseq_admin_pos.cli.export``."""
    tool = Path(sys.executable).parent / "fairseq-admin-export"
    proc = subprocess.run([str(tool), runs / "admin" / "checkpoint_last.pt", "--out",
                           runs / "admin.pt", "--ctranslate2", runs / "admin-ct2"],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    profiled = run("fairseq_admin_pos.cli.export", [
        runs / "profile" / "checkpoint_last.pt", "--out", runs / "profile.pt"])
    return {"admin": proc.stdout, "profile": profiled.stdout}


def load_original_and_export(path: Path, original: Path, data: Path):
    from fairseq import checkpoint_utils

    import fairseq_admin_pos

    fairseq_admin_pos.register()
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(original)])
    stock, _, _ = checkpoint_utils.load_model_ensemble_and_task([str(path)])
    return models[0].eval(), stock[0].eval(), task


def test_console_script_reports_the_fold(runs, exported):
    out = exported["admin"]
    assert "admin model -> stock transformer (encoder learned, decoder learned positions; " \
           "per-side embedding tables)" in out
    assert "exact up to float32 rounding" in out
    assert f"wrote {runs / 'admin.pt'}" in out and f"wrote {runs / 'admin-ct2'}" in out
    assert "scalar omega" not in out
    # the profiled model's sub-layers whose omega is not 1 (the first of each stack is)
    n = len(profiled_omegas(runs)) - 2
    assert f"scalar omega 1/w folded into out_proj/fc2 of {n} sub-layers" in exported["profile"]
    assert f"{n} LayerNorms differ by their eps term" in exported["profile"]
    assert sorted(p.name for p in runs.iterdir() if p.name.startswith(".")) == []


def test_trained_omegas_are_not_uniform(runs):
    from fairseq_cli_utils import load_model_state

    state = load_model_state(runs / "admin" / "checkpoint_last.pt")
    omegas = [v for k, v in state.items() if k.endswith(".omega")]
    assert len(omegas) == 10 and all(v.numel() == 32 for v in omegas)
    assert min(float(v.std()) for v in omegas) > 1e-4
    values = list(profiled_omegas(runs).values())
    # 2 x 2 encoder + 3 x 2 decoder sub-layers; profiling leaves each stack's first at 1
    assert len(values) == 10 and values.count(1.0) == 2 and len(set(values)) == 9


def profiled_omegas(runs):
    from fairseq_cli_utils import load_model_state

    state = load_model_state(runs / "profile" / "checkpoint_last.pt")
    assert int(state["admin_profiled"]) == 1
    return {k: float(v) for k, v in state.items() if k.endswith(".omega")}


def test_loads_weights_only_without_the_package(tiny_data, runs, exported):
    """A fresh interpreter: torch.load with its defaults (weights_only=True on torch 2.13),
    no allow-list, the package never imported; the config is plain containers, the data
    path the original's."""
    code = ("import sys, torch\n"
            "for path in sys.argv[2:]:\n"
            "    s = torch.load(path)\n"
            "    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []\n"
            "    m = s['cfg']['model']\n"
            "    assert m['data'] == m.data == s['cfg']['task']['data'] == sys.argv[1]\n"
            "    print(m['_name'], m.arch, m.user_dir, sorted(k for k in m if k.startswith("
            "('admin', 'pos_emb')) or k.endswith('pos_emb')), 'last_optimizer_state' in s)\n"
            "assert 'fairseq_admin_pos' not in sys.modules\n")
    e = env()
    e.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", code, str(tiny_data), str(runs / "admin.pt"),
                           str(runs / "profile.pt")], cwd="/", env=e, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["transformer transformer None [] False"] * 2


def test_ctranslate2s_own_converter_reads_the_export(tiny_data, runs, exported, tmp_path):
    """CTranslate2's console converter in its own process (no user dir, weights_only as
    CTranslate2 sets it) reads the export and writes the model fairseq-admin-export wrote."""
    proc = subprocess.run([str(Path(sys.executable).parent / "ct2-fairseq-converter"),
                           "--model_path", str(runs / "admin.pt"), "--data_dir", str(tiny_data),
                           "--output_dir", str(tmp_path / "ct2")],
                          cwd="/", env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("model.bin", "config.json", "shared_vocabulary.json"):
        assert (tmp_path / "ct2" / name).read_bytes() == \
            (runs / "admin-ct2" / name).read_bytes(), name


@pytest.fixture(scope="module")
def plain_generate(tiny_data, runs, exported):
    """fairseq-generate without --user-dir on each export: hypotheses per name."""
    out = {}
    for name in ("admin", "profile"):
        proc = run("fairseq_cli.generate", [tiny_data, "--path", runs / f"{name}.pt", *GENERATE])
        assert "fairseq_admin_pos" not in proc.stdout + proc.stderr
        out[name] = hypotheses(proc.stdout)
    return out


@pytest.mark.parametrize("name", ["admin", "profile"])
def test_plain_fairseq_generate_gives_the_plugins_hypotheses(tiny_data, runs, plain_generate,
                                                            name):
    plugin = run("fairseq_cli.generate", [
        tiny_data, "--user-dir", REPO / "fairseq_admin_pos", "--path",
        runs / name / "checkpoint_last.pt", *GENERATE]).stdout
    assert_same_hypotheses(hypotheses(plugin), plain_generate[name], 24)


def test_exported_log_probs(tiny_data, runs, exported):
    original, stock, task = load_original_and_export(
        runs / "admin.pt", runs / "admin" / "checkpoint_last.pt", tiny_data)
    batch, mask = padded_batch(task)
    assert max_diff(logprobs(stock, batch), logprobs(original, batch), mask) <= EXACT
    steps = unpadded_targets(batch, task)
    assert max_diff(incremental_logprobs(stock, steps), logprobs(original, steps),
                    torch.ones_like(mask)) <= EXACT


def test_profiled_export_log_probs(tiny_data, runs, exported):
    """The profiled scalar omegas fold into out_proj/fc2: within the eps tolerance with
    fairseq's eps, exact with eps / w^2 in the LayerNorms the export lists."""
    from fairseq_admin_pos.export.fold import FoldResult

    original, stock, task = load_original_and_export(
        runs / "profile.pt", runs / "profile" / "checkpoint_last.pt", tiny_data)
    saved = torch.load(runs / "profile.pt")["admin_export"]
    fold = FoldResult(state_dict={}, positions={}, unshared=False,
                      eps_scales=saved["eps_scales"])
    assert len(fold.eps_scales) == 8
    batch, mask = padded_batch(task)
    reference = logprobs(original, batch)
    assert max_diff(logprobs(stock, batch), reference, mask) <= eps_tolerance(
        stock, fold, batch, mask)
    set_eps(stock, fold, exact=True)
    assert max_diff(logprobs(stock, batch), reference, mask) <= EXACT


def test_ctranslate2_gives_fairseqs_beam_output(tiny_raw, runs, plain_generate):
    """Plain fairseq-generate on the export and CTranslate2 with the settings of
    fairseq_admin_pos.export.ct2 (beam 3, lenpen 0.6, at most 30 tokens): every hypothesis
    is the same, those that reach the limit (where fairseq forces EOS and translate() does
    the same after CTranslate2's search) included, and CTranslate2's forced-decoding scores
    of it, length-normalised the fairseq way (EOS counted), equal fairseq's scores (base 2
    there) and, for those that reached the limit, the score translate() reports (the others
    carry CTranslate2's beam score, renormalised after masking: README)."""
    plain = plain_generate["admin"]
    sources = [line.split() for line in (tiny_raw / "test.src").read_text().splitlines()]
    translator = ctranslate2.Translator(str(runs / "admin-ct2"), device="cpu",
                                        compute_type="float32", intra_threads=1)
    ours = translate(translator, sources, BEAM, LENPEN, max_len_a=0, max_len_b=MAX_LEN_B)
    assert len(ours) == len(plain) == 24
    scored = translator.score_batch(sources, [tokens for tokens, _ in ours])
    at_limit = 0
    for hyp, (tokens, reported), sc in zip(plain, ours, scored):
        score, text = hyp.split("\t")
        assert tokens == text.split(), (hyp, tokens)
        n = len(tokens) + 1  # with EOS
        assert len(sc.log_probs) == n
        normalised = sum(sc.log_probs) / n ** LENPEN
        assert abs(normalised / math.log(2) - float(score)) < 1e-4
        if len(tokens) == MAX_LEN_B:  # scored by translate() through forced decoding
            at_limit += 1
            assert abs(normalised - reported) < 1e-4
    # the tiny model runs away on some sentences: the forced-EOS path is exercised
    assert at_limit >= 1
    # timed apart (FallbackTime): the same results; the sentences counted are those forced
    # decoding was run for (one score_batch call each)
    calls = []

    class Counted:
        def translate_batch(self, *args, **kw):
            return translator.translate_batch(*args, **kw)

        def score_batch(self, sources, targets):
            calls.append(len(sources))
            return translator.score_batch(sources, targets)

    fallback = FallbackTime()
    assert translate(Counted(), sources, BEAM, LENPEN, max_len_a=0, max_len_b=MAX_LEN_B,
                     fallback=fallback) == ours
    assert fallback.sentences == len(calls) >= 1 and fallback.seconds > 0


def test_forced_eos_is_fairseqs_last_step():
    """translate()'s fairseq last step on hand-made CTranslate2 results (a stand-in
    translator with fixed log-probabilities). Limit 3 = max_len 2 + 1. A best hypothesis
    that reached the limit loses its free token, the same search stopped one step earlier
    adds the live beams, and every candidate gets EOS and fairseq's normalised score: the
    winner can be a live beam only the earlier search shows (s1) or a hypothesis that
    finished before the limit (s3). A best that finished with EOS (s2) is returned as it
    is, without a second search or forced decoding."""
    from types import SimpleNamespace

    lp = {("a",): [-1.0, -0.5], ("a", "b"): [-1.0, -0.2, -3.0], ("c", "d"): [-0.3, -0.3, -3.0],
          ("e", "f"): [-0.2, -0.2, -0.2]}
    searches = {  # (source, limit) -> CTranslate2's hypotheses and scores, EOS returned
        ("s1", 3): [["a", "b", "x"], ["a", "b", "z"], ["a", "</s>"]],
        ("s1", 2): [["a", "b"], ["e", "f"], ["a", "</s>"]],
        ("s2", 3): [["c", "</s>"], ["a", "b", "x"], ["a", "</s>"]],
        ("s3", 3): [["a", "b", "x"], ["a", "</s>"], ["c", "d", "y"]],
        ("s3", 2): [["a", "b"], ["a", "</s>"], ["c", "d"]],
    }

    class Stub:
        def __init__(self):
            self.calls, self.scored = [], []

        def translate_batch(self, batch, max_decoding_length, **kw):
            assert kw["return_end_token"] and kw["num_hypotheses"] == 3
            self.calls.append((max_decoding_length, [s for s, in batch]))
            return [SimpleNamespace(hypotheses=searches[s, max_decoding_length],
                                    scores=[-0.1, -0.2, -0.3]) for s, in batch]

        def score_batch(self, sources, targets):
            self.scored += [tuple(t) for t in targets]
            return [SimpleNamespace(log_probs=lp[tuple(t)]) for t in targets]

    stub = Stub()
    out = translate(stub, [["s1"], ["s2"], ["s3"]], beam=3, lenpen=0.6, max_len_b=2)
    assert stub.calls == [(3, ["s1", "s2", "s3"]), (2, ["s1", "s3"])]
    assert out[0][0] == ["e", "f"] and out[0][1] == pytest.approx(-0.6 / 3 ** 0.6)
    assert out[1] == (["c"], -0.1)
    # "a </s>" -1.5 / 2**0.6 beats "a b </s>" -4.2 / 3**0.6 and "c d </s>" -3.6 / 3**0.6
    assert out[2][0] == ["a"] and out[2][1] == pytest.approx(-1.5 / 2 ** 0.6)
    assert stub.scored == [("a", "b"), ("a",), ("e", "f"), ("a", "b"), ("a",), ("c", "d")]


@pytest.mark.parametrize("references, batches", [
    (None, [["x", "y"], ["z"]]),
    ([["r"] * 3, ["r"], ["r"] * 2], [["y", "z"], ["x"]]),
])
def test_translate_batches_like_fairseq(references, batches):
    """Sentences of one source length go into batches in input order, as
    fairseq-interactive batches them, or by reference length, as fairseq-generate batches a
    split with targets (the batch sets the length limit); a reference count that does not
    match is refused."""
    from types import SimpleNamespace

    seen = []

    class Stub:
        def translate_batch(self, batch, **kw):
            seen.append([s for s, in batch])
            return [SimpleNamespace(hypotheses=[[s, "</s>"]], scores=[-1.0]) for s, in batch]

    out = translate(Stub(), [["x"], ["y"], ["z"]], beam=1, lenpen=1.0, batch_size=2,
                    references=references)
    assert seen == batches and [tokens for tokens, _ in out] == [["x"], ["y"], ["z"]]
    with pytest.raises(ValueError, match="2 references for 3 sources"):
        translate(Stub(), [["x"], ["y"], ["z"]], beam=1, lenpen=1.0, references=[["r"]] * 2)


def test_ctranslate2_int8(tiny_raw, runs, exported, tmp_path, capsys):
    """--quantization int8: a model of int8 weights (a smaller file: the tiny model's
    Linear weights are most but not all of it) that translates."""
    target = tmp_path / "int8"
    code, out, err = run_cli(capsys, runs / "admin" / "checkpoint_last.pt", "--out",
                             tmp_path / "x.pt", "--ctranslate2", target, "--quantization", "int8")
    assert code == 0 and f"wrote {target} (CTranslate2, int8)" in out, err
    size = (target / "model.bin").stat().st_size
    assert size < 0.8 * (runs / "admin-ct2" / "model.bin").stat().st_size
    translator = ctranslate2.Translator(str(target), device="cpu", compute_type="int8")
    sources = [line.split() for line in (tiny_raw / "test.src").read_text().splitlines()]
    out = translate(translator, sources, BEAM, LENPEN, max_len_b=MAX_LEN_B)
    assert len(out) == 24 and all(tokens for tokens, _ in out)


# -- checkpoints written by fairseq's Trainer in-process (fast): refusals, edge cases ------
def trainer_checkpoint(tiny_data, path: Path, extra) -> Path:
    trainer = build_trainer(tiny_data, [*TINY_MODEL, *extra])
    trainer.consolidate_optimizer()  # what fairseq's checkpoint_utils.save_checkpoint does first
    trainer.save_checkpoint(str(path), {})
    return path


def run_cli(capsys, *args):
    capsys.readouterr()
    code = export_cli.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


DYT = ["--admin-norm", "dyt"]


@pytest.mark.parametrize("flags,refused,why", [
    (["--admin-residual", "rezero"], "--admin-residual rezero",
     "ReZero (x + a * f(x)) has no sub-layer LayerNorm"),
    (["--admin-residual", "b2t"], "--admin-residual b2t",
     "B2T adds each layer's input into the layer's last LayerNorm"),
    (["--admin-residual", "resi-dual"], "--admin-residual resi-dual",
     "ResiDual carries a second (dual) residual stream"),
    (["--admin-residual", "peri-ln"], "--admin-residual peri-ln",
     "Peri-LN normalises each sub-layer's output too"),
    (["--admin-residual", "mix-ln", "--encoder-layers", "4"], "--admin-residual mix-ln",
     "Mix-LN mixes Post-LN and Pre-LN layers within a stack"),
    (["--admin-init", "none", *DYT], "--admin-norm dyt", "DyT (g * tanh(alpha x) + b) is no "
     "LayerNorm"),
    (["--admin-init", "none", "--encoder-normalize-before", "--decoder-normalize-before", *DYT],
     "--admin-norm dyt", "fairseq's transformer (and CTranslate2) normalises with LayerNorm"),
])
def test_refused_schemes_exit_nonzero_and_write_nothing(tiny_data, tmp_path, capsys, flags,
                                                        refused, why):
    ckpt = trainer_checkpoint(tiny_data, tmp_path / "ck.pt", flags)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, out, err = run_cli(capsys, ckpt, "--out", out_dir / "stock.pt",
                             "--ctranslate2", out_dir / "ct2")
    assert code == 1 and out == ""
    assert err.startswith(f"fairseq-admin-export: error: {refused} cannot be "
                          "exported to a stock fairseq transformer: ") and why in err
    assert len(err.strip().splitlines()) == 1
    assert list(out_dir.iterdir()) == []


def test_ctranslate2_failure_leaves_nothing(tiny_data, tmp_path, capsys):
    """Pre-LN encoder with a Post-LN decoder exports to fairseq, but CTranslate2's converter
    refuses it: the command fails with the converter's reason, and neither the fairseq file
    nor the CTranslate2 folder (nor a temporary file) is left."""
    ckpt = trainer_checkpoint(tiny_data, tmp_path / "ck.pt",
                              ["--admin-init", "none", "--encoder-normalize-before"])
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, out, err = run_cli(capsys, ckpt, "--out", out_dir / "stock.pt",
                             "--ctranslate2", out_dir / "ct2")
    assert code == 1
    assert "CTranslate2's FairseqConverter refused the exported model" in err
    assert "--encoder-normalize-before and --decoder-normalize-before must have the same" in err
    assert list(out_dir.iterdir()) == []
    # without --ctranslate2 the same model exports (stock fairseq has per-side Pre-LN)
    code, out, err = run_cli(capsys, ckpt, "--out", out_dir / "stock.pt")
    assert code == 0 and [p.name for p in out_dir.iterdir()] == ["stock.pt"], err


def test_no_positions_both_sides(tiny_data, tmp_path, capsys):
    """No positions on either side: fairseq's --no-token-positional-embeddings; CTranslate2
    (whose converter refuses that flag) gets all-zero learned tables, and its forced-decoding
    log-probabilities equal the fairseq export's."""
    ckpt = trainer_checkpoint(tiny_data, tmp_path / "ck.pt", [
        "--encoder-pos-emb", "none", "--decoder-pos-emb", "none", "--admin-omega", "parameter"])
    code, out, err = run_cli(capsys, ckpt, "--out", tmp_path / "stock.pt",
                             "--ctranslate2", tmp_path / "ct2")
    assert code == 0, err
    assert "CTranslate2 gets all-zero learned position tables" in out
    state = torch.load(tmp_path / "stock.pt")
    assert state["cfg"]["model"]["no_token_positional_embeddings"] is True
    original, stock, task = load_original_and_export(tmp_path / "stock.pt", ckpt, tiny_data)
    d = task.source_dictionary
    src = [["w1", "w2", "w3"], ["w4", "w5"]]
    tgt = [["w3", "w2", "w1"], ["w5", "w4", "w4", "w9"]]
    scored = ctranslate2.Translator(str(tmp_path / "ct2")).score_batch(src, tgt)
    for s, t, sc in zip(src, tgt, scored):
        src_t = torch.tensor([[d.index(w) for w in s] + [d.eos()]])
        ids = [d.index(w) for w in t] + [d.eos()]
        prev = torch.tensor([[d.eos()] + ids[:-1]])
        lp = logprobs(stock, (src_t, torch.tensor([src_t.size(1)]), prev))[0]
        ref = lp[torch.arange(len(ids)), torch.tensor(ids)]
        torch.testing.assert_close(torch.tensor(sc.log_probs), ref, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def small_checkpoints(tiny_data, tmp_path_factory):
    """An untrained admin_transformer checkpoint and a stock transformer one."""
    root = tmp_path_factory.mktemp("small")
    trainer_checkpoint(tiny_data, root / "admin.pt", [])
    trainer = build_trainer(tiny_data, [*TINY_MODEL], arch="transformer")
    trainer.consolidate_optimizer()
    trainer.save_checkpoint(str(root / "stock.pt"), {})
    return root


@pytest.mark.parametrize("args,message", [
    (["{missing}", "--out", "{out}"], "CHECKPOINT {missing}: no such file"),
    (["{ckpt}", "--out", "{out}", "--quantization", "int8"],
     "--quantization applies to the CTranslate2 model: add --ctranslate2 DIR"),
    (["{ckpt}", "--out", "{out}", "--ctranslate2", "{full}"],
     "--ctranslate2 {full} exists and is not an empty folder"),
    (["{ckpt}", "--out", "{tmp}/nowhere/x.pt"], "--out {tmp}/nowhere/x.pt: folder"),
    (["{stock}", "--out", "{out}"], "holds a 'transformer' model; fairseq-admin-export "
                                    "exports admin_transformer checkpoints"),
    (["{tmp}/full/keep", "--out", "{out}"], "CHECKPOINT {tmp}/full/keep is not a checkpoint"),
])
def test_argument_errors(small_checkpoints, tmp_path, capsys, args, message):
    ckpt = tmp_path / "ck.pt"
    ckpt.write_bytes((small_checkpoints / "admin.pt").read_bytes())
    stock = tmp_path / "stock_in.pt"
    stock.write_bytes((small_checkpoints / "stock.pt").read_bytes())
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("x")
    names = dict(missing=tmp_path / "no.pt", out=tmp_path / "out.pt", ckpt=ckpt,
                 full=tmp_path / "full", tmp=tmp_path, stock=stock)
    code, out, err = run_cli(capsys, *[a.format(**names) for a in args])
    assert code == 1 and message.format(**names) in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out.pt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt", "full", "stock_in.pt"]
    assert os.listdir(tmp_path / "full") == ["keep"]
