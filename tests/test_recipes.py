"""Recipes in examples/<task>/: update-freq arithmetic, text tools, scoring, downloads and
prepare's step markers (the train.sh command lines: test_recipes_train_sh.py; prepare ->
train -> eval through the scripts: test_recipes_pipeline.py). Numbers are checked against
computations written independently of the code under test (recipe_utils.py).
"""
from __future__ import annotations

import functools
import hashlib
import http.server
import os
import random
import subprocess
import sys
import threading

import pytest

from recipe_utils import (
    EXAMPLES, QuietHandler, RECIPES_PY, REPO, clean_reference, lines, make_corpus, recipes,
    ref_bleu, ref_compound_split, run_script, script_env, write_generate_output, write_tar)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# ======================================================================================
# update-freq arithmetic and refusal
# ======================================================================================

@pytest.mark.parametrize(
    "effective,gpus,max_tokens,update_freq",
    [
        (32768, 4, 8192, 1),        # WMT14 En-De as published
        (32768, 1, 8192, 4),
        (32768, 2, 8192, 2),
        (640000, 8, 8000, 10),      # WMT14 En-Fr 6L as published
        (640000, 16, 8000, 5),
        (1280000, 16, 5000, 16),    # WMT14 En-Fr 60L-12L as published
        (1280000, 32, 5000, 8),
        (4096, 1, 4096, 1),         # IWSLT14
        (524288, 8, 2048, 32),      # admin-torch 100L-100L
    ],
)
def test_update_freq_reaches_effective_batch(effective, gpus, max_tokens, update_freq):
    plan = recipes.plan_update_freq(effective, gpus, max_tokens)
    assert plan.update_freq == update_freq
    assert plan.num_gpus * plan.max_tokens * plan.update_freq == effective
    assert plan.effective_batch == effective


@pytest.mark.parametrize(
    "effective,gpus,max_tokens,suggested",
    [
        (32768, 8, 8192, (4096, 1)),     # more tokens per step than the batch: uf 0.5
        (32768, 3, 8192, None),          # 32768 not divisible by 3 GPUs
        (640000, 3, 8000, None),
        (640000, 16, 6000, (5000, 8)),   # 640000/16 = 40000 = 5000 x 8
        (1280000, 12, 5000, None),
        (4096, 1, 3000, (2048, 2)),
    ],
)
def test_update_freq_refuses_impossible(effective, gpus, max_tokens, suggested):
    with pytest.raises(recipes.RecipeError) as info:
        recipes.plan_update_freq(effective, gpus, max_tokens)
    message = str(info.value)
    assert f"NUM_GPUS={gpus}" in message and f"MAX_TOKENS={max_tokens}" in message
    assert str(effective) in message
    fix = recipes.suggest_max_tokens(effective, gpus, max_tokens)
    if suggested is None:
        assert fix is None
        assert "no MAX_TOKENS works" in message
    else:
        assert (fix.max_tokens, fix.update_freq) == suggested
        assert fix.effective_batch == effective and fix.max_tokens <= max_tokens
        assert f"MAX_TOKENS={suggested[0]} (--update-freq {suggested[1]})" in message
    # every suggested GPU count really reaches the batch with this max-tokens
    for g in recipes.suggest_gpu_counts(effective, max_tokens):
        assert effective % (g * max_tokens) == 0


