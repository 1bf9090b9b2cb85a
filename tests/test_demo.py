"""``make demo``'s pipeline (fairseq_admin_pos.cli.demo) on a tiny Multi30k-shaped corpus."""
import gzip
import json
import socket
import subprocess
import sys

import pytest
import sacrebleu

from fairseq_cli_utils import MULTI30K_SPLITS as SPLITS, REPO, env, write_fake_multi30k


def run_demo(args, module="fairseq_admin_pos.cli.demo", **kw):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)],
                          cwd=REPO, env=kw.pop("env", env()), capture_output=True, text=True,
                          timeout=600, **kw)


@pytest.mark.slow
def test_demo_end_to_end(tmp_path):
    write_fake_multi30k(tmp_path / "m30k")
    out = tmp_path / "out"
    args = ["--data", tmp_path / "m30k", "--out", out, "--encoder-layers", "3",
            "--decoder-layers", "1", "--dim", "32", "--vocab", "60", "--max-update", "6",
            "--max-tokens", "600", "--warmup", "2", "--save-interval-updates", "3"]
    proc = run_demo(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # each fairseq command is printed, with the plugin and a deep-encoder Admin model
    assert "+ " in proc.stdout and "fairseq-train" in proc.stdout
    assert "--user-dir" in proc.stdout and "--arch admin_transformer" in proc.stdout
    assert "--encoder-layers 3" in proc.stdout and "--admin-init closed-form" in proc.stdout
    run = out / "admin-3L-1L"  # the scheme, and the depths as they differ from the demo's
    res = json.loads((run / "results.json").read_text())
    assert res["test_sentences"] == SPLITS["test_2016_flickr"]
    valid = [l for l in (run / "train.log").read_text().splitlines() if "| valid |" in l]
    assert f"nll_loss {res['valid_nll_bits']:.3f}" in valid[-1]
    # BLEU recomputed independently from the written hypotheses and the raw references
    hyps = (run / "test.hyp.de").read_text(encoding="utf-8").splitlines()
    with gzip.open(tmp_path / "m30k" / "test_2016_flickr.de.gz", "rt", encoding="utf-8") as fh:
        refs = fh.read().splitlines()
    assert len(hyps) == len(refs)
    assert abs(sacrebleu.corpus_bleu(hyps, [refs]).score - res["bleu"]) < 0.01
    assert res["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert f"signature: {res['signature']}" in proc.stdout
    # a second run resumes: every step is complete, training is already at --max-update
    again = run_demo(args)
    assert again.returncode == 0
    assert "fairseq-preprocess" not in again.stdout
    assert "num_updates 6" in (run / "train.log").read_text()
    # the Post-LN baseline side by side: same data and recipe, its own run folder; through
    # the short name the docs give (python -m fairseq_admin_pos.demo --scheme post-ln)
    base = run_demo(args + ["--scheme", "post-ln"], module="fairseq_admin_pos.demo")
    assert base.returncode == 0, base.stdout[-3000:] + base.stderr[-3000:]
    assert "fairseq-preprocess" not in base.stdout and "--admin-init none" in base.stdout
    post = json.loads((out / "post-ln-3L-1L" / "results.json").read_text())
    assert post["scheme"] == "post-ln" and post["scheme_flags"] == "--admin-init none"
    assert "Every scheme run in" in base.stdout
    for r in (res, post):
        assert f"sacreBLEU {r['bleu']:6.2f}" in base.stdout
    # another depth is another run, not a resume of this one
    # (argparse keeps a repeated flag's last value)
    deeper = run_demo(args + ["--decoder-layers", "2", "--max-update", "2", "--scheme", "post-ln"])
    assert deeper.returncode == 0, deeper.stdout[-3000:] + deeper.stderr[-3000:]
    assert "--decoder-layers 2" in deeper.stdout
    assert (out / "post-ln-3L-2L" / "results.json").exists()
    # the same folder with another recipe is refused before training, naming the flag
    other = run_demo(args + ["--scheme", "post-ln", "--lr", "0.01"])
    assert other.returncode != 0
    assert "--lr 0.002 there, 0.01 now" in other.stderr and "--out" in other.stderr
    assert "fairseq-train" not in other.stdout


def test_demo_missing_data_and_no_network_is_a_clear_error(tmp_path):
    write_fake_multi30k(tmp_path / "m30k", gz=False)
    (tmp_path / "m30k" / "val.de").unlink()
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    e = env()
    e["MULTI30K_BASE_URL"] = f"http://127.0.0.1:{port}/raw"
    proc = run_demo(["--data", tmp_path / "m30k", "--out", tmp_path / "out"], env=e)
    assert proc.returncode != 0
    assert "cannot find val.de(.gz)" in proc.stderr and "MULTI30K_BASE_URL" in proc.stderr
    assert "Traceback" not in proc.stderr
