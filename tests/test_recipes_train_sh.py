"""train.sh and eval.sh of examples/<task>/ as commands (DRY_RUN: arithmetic, launchers,
schemes; a stand-in fairseq-train; eval.sh up to its first fairseq command): no fairseq run.
"""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

from recipe_utils import REPO, command_args, command_lines, lines, run_script, script_env

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# ======================================================================================
# train.sh command assembly (DRY_RUN: arithmetic, launchers, schemes; no fairseq run)
# ======================================================================================

def dry_run(task, args, tmp_path, **env):
    env = script_env(DRY_RUN=1, RUNS_DIR=tmp_path / "runs", DATA_BIN=tmp_path / "bin", **env)
    return run_script([os.path.join(REPO, "examples", task, "train.sh")] + args, env, tmp_path,
                      check=False)




@pytest.mark.parametrize(
    "task,depth,gpus,max_tokens,update_freq",
    [("wmt14_en_de", "6l_6l", 4, "", 1), ("wmt14_en_de", "18l_18l", 1, "", 4),
     ("wmt14_en_de", "6l_6l", 8, "4096", 1), ("wmt14_en_fr", "6l_6l", 8, "", 10),
     ("wmt14_en_fr", "60l_12l", 32, "", 8), ("iwslt14_de_en", "6l_6l", 1, "", 1),
     ("wmt14_en_de", "100l_100l", 8, "", 32)],
)
def test_train_derives_update_freq(task, depth, gpus, max_tokens, update_freq, tmp_path):
    extra = {"MAX_TOKENS": max_tokens} if max_tokens else {}
    result = dry_run(task, ["admin", depth], tmp_path, NUM_GPUS=gpus, **extra)
    assert result.returncode == 0, result.stderr
    cmd = command_args(result.stdout)
    assert f"--update-freq {update_freq} " in cmd
    assert f"--distributed-world-size {gpus}" in cmd
    assert "--fp16 --fp16-scale-window 256 --threshold-loss-scale 0.03125" in cmd
    assert "--ddp-backend" not in cmd  # GPUs keep fairseq's default (fast) DDP backend
    assert f"--arch admin_transformer_{'iwslt_de_en' if task.startswith('iwslt') else 'wmt_en_de_' + depth}" in cmd


def test_train_refuses_unreachable_batch(tmp_path):
    result = dry_run("wmt14_en_de", ["admin", "6l_6l"], tmp_path, NUM_GPUS=8)
    assert result.returncode == 2
    assert "--update-freq would be 0.5" in result.stderr
    assert "use MAX_TOKENS=4096 (--update-freq 1) on 8 GPU(s)" in result.stderr
    result = dry_run("wmt14_en_fr", ["admin", "6l_6l"], tmp_path, NUM_GPUS=3)
    assert result.returncode == 2 and "not divisible by 3 GPUs" in result.stderr
    assert "Traceback" not in result.stderr


CLINIC_RADAM = "--optimizer radam --radam-early-steps skip --adam-betas '(0.9, 0.98)' --clip-norm 0.0"
ADMIN_TORCH_ADAM = "--optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 0.0"
CLOSED_FORM = "--admin-init closed-form --admin-omega parameter"
PROFILED = "--admin-init profile --admin-profile-mode clinic --admin-omega parameter"
RECIPE_SCHEMES = "post-ln pre-ln admin admin-paper post-ln-paper pre-ln-paper"


