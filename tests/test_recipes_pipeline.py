"""prepare.sh -> train.sh -> eval.sh of each task in examples/, through the scripts
themselves, offline: tiny archives in the formats of the real downloads (recipe_utils.py)
served from a loopback HTTP server that the scripts' base-URL variables point at, a tiny
model trained on the CPU for 2 epochs, and the scores recomputed here.
"""
from __future__ import annotations

import functools
import http.server
import json
import random
import re
import threading

import pytest

from recipe_utils import (
    EXAMPLES, HYPHENATED, QuietHandler, build_iwslt_site, build_wmt_site, clean_reference,
    command_args, recipes, ref_bleu, ref_compound_split, run_script, script_env)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# ======================================================================================
# prepare -> train -> eval through the scripts, per task
# ======================================================================================


# scheme/depth per task: the paper's Admin (profiling, RAdam), the recommended Admin (closed
# form, Adam) and Pre-LN with RAdam in bf16, so that every precision path and both optimizers
# run once; the depth only picks the recipe's hyperparameters and folder name (ARCH makes the
# model tiny); one task also resumes its run and has a changed one refused. eval: the
# WMT tasks average both epochs under the task's default upper bound (100, 50); IWSLT sets
# CHECKPOINT_UPPER_BOUND=1, so its "last 1" must be epoch 1, not the last epoch 2.
E2E = {
    "wmt14_en_de": dict(src="en", tgt="de", scheme="admin-paper", depth="18l_18l", compound=True,
                        lowercase=False, precision="fp32", init="profile", optimizer="radam",
                        beam="--beam 5 --lenpen 1.0", eval_env=dict(AVG_LAST=2),
                        averaging="--num-epoch-checkpoints 2 --checkpoint-upper-bound 100",
                        averaged="averaged_last2_upto100", epochs=(1, 2)),
    "wmt14_en_fr": dict(src="en", tgt="fr", scheme="admin", depth="60l_12l", compound=False,
                        lowercase=False, precision="fp32", init="closed-form", optimizer="adam",
                        resume=True,
                        beam="--beam 5 --lenpen 0.8", eval_env=dict(AVG_LAST=2),
                        averaging="--num-epoch-checkpoints 2 --checkpoint-upper-bound 50",
                        averaged="averaged_last2_upto50", epochs=(1, 2)),
    "iwslt14_de_en": dict(src="de", tgt="en", scheme="pre-ln-paper", depth="6l_6l",
                          compound=False, lowercase=True, precision="bf16", init="none",
                          optimizer="radam",
                          beam="--beam 5 --lenpen 1.0",
                          eval_env=dict(AVG_LAST=1, CHECKPOINT_UPPER_BOUND=1),
                          averaging="--num-epoch-checkpoints 1 --checkpoint-upper-bound 1",
                          averaged="averaged_last1_upto1", epochs=(1,)),
}


def e2e_spec(task):
    return dict(E2E[task])


def binarized_count(prefix):
    from fairseq.data.indexed_dataset import MMapIndexedDataset

    return len(MMapIndexedDataset(str(prefix)))


def read_lines_utf8(path):
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def printed_score(stdout, label):
    """(line number, value) of the score printed on the line that starts with label."""
    for number, line in enumerate(stdout.splitlines()):
        match = re.match(re.escape(label) + r".*?: (\d+\.\d+)", line)
        if match:
            return number, float(match.group(1))
    raise AssertionError(f"{label!r} not printed:\n{stdout[-2000:]}")


PAPER_BLEU = "tokenized BLEU (the Admin paper's scoring: fairseq-generate's BLEU4"
SACREBLEU = "detokenized sacreBLEU"
COMPOUND_BLEU = "tokenized BLEU, compound split (a-b -> a ##AT##-##AT## b, tensor2tensor's"