def test_suggest_max_tokens_is_largest_below_cap():
    # brute force over all per-GPU sizes, independent of the search order in the code
    for effective, gpus, cap in [(32768, 8, 8192), (640000, 16, 6000), (4096, 1, 3000),
                                 (1280000, 20, 7000), (98304, 6, 10000)]:
        candidates = [m for m in range(1, cap + 1)
                      if effective % gpus == 0 and (effective // gpus) % m == 0]
        fix = recipes.suggest_max_tokens(effective, gpus, cap)
        assert fix.max_tokens == max(candidates)


@pytest.mark.parametrize("bad", ["0", "-4", "x", "2.5", ""])
def test_update_freq_rejects_non_positive_inputs(bad):
    with pytest.raises(recipes.RecipeError, match="NUM_GPUS must be a positive integer"):
        recipes.plan_update_freq(32768, bad, 8192)


def test_update_freq_cli_exit_codes():
    ok = subprocess.run([sys.executable, RECIPES_PY, "update-freq", "--effective-batch", "640000",
                         "--num-gpus", "8", "--max-tokens", "8000"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip() == "10"
    bad = subprocess.run([sys.executable, RECIPES_PY, "update-freq", "--effective-batch", "32768",
                          "--num-gpus", "3", "--max-tokens", "8192"], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "not a positive integer" in bad.stderr


@pytest.mark.parametrize(
    "env,smi,expected",
    [
        ({}, None, 0),
        ({}, "GPU 0: NVIDIA H100 (UUID: GPU-1)\nGPU 1: NVIDIA H100 (UUID: GPU-2)\n", 2),
        ({}, "GPU 0: A100 (UUID: GPU-a)\n  MIG 1g.5gb Device 0: (UUID: MIG-b)\n", 1),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, None, 4),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "GPU 0: x\nGPU 1: y\n", 2),
        ({"CUDA_VISIBLE_DEVICES": ""}, "GPU 0: x\n", 0),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, "GPU 0: x\n", 0),
        ({"CUDA_VISIBLE_DEVICES": "1,-1,0"}, None, 1),
        ({"CUDA_VISIBLE_DEVICES": "GPU-8a1b,GPU-77cd"}, None, 2),
    ],
)
def test_count_visible_gpus(env, smi, expected):
    assert recipes.count_visible_gpus(env, smi) == expected


# ======================================================================================
# text tools
# ======================================================================================

def test_compound_split_matches_perl_semantics():
    # perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g': non-overlapping, left to right
    assert recipes.compound_split("rich-text format") == "rich ##AT##-##AT## text format"
    assert recipes.compound_split("a-b-c") == "a ##AT##-##AT## b-c"
    assert recipes.compound_split("co @-@ operation") == "co @ ##AT##-##AT## @ operation"
    assert recipes.compound_split("- x -- y-") == "- x -- y-"

def test_clean_corpus_rules(tmp_path):
    rng = random.Random(3)
    pairs = [("", "x"), ("a", ""), ("a b c", "d e f"), ("a " * 6, "b"), ("a", "b c"),
             ("a b", "c d e"), ("w " * 251, "v " * 251), ("w " * 250, "v " * 250),
             ("  spaced   out ", "x  y")]
    for _ in range(200):
        pairs.append((" ".join("s" * rng.randint(1, 3) for _ in range(rng.randint(0, 12))),
                      " ".join("t" for _ in range(rng.randint(0, 12)))))
    (tmp_path / "c.en").write_text("".join(p[0] + "\n" for p in pairs))
    (tmp_path / "c.de").write_text("".join(p[1] + "\n" for p in pairs))
    read, kept = recipes.clean_corpus(str(tmp_path / "c.en"), str(tmp_path / "c.de"),
                                      str(tmp_path / "o.en"), str(tmp_path / "o.de"), 1, 250, 1.5)
    expected = [(" ".join(s.split()), " ".join(t.split())) for s, t in pairs
                if clean_reference(s, t, 1, 250, 1.5)]
    assert read == len(pairs) and kept == len(expected)
    assert (tmp_path / "o.en").read_text().splitlines() == [e[0] for e in expected]
    assert (tmp_path / "o.de").read_text().splitlines() == [e[1] for e in expected]


def test_tokenizer_keeps_alignment_and_applies_moses_rules(tmp_path):
    lines = ["The state-of-the-art car & the dog.", "one\rline\x07 with\u2028separators",
             "", "Tom\u2019s \"big\" house"]
    (tmp_path / "in.en").write_bytes("".join(l + "\n" for l in lines).encode("utf-8"))
    pipeline = recipes.MosesPipeline("en", aggressive=True, normalize_punct=True,
                                     remove_non_printing=True, rsquo=True, lowercase=False)
    count = recipes.tokenize_files([str(tmp_path / "in.en")], str(tmp_path / "out.en"), pipeline)
    out = (tmp_path / "out.en").read_text(encoding="utf-8").split("\n")[:-1]
    assert count == 4 and len(out) == 4
    assert out[0] == "The state @-@ of @-@ the @-@ art car &amp; the dog ."
    # normalize-punctuation.perl deletes \r; \x07 (category C) and U+2028 become spaces
    assert out[1] == "oneline with separators"
    assert out[2] == ""
    assert out[3] == "Tom &apos;s &quot; big &quot; house"
    # worker processes give the same lines in the same order
    many = [l for _ in range(30) for l in lines] + ["last line"]
    (tmp_path / "many.en").write_bytes("".join(l + "\n" for l in many).encode("utf-8"))
    one = recipes.tokenize_files([str(tmp_path / "many.en")], str(tmp_path / "one.en"), pipeline)
    two = recipes.tokenize_files([str(tmp_path / "many.en")], str(tmp_path / "two.en"), pipeline,
                                 workers=2)
    assert one == two == len(many)
    assert (tmp_path / "one.en").read_bytes() == (tmp_path / "two.en").read_bytes()


@pytest.fixture
def http_root(tmp_path):
    """A loopback HTTP server on a free port serving tmp_path/www; yields (dir, base URL)."""
    root = tmp_path / "www"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_score_generation_against_independent_bleu(tmp_path):
    rng = random.Random(7)
    raw_refs, tok_refs, hyps = [], [], []
    tokenizer = recipes.MosesPipeline("de", True, False, False, True, False)
    for en, de in make_corpus(rng, "en", "de", 40):
        raw_refs.append(de)
        tok = tokenizer(de)
        tok_refs.append(tok)
        words = tok.split()
        if rng.random() < 0.5:  # perturb half of the hypotheses
            words[rng.randrange(len(words))] = "Fehler"
        hyps.append(" ".join(words))
    (tmp_path / "ref.tok").write_text(lines(tok_refs), encoding="utf-8")
    (tmp_path / "ref.raw").write_text(lines(raw_refs), encoding="utf-8")
    write_generate_output(tmp_path / "gen.txt", hyps)
    result = recipes.score_generation(str(tmp_path / "gen.txt"), str(tmp_path / "ref.tok"),
                                      str(tmp_path / "ref.raw"), "de", compound=True, lowercase=False)
    expected_split = ref_bleu([ref_compound_split(h) for h in hyps],
                              [ref_compound_split(r) for r in tok_refs])
    expected_plain = ref_bleu(hyps, tok_refs)
    assert 20 < expected_plain < 100 and expected_split != expected_plain
    assert result["tokenized"] == pytest.approx(expected_plain, abs=1e-6)
    assert result["compound_split"] == pytest.approx(expected_split, abs=1e-6)
    # detokenized side: the unperturbed hypotheses detokenize back to the raw references
    for hyp, detok, raw in zip(hyps, result["detokenized_hypotheses"], raw_refs):
        if "Fehler" not in hyp:
            assert detok == raw.replace("\u2019", "'")
    assert result["sacrebleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    # an incomplete generation is refused, not scored on a subset
    write_generate_output(tmp_path / "short.txt", hyps[:-3])
    with pytest.raises(recipes.RecipeError, match="37 hypotheses for a 40-line reference"):
        recipes.score_generation(str(tmp_path / "short.txt"), str(tmp_path / "ref.tok"),
                                 str(tmp_path / "ref.raw"), "de", True, False)


# ======================================================================================
# downloads: integrity, checksums, no network
# ======================================================================================

def test_fetch_checks_archives(http_root, tmp_path, capsys):
    root, base = http_root
    write_tar(root / "good.tgz", {"a/b.txt": "hello\n" * 1000})
    good = (root / "good.tgz").read_bytes()
    (root / "truncated.tgz").write_bytes(good[: len(good) // 2])
    digest = hashlib.sha256(good).hexdigest()
    dest = tmp_path / "dl"
    assert recipes.fetch(f"{base}/good.tgz", str(dest / "good.tgz"), digest) == digest
    assert (dest / "good.tgz.sha256").read_text().strip() == digest
    # second call: marker present -> no download (the server file may even be gone)
    (root / "good.tgz").unlink()
    assert recipes.fetch(f"{base}/good.tgz", str(dest / "good.tgz")) == digest
    assert "already downloaded and checked" in capsys.readouterr().out
    with pytest.raises(recipes.RecipeError, match="damaged or incomplete") as info:
        recipes.fetch(f"{base}/truncated.tgz", str(dest / "truncated.tgz"))
    assert info.value.code == 4
    assert not (dest / "truncated.tgz").exists() and not (dest / "truncated.tgz.sha256").exists()
    (root / "good.tgz").write_bytes(good)
    with pytest.raises(recipes.RecipeError, match="expected 0{64}"):
        recipes.fetch(f"{base}/good.tgz", str(dest / "other.tgz"), "0" * 64)
    with pytest.raises(recipes.RecipeError, match="could not download") as info:
        recipes.fetch(f"{base}/missing.tgz", str(dest / "missing.tgz"))
    assert info.value.code == 3


def test_fetch_cli_with_checksums_file(http_root, tmp_path, capsys):
    root, base = http_root
    write_tar(root / "x.tgz", {"x/y.txt": "data\n"})
    digest = hashlib.sha256((root / "x.tgz").read_bytes()).hexdigest()
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"# pinned\n{digest}  x.tgz\n{'1' * 64} *other.tgz\n")
    assert recipes.read_checksums(str(sums)) == {"x.tgz": digest, "other.tgz": "1" * 64}
    args = ["fetch", "--url", f"{base}/x.tgz", "--checksums", str(sums)]
    assert recipes.main(args + ["--dest", str(tmp_path / "a" / "x.tgz")]) == 0
    sums.write_text(f"{'2' * 64}  x.tgz\n")
    assert recipes.main(args + ["--dest", str(tmp_path / "b" / "x.tgz")]) == 4
    assert "expected " + "2" * 64 in capsys.readouterr().err
    assert not (tmp_path / "b" / "x.tgz").exists()
    sums.write_text("not a checksum line\n")
    assert recipes.main(args + ["--dest", str(tmp_path / "c" / "x.tgz")]) == 2
    assert "expected '<sha256 hex>  <file name>'" in capsys.readouterr().err


def test_prepare_without_network_is_a_message(tmp_path):
    env = script_env(WMT14_BASE_URL="http://127.0.0.1:9", WORKERS=1)
    result = run_script([os.path.join(REPO, "examples/wmt14_en_de/prepare.sh"), tmp_path / "d"],
                        env, tmp_path, check=False)
    assert result.returncode == 3
    assert "could not download http://127.0.0.1:9/wmt13/training-parallel-europarl-v7.tgz" in result.stderr
    assert "WMT14_BASE_URL" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "d" / ".done" / "fetch-training-parallel-europarl-v7.tgz").exists()


def test_prepare_steps_redo_interrupted_work(tmp_path):
    """lib.sh's step(): a step with its marker is skipped; a step without one (never run,
    or interrupted before the marker was written) runs, and so does every step after it."""
    script = tmp_path / "steps.sh"
    script.write_text(f"""set -euo pipefail
source {EXAMPLES}/common/lib.sh
DATA_DIR={tmp_path}/d
one() {{ echo ran-one >> {tmp_path}/log; }}
two() {{ echo ran-two >> {tmp_path}/log; [[ -z "${{FAIL:-}}" ]]; }}
three() {{ echo ran-three >> {tmp_path}/log; }}
step one one
step two two
step three three
""")
    def run(**env):
        (tmp_path / "log").write_text("")
        result = subprocess.run(["bash", str(script)], env=script_env(**env), capture_output=True,
                                text=True)
        return result.returncode, (tmp_path / "log").read_text().split()

    assert run(FAIL=1) == (1, ["ran-one", "ran-two"])          # two fails: no marker
    assert sorted(os.listdir(tmp_path / "d" / ".done")) == ["one"]
    assert run() == (0, ["ran-two", "ran-three"])               # one skipped, two redone
    assert run() == (0, [])                                     # all complete
    (tmp_path / "d" / ".done" / "two").unlink()
    assert run() == (0, ["ran-two", "ran-three"])               # three follows a redone two