@pytest.mark.parametrize(
    "scheme,flags,optimizer,absent",
    [("post-ln", "--admin-init none", ADMIN_TORCH_ADAM, "--encoder-normalize-before"),
     ("pre-ln", "--admin-init none --encoder-normalize-before --decoder-normalize-before",
      ADMIN_TORCH_ADAM, "--admin-omega"),
     ("admin", CLOSED_FORM, ADMIN_TORCH_ADAM, "--admin-profile-mode"),
     ("admin-paper", PROFILED, CLINIC_RADAM, "--encoder-normalize-before"),
     ("post-ln-paper", "--admin-init none", CLINIC_RADAM, "--encoder-normalize-before"),
     ("pre-ln-paper", "--admin-init none --encoder-normalize-before --decoder-normalize-before",
      CLINIC_RADAM, "--admin-omega")],
)
def test_train_scheme_flags(scheme, flags, optimizer, absent, tmp_path):
    result = dry_run("wmt14_en_de", [scheme, "12l_12l", "7"], tmp_path, NUM_GPUS=4)
    assert result.returncode == 0, result.stderr
    cmd = command_args(result.stdout)
    assert f" {flags} {optimizer} --lr 1e-3 " in cmd and absent not in cmd
    assert cmd.count("--optimizer ") == 1 and cmd.count("--admin-init ") == 1
    assert f"--save-dir {tmp_path}/runs/wmt14_en_de/{scheme}_12l_12l_7 " in cmd
    for published in ("--lr 1e-3", "--warmup-updates 8000", "--warmup-init-lr 1e-07",
                      "--dropout 0.1", "--label-smoothing 0.1", "--share-all-embeddings",
                      "--max-epoch 100", "--max-tokens 8192", "--seed 7"):
        assert published + " " in cmd


def test_train_schemes_are_the_package_table(tmp_path):
    """The recipes take each scheme's flags from fairseq_admin_pos/scheme_flags.py, the
    table make demo and the depth study read: the printed command holds exactly the table's
    model flags and its optimizer over Adam's defaults."""
    import shlex

    from fairseq_admin_pos import scheme_flags

    for scheme in RECIPE_SCHEMES.split() + ["kasai"]:
        words = shlex.split(command_args(dry_run(
            "wmt14_en_de", [scheme, "12l_1l"], tmp_path, NUM_GPUS=4).stdout)[2:])
        want = scheme_flags.train_flags(scheme)
        at = words.index(want[0])
        assert words[at:at + len(want)] == want, scheme


def test_train_admin_is_the_closed_form(tmp_path):
    """`train.sh admin 18l_18l` (and `train.sh` without arguments: admin, 6l_6l) trains the
    recommended Admin: closed-form omegas, each a trainable vector, with Adam, at the
    recipe's (Transformer-Clinic's) schedule, batch, length, fp16 and seed."""
    recipe = [CLOSED_FORM, ADMIN_TORCH_ADAM, "--lr 1e-3 --lr-scheduler inverse_sqrt "
              "--warmup-init-lr 1e-07 --warmup-updates 8000", "--weight-decay 0.0",
              "--criterion label_smoothed_cross_entropy --label-smoothing 0.1",
              "--max-tokens 8192 --update-freq 1 --max-update 500000 --max-epoch 100 "
              "--stop-min-lr 1e-09", "--seed 1111",
              "--fp16 --fp16-scale-window 256 --threshold-loss-scale 0.03125",
              "--distributed-world-size 4", "--share-all-embeddings",
              "--arch admin_transformer_wmt_en_de_18l_18l"]
    cmd = command_args(dry_run("wmt14_en_de", ["admin", "18l_18l"], tmp_path, NUM_GPUS=4).stdout)
    for flags in recipe:
        assert f" {flags} " in cmd + " ", flags
    for absent in ("--admin-profile-mode", "radam", "profile"):
        assert absent not in cmd
    default = command_args(dry_run("wmt14_en_de", [], tmp_path, NUM_GPUS=4).stdout)
    assert default.replace("6l_6l", "18l_18l") == cmd