def _pipeline(task, base_dir, base_url, site_dir, fairseq_bin, python):
    """prepare (twice) -> train -> [resume, refused resume] -> eval for one task, through the
    scripts, with FAIRSEQ_BIN and PYTHON given; returns what the assertions need. Runs in a
    worker thread."""
    spec = e2e_spec(task)
    src, tgt = spec["src"], spec["tgt"]
    rng = random.Random(11)
    work = base_dir / task
    work.mkdir()
    if task == "iwslt14_de_en":
        train_pairs, test = build_iwslt_site(str(site_dir), rng)
        url = {"IWSLT14_URL": f"{base_url}/{site_dir.name}/iwslt/de-en.tgz"}
    else:
        train_pairs, test = build_wmt_site(str(site_dir), src, tgt, rng)
        url = {"WMT14_BASE_URL": f"{base_url}/{site_dir.name}"}
    r = dict(spec=spec, train_pairs=train_pairs, test=test, data=work / "data")
    tools = dict(FAIRSEQ_BIN=fairseq_bin, PYTHON=python)
    env = script_env(BPE_TOKENS=60, WORKERS=1, **tools, **url)
    prepare = [f"{EXAMPLES}/{task}/prepare.sh", r["data"]]
    r["prepare"] = run_script(prepare, env, work)
    r["prepare_again"] = run_script(prepare, env, work)

    runs = work / "runs"
    r["train_env"] = script_env(DEVICE="cpu", PRECISION=spec["precision"], ARCH="admin_transformer_tiny",
                                EFFECTIVE_BATCH=1024, MAX_TOKENS=512, DATA_DIR=r["data"],
                                RUNS_DIR=runs, EXTRA_ARGS="--max-epoch 2 --num-workers 0", **tools)
    r["train_cmd"] = [f"{EXAMPLES}/{task}/train.sh", spec["scheme"], spec["depth"], "3"]
    r["train"] = run_script(r["train_cmd"], r["train_env"], work)
    r["run_dir"] = runs / task / f"{spec['scheme']}_{spec['depth']}_3"
    r["checkpoint2"] = torch_load(r["run_dir"] / "checkpoint2.pt")
    r["commands_after_first"] = (r["run_dir"] / "commands.log").read_text()
    if spec.get("resume"):
        r["resumed"] = run_script(r["train_cmd"], r["train_env"], work)
        other = dict(r["train_env"], EXTRA_ARGS="--max-epoch 2 --num-workers 0 --lr 0.01")
        r["refused"] = run_script(r["train_cmd"], other, work, check=False)
    eval_env = script_env(DEVICE="cpu", DATA_DIR=r["data"], GEN_EXTRA_ARGS="--max-len-b 10",
                          **tools, **spec["eval_env"])
    r["eval"] = run_script([f"{EXAMPLES}/{task}/eval.sh", r["run_dir"]], eval_env, work)
    return r


def torch_load(path):
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """Run the three task pipelines concurrently (each is a chain of processes) against one
    loopback HTTP server; the tests below check their outputs. The scripts' fairseq and torch
    commands run forked from two processes that imported torch and fairseq once
    (recipe_shims.py): their imports were most of the CPU of these tiny runs."""
    from concurrent.futures import ThreadPoolExecutor

    from recipe_shims import RecipeShims

    base_dir = tmp_path_factory.mktemp("e2e")
    www = base_dir / "www"
    www.mkdir()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(www)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base_url = f"http://127.0.0.1:{server.server_address[1]}"
    results = {}
    try:
        with RecipeShims(base_dir / "fairseq_bin") as shims, ThreadPoolExecutor(len(E2E)) as pool:
            futures = {}
            for task in E2E:
                site = www / task
                site.mkdir()
                futures[task] = pool.submit(_pipeline, task, base_dir, base_url, site,
                                            shims.folder, shims.python)
            for task, future in futures.items():
                try:
                    results[task] = future.result()
                except Exception as error:  # reported by each task's tests
                    results[task] = error
    finally:
        server.shutdown()
        server.server_close()
    return results


def e2e_result(e2e, task):
    result = e2e[task]
    if isinstance(result, Exception):
        raise result
    return result


