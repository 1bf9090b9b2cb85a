"""The fairseq entry points users already use, with the plugin:

* ``fairseq-hydra-train`` with the shipped config ``examples/wmt14_en_de/hydra/admin-paper_18l_18l.yaml``:
  the config is the ``train.sh admin-paper 18l_18l`` recipe, and a run of it (shrunk through hydra
  overrides) trains exactly what ``fairseq-train`` with the recipe's command trains;
* ``fairseq-interactive`` with a sentencepiece model on raw text, against ``fairseq-generate``;
* the hub interface (``from_pretrained`` with ``user_dir``) translating raw sentences.

Every command is the console script a user types (the venv's ``bin/``), run from the
repository root with ``--user-dir fairseq_admin_pos`` / ``common.user_dir``.
"""
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from export_utils import assert_same_hypotheses
from fairseq_cli_utils import (
    REPO,
    TINY_MODEL,
    USER_DIR,
    env,
    hypotheses,
    load_model_state,
    preprocess,
    train,
    train_losses,
    write_reversal_corpus,
)

VENV_BIN = Path(sys.executable).parent
HYDRA_DIR = REPO / "examples" / "wmt14_en_de" / "hydra"
HYDRA_CONFIG = "admin-paper_18l_18l"


def console(tool, args, stdin=None, check=True, timeout=600):
    """Run a console script of the venv (``fairseq-train``, ...) from the repository root."""
    cmd = [str(VENV_BIN / tool), *map(str, args)]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), input=stdin, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{shlex.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def train_sh_command(**settings):
    """The fairseq-train command of ``examples/wmt14_en_de/train.sh admin-paper 18l_18l``, as its
    DRY_RUN prints it (argv, without running anything)."""
    e = env()
    for key in ("CUDA_VISIBLE_DEVICES", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NNODES",
                "NUM_GPUS", "NNODES", "LAUNCHER", "EXTRA_ARGS", "DATA_DIR", "DATA_BIN",
                "RUN_DIR", "RUNS_DIR", "MAX_TOKENS", "EFFECTIVE_BATCH", "PRECISION", "DEVICE"):
        e.pop(key, None)
    e.update({"DRY_RUN": "1", **{k: str(v) for k, v in settings.items()}})
    proc = subprocess.run(["bash", "examples/wmt14_en_de/train.sh", "admin-paper", "18l_18l"],
                          cwd=REPO, env=e, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("+ ")][-1]
    argv = shlex.split(line[2:])
    assert Path(argv[0]).name == "fairseq-train", line
    return argv


def compose_hydra(overrides=()):
    """The config fairseq-hydra-train composes from the shipped file (in this process):
    hydra's composition as fairseq-hydra-train runs it (hydra 1.1 semantics), then fairseq's
    add_defaults."""
    from fairseq.dataclass.initialize import add_defaults, hydra_init
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import fairseq_admin_pos

    fairseq_admin_pos.register()
    GlobalHydra.instance().clear()
    hydra_init(HYDRA_CONFIG)
    try:
        with initialize_config_dir(config_dir=str(HYDRA_DIR), version_base="1.1"):
            cfg = compose(HYDRA_CONFIG, overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()
    add_defaults(cfg)
    return cfg


# ======================================================================================
# fairseq-hydra-train
# ======================================================================================


def test_hydra_config_is_the_train_sh_recipe():
    """Every setting of the hydra config equals what fairseq-train gets from train.sh's
    command (4 GPUs, fp16): all of fairseq's sections, and the model's settings after the
    architecture function, key by key in both directions."""
    from fairseq import options
    from fairseq.dataclass.configs import FairseqConfig
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.models import ARCH_CONFIG_REGISTRY
    from omegaconf import OmegaConf, open_dict

    argv = train_sh_command(NUM_GPUS=4)
    args = options.parse_args_and_arch(options.get_training_parser(), argv[1:])
    expected = convert_namespace_to_omegaconf(args)
    got = compose_hydra()

    paths = {("common", "user_dir"), ("task", "data"), ("checkpoint", "save_dir")}
    diffs = []
    for group in FairseqConfig.__dataclass_fields__:
        # scoring: fairseq-train's default --scoring bleu, used by fairseq-generate only
        if group in ("model", "scoring"):
            continue
        g, e = got.get(group), expected.get(group)
        if g is None or e is None:
            if g is not e:
                diffs.append(f"{group}: hydra {g}, fairseq-train {e}")
            continue
        for key in sorted(set(g) | set(e)):
            gv, ev = g.get(key, "<absent>"), e.get(key, "<absent>")
            if (group, key) in paths:
                gv = str(REPO / gv) if key != "save_dir" else Path(gv).name
                ev = ev if key != "save_dir" else "hydra_" + Path(ev).name
            if gv != ev:
                diffs.append(f"{group}.{key}: hydra {gv!r}, fairseq-train {ev!r}")
    # the model: fairseq's build_model runs the _name architecture function on the section
    with open_dict(got.model):
        ARCH_CONFIG_REGISTRY[got.model._name](got.model)
    model = OmegaConf.to_container(got.model)
    assert model.pop("_name") == args.arch == "admin_transformer_wmt_en_de_18l_18l"
    from fairseq_admin_pos.models.admin_transformer import AdminTransformerConfig

    for key in sorted((set(model) | set(AdminTransformerConfig.__dataclass_fields__)) - {"_name"}):
        gv, ev = model.get(key), getattr(args, key, None)
        if key in ("max_source_positions", "max_target_positions") and gv is None:
            continue  # neither run sets them on the model: both take the task's (1024)
        if gv != ev:
            diffs.append(f"model.{key}: hydra {gv!r}, fairseq-train {ev!r}")
    assert not diffs, "\n".join(diffs)


# fairseq-hydra-train overrides that shrink the 18L-18L recipe to a CPU smoke run, and the
# train.sh settings that do the same for its fairseq-train command
SMOKE_MODEL = {"encoder_embed_dim": 32, "decoder_embed_dim": 32, "encoder_ffn_embed_dim": 64,
               "decoder_ffn_embed_dim": 64, "encoder_attention_heads": 2,
               "decoder_attention_heads": 2, "encoder_pos_emb": "scaled-sinusoidal"}
SMOKE_UPDATES = 3


def hydra_smoke_overrides(data, save_dir):
    return [
        f"task.data={data}", "task.source_lang=src", "task.target_lang=tgt",
        f"checkpoint.save_dir={save_dir}",
        "common.fp16=false", "common.cpu=true", "common.log_interval=1",
        "common.no_progress_bar=true",
        "distributed_training.distributed_world_size=1",
        "distributed_training.ddp_backend=legacy_ddp",
        "dataset.max_tokens=400", "dataset.num_workers=0", "dataset.disable_validation=true",
        f"optimization.max_update={SMOKE_UPDATES}",
        *[f"+model.{k}={v}" for k, v in SMOKE_MODEL.items()],
    ]


def train_sh_smoke_command(data, run_dir):
    extra = ["--source-lang", "src", "--target-lang", "tgt", "--log-interval", "1",
             "--no-progress-bar", "--num-workers", "0", "--disable-validation",
             "--max-update", str(SMOKE_UPDATES)]
    for k, v in SMOKE_MODEL.items():
        extra += ["--" + k.replace("_", "-"), str(v)]
    return train_sh_command(DEVICE="cpu", EFFECTIVE_BATCH=400, MAX_TOKENS=400, DATA_BIN=data,
                            RUN_DIR=run_dir, EXTRA_ARGS=" ".join(extra))


@pytest.fixture(scope="module")
def hydra_and_argparse_runs(tiny_data, tmp_path_factory):
    """The shipped hydra config and train.sh's fairseq-train command, both shrunk the same
    way, trained on the same data."""
    root = tmp_path_factory.mktemp("hydra_runs")
    hydra = console("fairseq-hydra-train", [
        "--config-dir", HYDRA_DIR.relative_to(REPO), "--config-name", HYDRA_CONFIG,
        *hydra_smoke_overrides(tiny_data, root / "hydra")])
    argv = train_sh_smoke_command(tiny_data, root / "argparse")
    argparse_run = subprocess.run(argv, cwd=REPO, env=env(), capture_output=True, text=True,
                                  timeout=600)
    assert argparse_run.returncode == 0, argparse_run.stderr[-5000:]
    return {"hydra": (hydra.stdout + hydra.stderr, root / "hydra" / "checkpoint_last.pt"),
            "argparse": (argparse_run.stdout + argparse_run.stderr,
                         root / "argparse" / "checkpoint_last.pt")}


def test_hydra_train_matches_fairseq_train(hydra_and_argparse_runs):
    """Same losses at every update and the same weights as fairseq-train with the recipe."""
    (h_log, h_ck), (a_log, a_ck) = (hydra_and_argparse_runs[k] for k in ("hydra", "argparse"))
    assert len(train_losses(h_log)) == SMOKE_UPDATES, h_log[-3000:]
    assert train_losses(h_log) == train_losses(a_log)
    h, a = load_model_state(h_ck), load_model_state(a_ck)
    assert set(h) == set(a)
    for k, v in h.items():
        if torch.is_tensor(v):
            assert torch.equal(v, a[k]), k
        else:
            assert v == a[k], k


def test_hydra_applies_architecture_and_plugin_settings(hydra_and_argparse_runs):
    """The built model has the 18L-18L architecture's depth (not overridden), the widths of
    the overrides, and the plugin settings of the config file and the overrides: positions,
    and omegas profiled on the first batch as Transformer-Clinic does (per stack a running
    ratio that starts at 1.0 and grows with every sub-layer's variance), each a vector."""
    state = load_model_state(hydra_and_argparse_runs["hydra"][1])

    def layers(stack):
        return len({k.split(".")[2] for k in state if k.startswith(f"{stack}.layers.")})

    assert layers("encoder") == 18 and layers("decoder") == 18
    assert state["encoder.layers.0.fc1.weight"].shape == (64, 32)
    settings = state["_extra_state"]
    assert {k: settings[k] for k in ("admin_init", "admin_profile_mode", "admin_omega",
                                     "encoder_pos_emb", "decoder_pos_emb")} == {
        "admin_init": "profile", "admin_profile_mode": "clinic", "admin_omega": "parameter",
        "encoder_pos_emb": "scaled-sinusoidal", "decoder_pos_emb": "sinusoidal"}
    assert "encoder.embed_positions.embed.scaling" in state
    assert not any(k.startswith("decoder.embed_positions.") for k in state)
    assert state["admin_profiled"].item() == 1
    names = {"encoder": ("self_attn_residual", "final_residual"),
             "decoder": ("self_attn_residual", "encoder_attn_residual", "final_residual")}
    for stack, subs in names.items():
        omegas = [state[f"{stack}.layers.{i}.{sub}.omega"] for i in range(18) for sub in subs]
        assert all(w.shape == (32,) for w in omegas)  # trainable vectors
        means = [w.double().mean().item() for w in omegas]
        # 3 updates at the warm-up's learning rate (< 1e-6) move them by far less than 1e-4
        assert means[0] == pytest.approx(1.0, abs=1e-4)
        assert all(b > a + 1e-3 for a, b in zip(means, means[1:])), means


def test_hydra_checkpoint_generates_like_fairseq_train(tiny_data, hydra_and_argparse_runs):
    """A checkpoint written by fairseq-hydra-train loads in fairseq-generate and translates
    exactly as the fairseq-train one."""
    outs = []
    for kind in ("hydra", "argparse"):
        out = console("fairseq-generate", [
            tiny_data, "--user-dir", "fairseq_admin_pos", "--path",
            hydra_and_argparse_runs[kind][1], "--beam", "2", "--cpu", "--batch-size", "8",
            "--gen-subset", "valid", "--max-len-b", "12"]).stdout
        outs.append(sorted(ln for ln in out.splitlines() if ln.startswith(("H-", "D-"))))
    assert len(outs[0]) == 2 * 24 and outs[0] == outs[1]


def test_hydra_checkpoint_exports_to_plain_fairseq(tiny_data, tiny_raw,
                                                   hydra_and_argparse_runs, tmp_path):
    """fairseq-admin-export on the fairseq-hydra-train checkpoint (its config an omegaconf
    tree that lacks the keys the run left at their defaults; profiled omega vectors,
    scaled-sinusoid encoder positions): plain fairseq-generate, with no --user-dir,
    translates the export exactly as the plugin translates the original (same hypotheses,
    scores within 1e-4), and so does CTranslate2 with the settings of
    fairseq_admin_pos.export.ct2."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from fairseq_admin_pos.export.ct2 import translate

    original = hydra_and_argparse_runs["hydra"][1]
    export = tmp_path / "stock.pt"
    out = console("fairseq-admin-export", [original, "--out", export,
                                           "--ctranslate2", tmp_path / "ct2"]).stdout
    assert "admin model -> stock transformer (encoder learned, decoder sinusoidal positions; " \
           "per-side embedding tables)" in out, out
    generate = ["--beam", "2", "--cpu", "--batch-size", "8", "--gen-subset", "valid",
                "--max-len-b", "12"]
    plugin = console("fairseq-generate", [tiny_data, "--user-dir", "fairseq_admin_pos",
                                          "--path", original, *generate])
    plain = console("fairseq-generate", [tiny_data, "--path", export, *generate])
    assert "fairseq_admin_pos" not in plain.stdout + plain.stderr
    theirs = hypotheses(plain.stdout)
    assert_same_hypotheses(hypotheses(plugin.stdout), theirs, 24)
    sources = [line.split() for line in (tiny_raw / "valid.src").read_text().splitlines()]
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu",
                                        compute_type="float32", intra_threads=1)
    ct2 = translate(translator, sources, beam=2, lenpen=1.0, max_len_a=0,
                    max_len_b=12, batch_size=8)
    assert [" ".join(tokens) for tokens, _ in ct2] == [h.split("\t")[1] for h in theirs]


@pytest.mark.parametrize("override,message", [
    ("+model.encoder_layer=2",
     "model.encoder_layer is not a setting of admin_transformer; did you mean "
     "model.encoder_layers"),
    ("model.admin_init=sometimes",
     "model.admin_init='sometimes' (--admin-init) is not valid; valid choices: closed-form, "
     "profile, none"),
    ("+model.decoder_layers=two", "model.decoder_layers='two' (--decoder-layers): Value 'two'"),
])
def test_hydra_bad_model_setting_is_named(tiny_data, override, message):
    """A wrong model key, choice or type stops fairseq's model building with the key, its
    flag and the valid choices (the same call fairseq-hydra-train's training makes)."""
    from fairseq import tasks

    cfg = compose_hydra([f"task.data={tiny_data}", "task.source_lang=src",
                         "task.target_lang=tgt", override])
    task = tasks.setup_task(cfg.task)
    with pytest.raises(ValueError) as err:
        task.build_model(cfg.model)
    assert message in str(err.value)


def test_config_dataclass_follows_add_args():
    """AdminTransformerConfig is generated from add_args: a flag added there is a hydra
    setting with its type, choices and help, with no second edit."""
    import argparse
    import typing

    from fairseq_admin_pos.models import config
    from fairseq_admin_pos.models.admin_transformer import (AdminTransformerConfig,
                                                            AdminTransformerModel)

    fields = AdminTransformerConfig.__dataclass_fields__
    parser = argparse.ArgumentParser(add_help=False)
    AdminTransformerModel.add_args(parser)
    flags = {a.dest: a for a in parser._actions if a.option_strings}
    assert set(fields) - {"_name"} == set(flags)
    assert fields["admin_init"].metadata["help"] == flags["admin_init"].help
    assert fields["admin_init"].metadata["choices"] == ["closed-form", "profile", "none"]
    assert fields["encoder_layers"].type == typing.Optional[int]
    assert fields["share_all_embeddings"].type == typing.Optional[bool]

    def more_flags(p):
        AdminTransformerModel.add_args(p)
        p.add_argument("--admin-new-knob", type=float, choices=[0.5, 1.0], help="a new flag")

    dc = config.config_dataclass("Extended", more_flags)
    new = dc.__dataclass_fields__["admin_new_knob"]
    assert new.type == typing.Optional[float] and new.default is None
    assert new.metadata == {"help": "a new flag", "flag": "--admin-new-knob",
                            "choices": [0.5, 1.0]}


def test_fairseq_rejects_the_dataclass_in_its_model_registry(tiny_data, monkeypatch):
    """Why AdminTransformerConfig is not in fairseq's MODEL_DATACLASS_REGISTRY (see
    models/config.py): fairseq-train keeps an argparse model's settings as a Namespace, and
    its add_defaults then fails to merge that Namespace into the registered dataclass."""
    from fairseq import options
    from fairseq.dataclass.initialize import add_defaults
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.models import MODEL_DATACLASS_REGISTRY

    from fairseq_admin_pos.models.admin_transformer import AdminTransformerConfig

    argv = [str(tiny_data), "--user-dir", USER_DIR, "--arch", "admin_transformer_tiny",
            "--cpu", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "400"]
    cfg = convert_namespace_to_omegaconf(
        options.parse_args_and_arch(options.get_training_parser(), argv))
    add_defaults(cfg)  # as registered: fine
    monkeypatch.setitem(MODEL_DATACLASS_REGISTRY, "admin_transformer", AdminTransformerConfig)
    cfg = convert_namespace_to_omegaconf(
        options.parse_args_and_arch(options.get_training_parser(), argv))
    with pytest.raises(ValueError, match=r"Invalid input\. Supports one of \[dict,list,DictConfig"):
        add_defaults(cfg)  # fairseq_cli/train.py main() makes this call first


# ======================================================================================
# fairseq-interactive with sentencepiece, and the hub interface
# ======================================================================================

BEAM = "5"


@pytest.fixture(scope="module")
def spm_run(tmp_path_factory):
    """A sentencepiece model trained on raw text, the text encoded with it and binarized,
    and a short admin_transformer training on it."""
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("spm")
    raw, pieces = root / "raw", root / "pieces"
    write_reversal_corpus(raw, n_test=8)
    spm.SentencePieceTrainer.train(
        input=f"{raw / 'train.src'},{raw / 'train.tgt'}", model_prefix=str(root / "spm"),
        vocab_size=48, character_coverage=1.0, hard_vocab_limit=False, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(root / "spm.model"))
    pieces.mkdir()
    for name in os.listdir(raw):
        lines = (raw / name).read_text().splitlines()
        (pieces / name).write_text("".join(" ".join(sp.encode(s, out_type=str)) + "\n"
                                           for s in lines))
    data = preprocess(pieces, root / "bin")
    # 60 updates (the translations start to follow the sources); at most 31 target
    # positions, so that hypotheses which never reach EOS stay short
    train(data, root / "ck", "admin_transformer",
          TINY_MODEL + ["--lr", "5e-3", "--max-source-positions", "32",
                        "--max-target-positions", "32"], max_update=60)
    return {"data": data, "spm": root / "spm.model", "ckpt": root / "ck" / "checkpoint_last.pt",
            "sentences": (raw / "test.src").read_text().splitlines()}


def hypothesis_lines(stdout):
    """``{id: (H line, D line)}`` from fairseq-generate / fairseq-interactive output."""
    rows = {}
    for line in stdout.splitlines():
        if line.startswith(("H-", "D-")):
            sid = int(line.split("\t")[0][2:])
            rows.setdefault(sid, {})[line[0]] = line
    return rows


@pytest.fixture(scope="module")
def interactive_out(spm_run):
    # the README's command, raw sentences on stdin
    proc = console("fairseq-interactive", [
        spm_run["data"], "--user-dir", "fairseq_admin_pos", "--path", spm_run["ckpt"],
        "--source-lang", "src", "--target-lang", "tgt",
        "--bpe", "sentencepiece", "--sentencepiece-model", spm_run["spm"], "--beam", BEAM,
    ], stdin="\n".join(spm_run["sentences"]) + "\n")
    return hypothesis_lines(proc.stdout)


def test_interactive_sentencepiece_matches_generate(spm_run, interactive_out):
    """Raw text through fairseq-interactive (sentencepiece applied by fairseq) gives the
    hypotheses, scores and detokenized text of fairseq-generate on the binarized test set."""
    gen = console("fairseq-generate", [
        spm_run["data"], "--user-dir", "fairseq_admin_pos", "--path", spm_run["ckpt"],
        "--bpe", "sentencepiece", "--sentencepiece-model", spm_run["spm"], "--beam", BEAM,
        "--batch-size", "1", "--cpu"]).stdout
    generated = hypothesis_lines(gen)
    assert sorted(interactive_out) == sorted(generated) == list(range(8))
    assert interactive_out == generated
    # detokenized: the pieces joined back into words
    for rows in interactive_out.values():
        pieces, text = rows["H"].split("\t")[2], rows["D"].split("\t")[2]
        assert text == "".join(pieces.split()).replace("\u2581", " ").strip()


def test_hub_translates_raw_text_like_interactive(spm_run, interactive_out):
    """TransformerModel.from_pretrained(..., bpe='sentencepiece', user_dir=...) translates raw
    sentences into interactive's detokenized hypotheses, with the same scores."""
    from fairseq.models.transformer import TransformerModel

    hub = TransformerModel.from_pretrained(
        str(spm_run["ckpt"].parent), checkpoint_file=spm_run["ckpt"].name,
        data_name_or_path=str(spm_run["data"]), bpe="sentencepiece",
        sentencepiece_model=str(spm_run["spm"]), user_dir=USER_DIR)
    assert type(hub.models[0]).__name__ == "AdminTransformerModel"
    for i, sentence in enumerate(spm_run["sentences"]):
        _, score, text = interactive_out[i]["D"].split("\t")
        assert hub.translate(sentence, beam=int(BEAM)) == text
        best = hub.generate(hub.encode(sentence), beam=int(BEAM))[0]
        assert float(best["score"]) / math.log(2) == pytest.approx(float(score), abs=1e-6)