def test_train_admin_paper_is_the_papers_admin(tmp_path):
    """`train.sh admin-paper 18l_18l` is Transformer-Clinic's WMT14 En-De Admin command
    (nmt-experiments/wmt14_en-de.md) in this package's flags: profiled omega (Clinic mode) as
    a trainable vector, RAdam with Clinic's first steps, its schedule (lr 1e-3, 8000 warmup
    updates from 1e-7), stopping rule, fp16 loss scaling, seed and batch."""
    clinic = [PROFILED, CLINIC_RADAM, "--lr 1e-3 --lr-scheduler inverse_sqrt "
              "--warmup-init-lr 1e-07 --warmup-updates 8000", "--weight-decay 0.0",
              "--criterion label_smoothed_cross_entropy --label-smoothing 0.1",
              "--max-tokens 8192 --update-freq 1 --max-update 500000 --max-epoch 100 "
              "--stop-min-lr 1e-09", "--seed 1111",
              "--fp16 --fp16-scale-window 256 --threshold-loss-scale 0.03125",
              "--distributed-world-size 4", "--share-all-embeddings",
              "--arch admin_transformer_wmt_en_de_18l_18l"]
    cmd = command_args(dry_run("wmt14_en_de", ["admin-paper", "18l_18l"], tmp_path,
                               NUM_GPUS=4).stdout)
    for flags in clinic:
        assert f" {flags} " in cmd + " ", flags
    assert f"--save-dir {tmp_path}/runs/wmt14_en_de/admin-paper_18l_18l_1111 " in cmd


@pytest.mark.parametrize("task,lr,warmup,batch,length", [
    ("wmt14_en_fr", "7e-4", "8000", "--max-tokens 8000 --update-freq 10",
     "--max-epoch 50 --stop-min-lr 1e-09"),
    ("iwslt14_de_en", "7e-4", "6000", "--max-tokens 4096 --update-freq 1", "--max-update 100000"),
])
def test_train_other_tasks_follow_clinic(task, lr, warmup, batch, length, tmp_path):
    gpus = 8 if task == "wmt14_en_fr" else 1
    cmd = command_args(dry_run(task, ["admin-paper"], tmp_path, NUM_GPUS=gpus).stdout)
    for flags in (PROFILED + " " + CLINIC_RADAM, f"--lr {lr} ", f"--warmup-updates {warmup} ",
                  f"{batch} {length} ", "--fp16 --fp16-scale-window 256 --threshold-loss-scale 0.03125"):
        assert flags in cmd, flags
    if task == "iwslt14_de_en":
        for published in ("--dropout 0.3 ", "--weight-decay 0.0001 ", "--keep-last-epochs 20 "):
            assert published in cmd
        assert "--stop-min-lr" not in cmd


FAKE_FAIRSEQ_TRAIN = """#!{python}
import json, os, sys
with open(os.environ["ARGV_OUT"], "w") as out:
    json.dump(sys.argv[1:], out)
"""


def test_extra_args_arrive_as_shell_words(tmp_path):
    """EXTRA_ARGS is split like shell words: a quoted value stays one argument, nothing in it
    is expanded. A stand-in fairseq-train (FAIRSEQ_BIN) records the argv it receives."""
    fake_bin = tmp_path / "fake_bin"
    fake_bin.mkdir()
    (fake_bin / "fairseq-train").write_text(FAKE_FAIRSEQ_TRAIN.format(python=sys.executable))
    (fake_bin / "fairseq-train").chmod(0o755)
    data = tmp_path / "bin"
    data.mkdir()
    (data / "dict.en.txt").write_text("a 1\n")
    extra = "--adam-betas '(0.9, 0.999)' --log-interval 7 --tensorboard-logdir \"$HOME/tb dir\""
    env = script_env(FAIRSEQ_BIN=fake_bin, PYTHON=sys.executable, DEVICE="cpu",
                     RUNS_DIR=tmp_path / "runs", DATA_BIN=data, ARGV_OUT=tmp_path / "argv.json",
                     EXTRA_ARGS=extra)
    run_script([os.path.join(REPO, "examples/wmt14_en_de/train.sh"), "admin", "18l_18l"], env,
               tmp_path)
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[-6:] == ["--adam-betas", "(0.9, 0.999)", "--log-interval", "7",
                         "--tensorboard-logdir", "$HOME/tb dir"]
    # the recipe's own betas come first, so argparse takes the ones of EXTRA_ARGS
    assert argv.count("--adam-betas") == 2 and argv[argv.index("--adam-betas") + 1] == "(0.9, 0.98)"
    recorded = json.loads((tmp_path / "runs/wmt14_en_de/admin_18l_18l_1111/recipe.json").read_text())
    assert recorded["extra_args"] == extra