@pytest.mark.slow
@pytest.mark.parametrize("task", list(E2E))
def test_recipe_prepare(task, e2e):
    r = e2e_result(e2e, task)
    spec, data, test, train_pairs = r["spec"], r["data"], r["test"], r["train_pairs"]
    src, tgt = spec["src"], spec["tgt"]
    out = r["prepare"].stdout
    assert re.search(r"^\+ .*fairseq-preprocess .*--joined-dictionary", out, re.M)
    assert re.search(r"^\+ .*learn-bpe -s 60 ", out, re.M)

    raw_ref = read_lines_utf8(data / "ref" / f"test.raw.{tgt}")
    tok_ref = read_lines_utf8(data / "ref" / f"test.tok.{tgt}")
    assert raw_ref == [t[1] for t in test]
    assert len(tok_ref) == len(test)
    for raw, tok in zip(raw_ref, tok_ref):
        if "\u2019" in raw:  # right single quote -> apostrophe, then Moses-escaped
            assert "\u2019" not in tok and "&apos;" in tok
        if "&" in raw:
            assert "&amp;" in tok
        if HYPHENATED[tgt] in raw:  # -a for WMT, plain hyphen for IWSLT
            assert (" @-@ " in tok) == (task != "iwslt14_de_en")
    if spec["lowercase"]:
        assert all(t == t.lower() for t in tok_ref)

    if task == "iwslt14_de_en":
        tokenized = data / "tmp" / f"train.tags.tok.{src}"
        n_sentences = len(train_pairs) - 3  # url, keywords, talkid lines dropped
        pre_clean = (data / "tmp" / f"train.tags.tok.{src}", data / "tmp" / f"train.tags.tok.{tgt}")
        max_len = 175
    else:
        tokenized = data / "tmp" / f"train.tok.{src}"
        n_sentences = len(train_pairs)
        pre_clean = (data / "tmp" / f"bpe.train.{src}", data / "tmp" / f"bpe.train.{tgt}")
        max_len = 250
    # one output line per input sentence, whatever control characters it held
    assert len(read_lines_utf8(tokenized)) == n_sentences
    kept = [i for i, (s, t) in enumerate(zip(read_lines_utf8(pre_clean[0]),
                                             read_lines_utf8(pre_clean[1])))
            if clean_reference(s, t, 1, max_len, 1.5)]
    assert len(kept) < n_sentences  # the empty, too long and unbalanced pairs went
    expected_train = len(kept) - (len(kept) // 23 if task == "iwslt14_de_en" else 0)
    assert binarized_count(data / "data-bin" / f"train.{src}-{tgt}.{src}") == expected_train
    assert binarized_count(data / "data-bin" / f"train.{src}-{tgt}.{tgt}") == expected_train
    assert binarized_count(data / "data-bin" / f"test.{src}-{tgt}.{src}") == len(test)
    if task == "iwslt14_de_en":
        assert binarized_count(data / "data-bin" / f"valid.{src}-{tgt}.{src}") == len(kept) // 23

    again = r["prepare_again"].stdout
    assert "== binarize: complete" in again
    assert not re.search(r"^\+ ", again, re.M)  # nothing re-run


@pytest.mark.slow
@pytest.mark.parametrize("task", list(E2E))
def test_recipe_train(task, e2e):
    r = e2e_result(e2e, task)
    spec, run_dir, state = r["spec"], r["run_dir"], r["checkpoint2"]
    out = r["train"].stdout
    assert "1 GPU(s) x 512 tokens x update-freq 2 = 1024 tokens/update" in out
    fairseq_cmd = command_args(out)
    assert "--update-freq 2 " in fairseq_cmd and "--cpu " in fairseq_cmd
    assert "--ddp-backend legacy_ddp" in fairseq_cmd
    assert (run_dir / "checkpoint1.pt").exists() and (run_dir / "checkpoint2.pt").exists()
    model_cfg = state["cfg"]["model"]
    assert model_cfg.admin_init == spec["init"]
    assert state["cfg"]["optimizer"]["_name"] == spec["optimizer"]
    groups = state["last_optimizer_state"]["param_groups"]
    assert tuple(groups[0]["betas"]) == (0.9, 0.98)
    if spec["optimizer"] == "radam":
        assert groups[0]["early_steps"] == "skip"
    assert state["model"]["_extra_state"]["admin_init"] == spec["init"]
    pre_ln = spec["scheme"].startswith("pre-ln")
    assert bool(model_cfg.encoder_normalize_before) == bool(model_cfg.decoder_normalize_before) \
        == pre_ln
    assert model_cfg.admin_omega == ("parameter" if spec["init"] != "none" else "buffer")
    assert model_cfg.share_all_embeddings and model_cfg.arch == "admin_transformer_tiny"
    assert state["cfg"]["optimization"]["update_freq"] == [2]
    assert state["cfg"]["common"]["bf16"] == (spec["precision"] == "bf16")
    assert state["cfg"]["common"]["tpu"] is False  # bf16 stays off fairseq's TPU path
    log = r["commands_after_first"]
    assert log.count("# ") == 1 and "--update-freq 2 " in log
    assert json.loads((run_dir / "recipe.json").read_text())["scheme"] == spec["scheme"]
    if spec.get("resume"):
        assert f"resuming the run in {run_dir}" in r["resumed"].stdout
        assert "Loaded checkpoint" in (run_dir / "train.log").read_text()
        assert not (run_dir / "checkpoint3.pt").exists()
        assert (run_dir / "commands.log").read_text().count("--update-freq 2 ") == 2
        assert r["refused"].returncode == 2
        assert "holds a run with other settings" in r["refused"].stderr
        assert "extra_args" in r["refused"].stderr


@pytest.mark.slow
@pytest.mark.parametrize("task", list(E2E))
def test_recipe_eval(task, e2e):
    import sacrebleu
    import torch

    r = e2e_result(e2e, task)
    spec, run_dir, test, data = r["spec"], r["run_dir"], r["test"], r["data"]
    tgt = spec["tgt"]
    out = r["eval"].stdout
    assert re.search(r"^\+ .*fairseq-generate .*" + re.escape(spec["beam"]), out, re.M)
    name = spec["averaged"]
    assert re.search(r"^\+ .*average_checkpoints .*" + re.escape(spec["averaging"])
                     + f" --output {re.escape(str(run_dir))}/{name}.pt$", out, re.M)
    assert "scoring with other settings than Transformer-Clinic eval_" in out

    averaged = torch_load(run_dir / f"{name}.pt")
    assert averaged["averaged_checkpoints"] == [f"checkpoint{e}.pt" for e in spec["epochs"]]
    models = [torch_load(run_dir / f"checkpoint{e}.pt")["model"] for e in spec["epochs"]]
    c2 = r["checkpoint2"]["model"]
    for key in ("encoder.layers.0.fc1.weight", "decoder.embed_tokens.weight"):
        expected = sum(m[key].double() for m in models) / len(models)
        assert not torch.equal(models[0][key], c2[key])
        assert torch.allclose(averaged["model"][key].double(), expected, atol=1e-7, rtol=0)

    tok_ref = read_lines_utf8(data / "ref" / f"test.tok.{tgt}")
    raw_ref = read_lines_utf8(data / "ref" / f"test.raw.{tgt}")
    hyps = recipes.read_generate_hypotheses(str(run_dir / "eval" / f"generate-test.{name}.txt"))
    assert sorted(hyps) == list(range(len(test)))  # every test sentence translated
    hyp_list = [hyps[i] for i in range(len(test))]
    # the paper's scoring first, then sacreBLEU, then (En-De) the compound-split BLEU
    line, paper = printed_score(out, PAPER_BLEU)
    assert paper == round(ref_bleu(hyp_list, tok_ref), 2)
    detok = read_lines_utf8(run_dir / "eval" / f"test.{name}.detok.{tgt}")
    sacre = sacrebleu.corpus_bleu(detok, [raw_ref], lowercase=spec["lowercase"])
    assert printed_score(out, SACREBLEU) == (line + 1, round(sacre.score, 2))
    if spec["compound"]:
        expected_split = ref_bleu([ref_compound_split(h) for h in hyp_list],
                                  [ref_compound_split(x) for x in tok_ref])
        assert printed_score(out, COMPOUND_BLEU) == (line + 2, round(expected_split, 2))
    else:
        assert "compound" not in out
    case = "case:lc" if spec["lowercase"] else "case:mixed"
    assert re.search(r"signature: nrefs:1\|" + case + r"\|eff:no\|tok:13a\|smooth:exp\|version:", out)
    scores = json.loads((run_dir / "eval" / f"bleu.{name}.json").read_text())
    assert scores["sentences"] == len(test)