def test_train_launchers(tmp_path):
    torchrun = dry_run("wmt14_en_fr", ["admin", "60l_12l"], tmp_path, LAUNCHER="torchrun",
                       NNODES=2, GPUS_PER_NODE=8, NODE_RANK=1, MASTER_ADDR="node0",
                       MASTER_PORT=29411)
    cmd = command_args(torchrun.stdout)
    assert cmd.startswith("+ torchrun --nnodes 2 --nproc-per-node 8 --node-rank 1 "
                          "--master-addr node0 --master-port 29411 --no-python ")
    assert "--distributed-world-size 16" in cmd and "--update-freq 16 " in cmd
    slurm = dry_run("wmt14_en_fr", ["admin", "60l_12l"], tmp_path, SLURM_PROCID=3,
                    SLURM_NTASKS=16, SLURM_NNODES=2, GPUS_PER_NODE=8, MASTER_PORT=29412)
    cmd = command_args(slurm.stdout)
    assert "launcher slurm" in slurm.stdout
    assert "--distributed-world-size 16 --distributed-port 29412" in cmd
    assert "fairseq-train " in cmd and "torchrun" not in cmd
    multi = dry_run("wmt14_en_fr", ["admin"], tmp_path, NNODES=2, GPUS_PER_NODE=8)
    assert multi.returncode == 2 and "LAUNCHER=torchrun or LAUNCHER=slurm" in multi.stderr
    bf16 = dry_run("wmt14_en_de", ["pre-ln"], tmp_path, NUM_GPUS=4, PRECISION="bf16")
    cmd = command_args(bf16.stdout)
    assert "examples/common/fairseq_train_bf16.py" in cmd and "--bf16" in cmd and "--fp16" not in cmd
    fp32 = dry_run("wmt14_en_de", ["pre-ln"], tmp_path, NUM_GPUS=4, PRECISION="fp32")
    assert "--fp16" not in command_args(fp32.stdout)


@pytest.mark.parametrize(
    "args,env,message",
    [(["rezero"], {}, f"SCHEME 'rezero' is not valid; valid choices: {RECIPE_SCHEMES} kasai"),
     (["admin-closed-form"], {}, "SCHEME 'admin-closed-form' is not valid (admin-closed-form is "
      f"now called admin); valid choices: {RECIPE_SCHEMES} kasai"),
     (["admin"], {"ADMIN_INIT": "closed-form"}, "ADMIN_INIT is no longer read: SCHEME sets"),
     (["admin"], {"OPTIMIZER": "adam"}, "OPTIMIZER is no longer read: SCHEME sets"),
     (["admin"], {"EXTRA_ARGS": "--adam-betas '(0.9, 0.98)"},
      "EXTRA_ARGS cannot be split into arguments (No closing quotation)"),
     (["admin", "24l_24l"], {}, "DEPTH '24l_24l' is not a wmt14_en_de preset; valid choices: "
      "6l_6l 12l_12l 18l_18l 60l_12l 100l_100l 6l_1l 12l_1l 12l_2l 18l_1l 18l_2l 24l_1l"),
     (["admin"], {"PRECISION": "fp8"}, "PRECISION 'fp8' is not valid; valid choices: fp16 bf16 fp32"),
     (["admin"], {"DEVICE": "tpu"}, "DEVICE 'tpu' is not valid"),
     (["admin"], {"DEVICE": "cpu", "PRECISION": "fp16"}, "PRECISION=fp16 needs DEVICE=gpu"),
     (["admin"], {"DEVICE": "cpu", "NUM_GPUS": "2"}, "DEVICE=cpu runs one process"),
     (["admin"], {"NUM_GPUS": "0"}, "no GPU visible")],
)
def test_train_rejects_bad_settings(args, env, message, tmp_path):
    result = dry_run("wmt14_en_de", args, tmp_path, **{"NUM_GPUS": 4, **env})
    assert result.returncode == 2 and message in result.stderr
    if message.startswith("SCHEME"):
        assert result.stderr == f"error: {message}\n"  # one line
    assert "Traceback" not in result.stderr and not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------------------
# deep encoder, shallow decoder: the shapes, and Kasai et al.'s published training
# --------------------------------------------------------------------------------------

# Kasai, Pappas, Peng, Cross & Smith, ICLR 2021: jungokasai/deep-shallow's README command
# (the 12-1 WMT16 En-De model), restated here independently of the recipe
KASAI = {"lr": "5e-4", "warmup": "4000", "warmup_init": "1e-07", "dropout": "0.2",
         "gpus": 16, "max_tokens": 4096, "updates": "300000", "seed": "1", "positions": "10000"}
# their fairseq's default clipping (they pass no --clip-norm), Adam with their betas
KASAI_ADAM = ["--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "25.0"]
SHALLOW_SHAPES = {"6l_1l": (6, 1), "12l_1l": (12, 1), "12l_2l": (12, 2), "18l_1l": (18, 1),
                  "18l_2l": (18, 2), "24l_1l": (24, 1)}


def command_words(stdout):
    """The printed fairseq-train command as argv words (its shell quoting undone)."""
    import shlex

    return shlex.split(command_args(stdout)[2:])


def flag_value(words, flag):
    assert words.count(flag) == 1, (flag, words)
    return words[words.index(flag) + 1]


def arch_depths(words):
    m = re.fullmatch(r"admin_transformer_wmt_en_de_(\d+)l_(\d+)l", flag_value(words, "--arch"))
    assert m, flag_value(words, "--arch")
    return int(m.group(1)), int(m.group(2))


@pytest.mark.parametrize("task,depth,gpus,update_freq", [
    ("wmt14_en_de", "12l_1l", 16, 1), ("wmt14_en_de", "6l_1l", 8, 2),
    ("wmt14_en_de", "24l_1l", 4, 4), ("wmt14_en_de", "18l_2l", 1, 16),
    ("wmt14_en_fr", "12l_1l", 16, 1), ("wmt14_en_fr", "24l_1l", 2, 8),
])
def test_train_kasai_prints_kasais_published_settings(task, depth, gpus, update_freq, tmp_path):
    """`train.sh kasai DEPTH` is Kasai et al.'s command in this package's flags: stock Post-LN,
    Adam, their schedule, dropout, length, fp16 and positions; the effective batch stays
    16 GPUs x 4096 tokens on other GPU counts through --update-freq."""
    result = dry_run(task, ["kasai", depth], tmp_path, NUM_GPUS=gpus)
    assert result.returncode == 0, result.stderr
    words = command_words(result.stdout)
    assert arch_depths(words) == SHALLOW_SHAPES[depth]
    assert words[words.index("--admin-init"):words.index("--admin-init") + 2] == ["--admin-init",
                                                                                  "none"]
    i = words.index("--optimizer")
    assert words[i:i + len(KASAI_ADAM)] == KASAI_ADAM
    for flag, want in (("--lr", KASAI["lr"]), ("--warmup-updates", KASAI["warmup"]),
                       ("--warmup-init-lr", KASAI["warmup_init"]),
                       ("--lr-scheduler", "inverse_sqrt"), ("--dropout", KASAI["dropout"]),
                       ("--attention-dropout", "0.0"), ("--activation-dropout", "0.0"),
                       ("--weight-decay", "0.0"), ("--label-smoothing", "0.1"),
                       ("--max-update", KASAI["updates"]), ("--stop-min-lr", "1e-09"),
                       ("--seed", KASAI["seed"]),
                       ("--max-source-positions", KASAI["positions"]),
                       ("--max-target-positions", KASAI["positions"]),
                       ("--max-tokens", str(KASAI["max_tokens"])),
                       ("--update-freq", str(update_freq)),
                       ("--distributed-world-size", str(gpus))):
        assert flag_value(words, flag) == want, flag
    # the effective batch: GPUs x max-tokens x update-freq = Kasai's 16 x 4096
    assert gpus * int(flag_value(words, "--max-tokens")) * int(flag_value(words, "--update-freq")) \
        == KASAI["gpus"] * KASAI["max_tokens"]
    assert f"= {KASAI['gpus'] * KASAI['max_tokens']} tokens/update" in result.stdout
    # fp16 with fairseq's default loss scaling; trained by updates, not epochs; stock residual
    assert "--fp16" in words and "--fp16-scale-window" not in words
    assert "--threshold-loss-scale" not in words
    for absent in ("--max-epoch", "--admin-omega", "--admin-profile-mode",
                   "--encoder-normalize-before", "--radam-early-steps"):
        assert absent not in words, absent
    assert "--share-all-embeddings" in words
    assert flag_value(words, "--save-dir") == f"{tmp_path}/runs/{task}/kasai_{depth}_1"


@pytest.mark.parametrize("task,depth,gpus,max_tokens,update_freq,effective,lr", [
    # the Transformer-Clinic report's setting: 8 GPUs x 4096 tokens = the recipe's 32768
    ("wmt14_en_de", "12l_1l", 8, "4096", 1, 32768, "1e-3"),
    ("wmt14_en_de", "18l_2l", 4, "", 1, 32768, "1e-3"),
    ("wmt14_en_de", "24l_1l", 1, "", 4, 32768, "1e-3"),
    # En-Fr: the Admin paper's 6l_6l batch
    ("wmt14_en_fr", "12l_1l", 8, "", 10, 640000, "7e-4"),
])
def test_train_shallow_shapes_take_the_admin_papers_recipe(task, depth, gpus, max_tokens,
                                                           update_freq, effective, lr, tmp_path):
    extra = {"MAX_TOKENS": max_tokens} if max_tokens else {}
    result = dry_run(task, ["admin-paper", depth], tmp_path, NUM_GPUS=gpus, **extra)
    assert result.returncode == 0, result.stderr
    words = command_words(result.stdout)
    cmd = command_args(result.stdout)
    assert arch_depths(words) == SHALLOW_SHAPES[depth]
    assert f" {PROFILED} {CLINIC_RADAM} " in cmd
    assert flag_value(words, "--lr") == lr and flag_value(words, "--warmup-updates") == "8000"
    assert flag_value(words, "--dropout") == "0.1" and flag_value(words, "--seed") == "1111"
    assert flag_value(words, "--update-freq") == str(update_freq)
    assert gpus * int(flag_value(words, "--max-tokens")) * update_freq == effective
    assert "--fp16 --fp16-scale-window 256 --threshold-loss-scale 0.03125" in cmd
    assert "--max-source-positions" not in words


def test_train_kasai_seed_and_other_schemes_unchanged(tmp_path):
    """An explicit SEED wins over Kasai's 1; the other schemes keep Clinic's 1111 and recipe
    at a shallow shape."""
    words = command_words(dry_run("wmt14_en_de", ["kasai", "12l_1l", "7"], tmp_path,
                                  NUM_GPUS=16).stdout)
    assert flag_value(words, "--seed") == "7"
    assert flag_value(words, "--save-dir").endswith("/kasai_12l_1l_7")
    # kasai at a deep-deep shape is Kasai's recipe too (their 6-6 baselines)
    words = command_words(dry_run("wmt14_en_de", ["kasai", "100l_100l"], tmp_path,
                                  NUM_GPUS=16).stdout)
    assert flag_value(words, "--max-tokens") == "4096" and "--max-epoch" not in words
    words = command_words(dry_run("wmt14_en_de", ["post-ln", "12l_1l"], tmp_path,
                                  NUM_GPUS=4).stdout)
    assert flag_value(words, "--seed") == "1111" and flag_value(words, "--lr") == "1e-3"


@pytest.mark.parametrize("task,args,message", [
    ("wmt14_en_de", ["kasai", "48l_1l"],
     "DEPTH '48l_1l' is not a wmt14_en_de preset; valid choices: 6l_6l 12l_12l 18l_18l "
     "60l_12l 100l_100l 6l_1l 12l_1l 12l_2l 18l_1l 18l_2l 24l_1l"),
    ("wmt14_en_fr", ["admin", "12l_12l"],
     "DEPTH '12l_12l' is not a wmt14_en_fr preset; valid choices: 6l_6l 60l_12l 6l_1l 12l_1l "
     "12l_2l 18l_1l 18l_2l 24l_1l"),
    ("iwslt14_de_en", ["kasai"],
     f"SCHEME 'kasai' is not valid; valid choices: {RECIPE_SCHEMES}"),
    ("wmt14_en_de", ["kasai", "12l_1l"],  # 65536 tokens are not reachable on 3 GPUs
     "not divisible by 3 GPUs"),
])
def test_train_shallow_and_kasai_refusals(task, args, message, tmp_path):
    result = dry_run(task, args, tmp_path, NUM_GPUS=3 if "3 GPUs" in message else 4)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0] == f"error: {message}" or message in result.stderr
    if "DEPTH" in message or "SCHEME" in message:
        assert lines == [f"error: {message}"]  # one line
    assert "Traceback" not in result.stderr and not (tmp_path / "runs").exists()
    assert "+ " not in result.stdout  # no command printed


def test_eval_of_a_kasai_run_has_no_epoch_bound(tmp_path):
    """eval.sh reads the scheme from the run's recipe.json: a kasai run (trained by updates,
    past the tasks' epoch bounds) is averaged without --checkpoint-upper-bound and decoded
    with beam 5, lenpen 1; another run keeps Clinic's bound. (No checkpoints here: the
    averaging step is the last to run, and fails.)"""
    data = tmp_path / "data"
    (data / "ref").mkdir(parents=True)
    for name in ("test.tok.fr", "test.raw.fr"):
        (data / "ref" / name).write_text("x\n")
    out = {}
    for scheme in ("kasai", "admin"):
        run_dir = tmp_path / "runs" / f"{scheme}_12l_1l"
        run_dir.mkdir(parents=True)
        (run_dir / "recipe.json").write_text(json.dumps({"scheme": scheme, "task": "wmt14_en_fr"},
                                                        indent=2, sort_keys=True) + "\n")
        env = script_env(DEVICE="cpu", DATA_DIR=data)
        out[scheme] = run_script([os.path.join(REPO, "examples/wmt14_en_fr/eval.sh"), run_dir],
                                 env, tmp_path, check=False)
        assert out[scheme].returncode != 0  # nothing to average
    kasai, admin = (command_lines(out[s].stdout) for s in ("kasai", "admin"))
    assert out["kasai"].stdout.startswith("scoring as a train.sh kasai run: last 10 epoch "
                                          "checkpoints averaged (no epoch bound), beam 5, lenpen 1")
    assert "--num-epoch-checkpoints 10 --output" in kasai[0] and "--checkpoint-upper-bound" not in kasai[0]
    assert kasai[0].endswith("/kasai_12l_1l/averaged_last10.pt")
    assert "--num-epoch-checkpoints 10 --checkpoint-upper-bound 50 --output" in admin[0]
    assert "scoring as Transformer-Clinic" in out["admin"].stdout
