"""A bad model flag through fairseq's tools: one ``<prog>: error: <message>`` line on stderr,
exit status 2 (argparse's), no traceback, nothing left behind
(fairseq_admin_pos/fairseq_fixes/flag_errors.py).

Every check the plugin makes while fairseq builds the model is run here the way a user
meets it: ``fairseq-train`` flags (checked before fairseq makes the save directory),
``--model-overrides`` of ``fairseq-generate`` / ``fairseq-interactive``, a checkpoint
whose settings differ from the flags on resume, and ``fairseq-hydra-train`` model settings.
The errors come before training, so each run is a second or two (forked from the zygote).
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from fairseq_cli_utils import (
    REPO,
    TINY_MODEL,
    TRAIN_COMMON,
    USER_DIR,
    assert_one_line_error,
    env,
    files_under,
    free_port,
    generate,
    run,
    train,
)
from fairseq_admin_pos.fairseq_fixes import flag_errors
from fairseq_admin_pos.fairseq_fixes.flag_errors import AdminFlagError

VENV_BIN = Path(sys.executable).parent
HYDRA_DIR = REPO / "examples" / "wmt14_en_de" / "hydra"

PROFILE = ["--admin-init", "profile"]

# (flags added to a tiny admin_transformer, the message after "fairseq-train: error: ")
TRAIN_CASES = {
    "negative-layers": (
        ["--encoder-layers", "-1"],
        "--encoder-layers must be a non-negative integer; got -1"),
    "deepnorm-without-layers": (
        ["--admin-residual", "deepnorm", "--decoder-layers", "0"],
        "--decoder-layers 0 cannot be combined with --admin-residual deepnorm: DeepNet's "
        "constants (N^4 M)^(1/16) need at least one encoder and one decoder layer"),
    "decoder-without-layers": (
        ["--decoder-layers", "0"],
        "--decoder-layers 0 leaves admin_transformer a decoder of only the target embedding "
        "and the output projection, with no attention to the encoder: the translation would "
        "not depend on the source; valid: --decoder-layers 1 or more (1 is the deep-encoder, "
        "shallow-decoder shape)"),
    "no-positions-contradicts-choice": (
        ["--no-token-positional-embeddings", "--encoder-pos-emb", "learned"],
        "--no-token-positional-embeddings contradicts --encoder-pos-emb learned; use "
        "--encoder-pos-emb none (or drop one of the two flags)"),
    "learned-pos-contradicts-choice": (
        ["--decoder-learned-pos", "--decoder-pos-emb", "sinusoidal"],
        "--decoder-learned-pos contradicts --decoder-pos-emb sinusoidal; use --decoder-pos-emb "
        "learned (or drop one of the two flags)"),
    "scaled-table-without-scaled-positions": (
        ["--pos-emb-scaled-table", "seed"],
        "--pos-emb-scaled-table seed only apply to scaled-sinusoid positions, but "
        "--encoder-pos-emb is sinusoidal and --decoder-pos-emb is sinusoidal; use "
        "--encoder-pos-emb/--decoder-pos-emb scaled-sinusoidal or drop "
        "--pos-emb-scaled-table/--pos-emb-scale-init"),
    "scale-init-without-scaled-positions": (
        ["--decoder-pos-emb", "learned", "--pos-emb-scale-init", "0.5"],
        "--pos-emb-scale-init 0.5 only apply to scaled-sinusoid positions, but "
        "--encoder-pos-emb is sinusoidal and --decoder-pos-emb is learned; use "
        "--encoder-pos-emb/--decoder-pos-emb scaled-sinusoidal or drop "
        "--pos-emb-scaled-table/--pos-emb-scale-init"),
    "scale-init-not-finite": (
        ["--encoder-pos-emb", "scaled-sinusoidal", "--pos-emb-scale-init", "nan"],
        "--pos-emb-scale-init must be a finite number; got nan"),
    "pre-ln-with-admin-omegas": (
        ["--encoder-normalize-before"],
        "--encoder-normalize-before (Pre-LN) cannot be combined with --admin-init closed-form: "
        "Admin rescales the shortcut of Post-LN layers. For the Pre-LN baseline use "
        "--admin-init none."),
    "rival-with-admin-init": (
        ["--admin-residual", "b2t", "--admin-init", "closed-form"],
        "--admin-residual b2t sets its own shortcut weights; it cannot be combined with "
        "--admin-init closed-form (valid with b2t: --admin-init none, the default for b2t; "
        "drop --admin-init), or use --admin-residual admin for Admin's omegas"),
    "rival-with-trainable-omega": (
        ["--admin-residual", "rezero", "--admin-omega", "parameter"],
        "--admin-omega parameter is Admin's trainable omega and does not apply to "
        "--admin-residual rezero (DeepNorm's alpha is a constant, ReZero's scalar is always "
        "trained, B2T and ResiDual add the plain shortcut x); valid with rezero: "
        "--admin-omega buffer (the default; drop --admin-omega)"),
    "rival-with-pre-ln": (
        ["--admin-residual", "resi-dual", "--decoder-normalize-before"],
        "--decoder-normalize-before (Pre-LN) cannot be combined with --admin-residual "
        "resi-dual: resi-dual is a Post-LN scheme. For the Pre-LN baseline use "
        "--admin-residual admin --admin-init none"),
    "profile-batches-not-positive": (
        PROFILE + ["--admin-profile-batches", "0"],
        "--admin-profile-batches must be a positive integer; got 0"),
    "profile-flags-without-profiling": (
        ["--admin-profile-mode", "eval", "--admin-profile-path", "p.json"],
        "--admin-profile-mode, --admin-profile-path only apply to --admin-init profile (got "
        "--admin-init closed-form)"),
    "clinic-profile-with-batches": (
        PROFILE + ["--admin-profile-batches", "2"],
        "--admin-profile-batches 2 cannot be combined with --admin-profile-mode clinic: the "
        "clinic mode writes each omega into the model as the pass reaches it, so every later "
        "statistic depends on the earlier omegas of the same pass, and K batches would be K "
        "passes that each change the omegas. Use --admin-profile-mode eval for statistics "
        "summed over several batches (clinic mode sums over GPUs inside the pass), or "
        "--admin-profile-batches 1"),
    "profile-without-layers": (
        PROFILE + ["--encoder-layers", "0"],
        "--admin-init profile needs at least one layer per stack (one omega per residual "
        "sub-layer); got --encoder-layers 0"),
    "profile-with-ema": (
        PROFILE + ["--store-ema"],
        "--admin-init profile cannot be combined with --store-ema: fairseq copies the model "
        "for the EMA when the trainer is built, i.e. before the omegas are profiled on the "
        "first batch"),
    # Peri-LN, Mix-LN and DyT (fairseq_admin_pos/models/flags.py, check_norm_flags)
    "mix-ln-alpha-without-mix-ln": (
        ["--admin-residual", "peri-ln", "--mix-ln-alpha", "0.5"],
        "--mix-ln-alpha 0.5 only applies to --admin-residual mix-ln (its fraction of Post-LN "
        "layers per stack), but --admin-residual is peri-ln; use --admin-residual mix-ln or "
        "drop --mix-ln-alpha"),
    "mix-ln-alpha-out-of-range": (
        ["--admin-residual", "mix-ln", "--mix-ln-alpha", "1.5"],
        "--mix-ln-alpha must be a number in [0, 1] (the fraction of each stack's layers that "
        "use Post-LN); got 1.5"),
    "mix-ln-without-layers": (
        ["--admin-residual", "mix-ln", "--encoder-layers", "0"],
        "--encoder-layers 0 cannot be combined with --admin-residual mix-ln: a stack without "
        "layers has no Post-LN/Pre-LN split (alpha 0 would end it with a LayerNorm, alpha 1 "
        "would not); use at least one layer"),
    "placement-with-pre-ln": (
        ["--admin-residual", "peri-ln", "--encoder-normalize-before"],
        "--encoder-normalize-before (Pre-LN) cannot be combined with --admin-residual peri-ln: "
        "peri-ln sets every layer's LayerNorm placement itself (a LayerNorm on the input and "
        "on the output of every sub-layer); drop --encoder-normalize-before"),
    "placement-with-admin-init": (
        ["--admin-residual", "mix-ln", "--admin-init", "closed-form"],
        "--admin-residual mix-ln uses the plain shortcut x + f(x) (Admin's omegas inside "
        "another LayerNorm placement would be a new, untested scheme); it cannot be combined "
        "with --admin-init closed-form (valid with mix-ln: --admin-init none, the default for "
        "mix-ln; drop --admin-init), or use --admin-residual admin for Admin's omegas"),
    "dyt-alpha-init-without-dyt": (
        ["--dyt-alpha-init", "0.3"],
        "--dyt-alpha-init 0.3 only applies to --admin-norm dyt (DyT's initial tanh scale "
        "alpha), but --admin-norm is layernorm; add --admin-norm dyt or drop --dyt-alpha-init"),
    "dyt-alpha-init-not-positive": (
        ["--admin-init", "none", "--admin-norm", "dyt", "--dyt-alpha-init", "0"],
        "--dyt-alpha-init must be a positive finite number (DyT's initial tanh scale alpha, "
        "0.5 in the paper); got 0.0"),
    "dyt-with-admin-omegas": (
        ["--admin-norm", "dyt"],
        "--admin-norm dyt cannot be combined with --admin-init closed-form: Admin's omegas give "
        "back the magnitude a LayerNorm divides out of each sum (the closed form assumes "
        "unit-variance LayerNorm outputs; the profile sets omega to the std of the sum, "
        "LayerNorm's divisor), and DyT (g * tanh(alpha x) + b) divides by no std (profiled "
        "with DyT the omegas fall below 1 and shrink the shortcut, the opposite of Admin); use "
        "--admin-init none (Post-LN or Pre-LN with DyT)"),
    "dyt-with-rival": (
        ["--admin-residual", "deepnorm", "--admin-norm", "dyt"],
        "--admin-norm dyt cannot be combined with --admin-residual deepnorm: DeepNet derives "
        "its alpha and beta for Post-LN sub-layers whose LayerNorm normalises each sum "
        "LN(alpha x + f(x)), and DyT does not normalise; valid with dyt: --admin-residual "
        "admin --admin-init none (Post-LN, Pre-LN), peri-ln, mix-ln"),
    "compile-with-activation-checkpointing": (
        ["--admin-compile", "layers", "--checkpoint-activations"],
        "--admin-compile layers cannot be combined with --checkpoint-activations / "
        "--offload-activations; use one of the two (--admin-compile none keeps activation "
        "checkpointing)"),
}

SETTINGS_MISMATCH = (
    "admin_transformer checkpoint was trained with other omega/position settings than the "
    "flags given ({}). Pass the checkpoint's settings, or start a new run instead of "
    "--restore-file/resume (fairseq-generate: leave them out of --model-overrides).")

# --model-overrides of a trained checkpoint (fairseq-generate), and the message
OVERRIDE_CASES = {
    "omega-form": ("{'admin_omega': 'vector'}",
                   "--admin-omega 'vector' is not valid; valid choices: buffer, parameter"),
    "position-choice": ("{'encoder_pos_emb': 'rotary'}",
                        "--encoder-pos-emb 'rotary' is not valid; valid choices: sinusoidal, "
                        "scaled-sinusoidal, learned, none"),
    "compile-choice": ("{'admin_compile': 'jit'}",
                       "--admin-compile 'jit' is not valid; valid choices: none, layers"),
    "profile-mode": ("{'admin_init': 'profile', 'admin_profile_mode': 'twice'}",
                     "--admin-profile-mode 'twice' is not valid; valid choices: clinic, eval"),
    "settings-mismatch": ("{'admin_output_change_scale': 'O(n)'}", SETTINGS_MISMATCH.format(
        "--admin-output-change-scale: checkpoint 'O(logn)', flags 'O(n)'")),
}

# fairseq-hydra-train overrides of the shipped config, and the message
HYDRA_CASES = {
    "choice": ("model.admin_init=sometimes",
               "model.admin_init='sometimes' (--admin-init) is not valid; valid choices: "
               "closed-form, profile, none"),
    "type": ("+model.decoder_layers=two",
             "model.decoder_layers='two' (--decoder-layers): Value 'two' of type 'str' could "
             "not be converted to Integer"),
    "unknown-key": ("+model.encoder_layer=2",
                    "model.encoder_layer is not a setting of admin_transformer; did you mean "
                    "model.encoder_layers or model.decoder_layers or model.encoder_layerdrop? "
                    "Its settings are the flags of `fairseq-train --arch admin_transformer "
                    "--help` with '-' written '_' (e.g. --admin-init -> model.admin_init)."),
    "combination": ("+model.admin_residual=b2t", TRAIN_CASES["rival-with-admin-init"][1]
                    .replace("--admin-init closed-form", "--admin-init profile")),
    "norm-choice": ("+model.admin_norm=rmsnorm",
                    "model.admin_norm='rmsnorm' (--admin-norm) is not valid; valid choices: "
                    "layernorm, dyt"),
}


@pytest.mark.parametrize("extra,message", list(TRAIN_CASES.values()), ids=list(TRAIN_CASES))
def test_fairseq_train_bad_flag_is_one_line(tiny_data, tmp_path, extra, message):
    save = tmp_path / "ck"
    proc = train(tiny_data, save, "admin_transformer", TINY_MODEL + extra, check=False)
    assert_one_line_error(proc, "fairseq-train", message)
    assert not save.exists()  # found before fairseq makes the save directory
    assert "fairseq_cli.train" not in proc.stdout  # not even main's first log line


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """A checkpoint of one update (the defaults: closed-form omegas, each a trainable vector;
    sinusoidal positions)."""
    save = tmp_path_factory.mktemp("flag_errors_ck")
    train(tiny_data, save, "admin_transformer", TINY_MODEL, max_update=1)
    return save / "checkpoint_last.pt"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_resume_with_other_settings_is_one_line_and_touches_nothing(tiny_data, tmp_path, trained):
    save = tmp_path / "ck"
    save.mkdir()
    shutil.copy(trained, save / "checkpoint_last.pt")
    before = digest(save / "checkpoint_last.pt")
    proc = train(tiny_data, save, "admin_transformer",
                 TINY_MODEL + ["--admin-omega", "buffer"], max_update=3, check=False)
    # fairseq's Trainer.load_checkpoint re-raises the error as a bare Exception: still one line
    assert_one_line_error(proc, "fairseq-train", SETTINGS_MISMATCH.format(
        "--admin-omega: checkpoint 'parameter', flags 'buffer'"))
    assert files_under(save) == ["checkpoint_last.pt"]
    assert digest(save / "checkpoint_last.pt") == before


def test_restore_file_into_a_new_save_dir_leaves_no_folder(tiny_data, tmp_path, trained):
    save = tmp_path / "new" / "run"
    proc = train(tiny_data, save, "admin_transformer",
                 TINY_MODEL + ["--restore-file", trained, "--encoder-pos-emb", "learned"],
                 check=False)
    assert_one_line_error(proc, "fairseq-train", SETTINGS_MISMATCH.format(
        "--encoder-pos-emb: checkpoint 'sinusoidal', flags 'learned'"))
    # fairseq made the folder (both levels) before the checkpoint was read: removed again
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("overrides,message", list(OVERRIDE_CASES.values()),
                         ids=list(OVERRIDE_CASES))
def test_fairseq_generate_bad_model_override_is_one_line(tiny_data, trained, overrides, message):
    proc = generate(tiny_data, trained, ["--model-overrides", overrides], check=False)
    assert_one_line_error(proc, "fairseq-generate", message)
    assert "H-" not in proc.stdout


def test_fairseq_interactive_bad_model_override_is_one_line(tiny_data, trained):
    proc = run("fairseq_cli.interactive", [
        tiny_data, "--user-dir", USER_DIR, "--path", trained, "--cpu", "--beam", "2",
        "--model-overrides", "{'admin_init': 'sometimes'}"], input="w1 w2 w3\n", check=False)
    assert_one_line_error(proc, "fairseq-interactive",
                          "--admin-init 'sometimes' is not valid; valid choices: closed-form, "
                          "profile, none")


@pytest.mark.parametrize("override,message", list(HYDRA_CASES.values()), ids=list(HYDRA_CASES))
def test_fairseq_hydra_train_bad_model_setting_is_one_line(tiny_data, tmp_path, override,
                                                            message):
    save = tmp_path / "ck"
    proc = run("fairseq_cli.hydra_train", [
        "--config-dir", HYDRA_DIR, "--config-name", "admin-paper_18l_18l", f"task.data={tiny_data}",
        "task.source_lang=src", "task.target_lang=tgt", f"checkpoint.save_dir={save}",
        # the shipped config writes hydra's own files into the save dir; elsewhere here
        f"hydra.run.dir={tmp_path / 'hydra'}", "common.cpu=true", "common.fp16=false",
        "distributed_training.distributed_world_size=1", override], check=False)
    # hydra prints "Error executing job with overrides: [...]" itself, then our line
    assert_one_line_error(proc, "fairseq-hydra-train", message)
    assert not save.exists()


def test_distributed_rank_fails_before_the_rendezvous(tiny_data, tmp_path):
    """Rank 0 of two (the other never starts): the flag error comes before fairseq waits for
    the other rank, which would otherwise block until the rendezvous times out."""
    extra, message = TRAIN_CASES["rival-with-pre-ln"]
    proc = run("fairseq_cli.train", [
        tiny_data, "--user-dir", USER_DIR, "--arch", "admin_transformer", *TRAIN_COMMON,
        *TINY_MODEL, *extra, "--save-dir", tmp_path / "ck",
        "--distributed-world-size", "2", "--distributed-rank", "0", "--distributed-no-spawn",
        "--distributed-init-method", f"tcp://127.0.0.1:{free_port()}",
        "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"], check=False, timeout=120)
    assert_one_line_error(proc, "fairseq-train", message)
    assert not (tmp_path / "ck").exists()


def test_console_script_and_forked_run_print_the_same(tiny_data, tmp_path):
    """The console script a user types, in a new interpreter (Python's own handling of the
    uncaught error), prints exactly what the suite's forked runs print."""
    extra, message = TRAIN_CASES["profile-with-ema"]
    argv = [str(tiny_data), "--user-dir", USER_DIR, "--arch", "admin_transformer",
            *TRAIN_COMMON, *TINY_MODEL, *extra, "--save-dir", str(tmp_path / "ck")]
    fresh = subprocess.run([str(VENV_BIN / "fairseq-train"), *argv], cwd=REPO, env=env(),
                           capture_output=True, text=True, timeout=300)
    forked = run("fairseq_cli.train", argv, check=False)
    for proc in (fresh, forked):
        assert_one_line_error(proc, "fairseq-train", message)
    assert not (tmp_path / "ck").exists()


def test_other_errors_keep_their_traceback(tmp_path):
    """An error that is no flag error (here: no data) is fairseq's usual traceback, status 1."""
    proc = run("fairseq_cli.train", [
        tmp_path / "no-data", "--user-dir", USER_DIR, "--arch", "admin_transformer",
        *TRAIN_COMMON, *TINY_MODEL, "--save-dir", tmp_path / "ck"], check=False)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "FileNotFoundError" in proc.stderr
    assert ": error: " not in proc.stderr


def test_outside_fairseqs_tools_a_flag_error_keeps_its_traceback(tmp_path):
    """A user's own script that imports the plugin keeps Python's usual report."""
    (tmp_path / "user_script.py").write_text(
        "import fairseq, fairseq_admin_pos\n"
        "from fairseq_admin_pos.fairseq_fixes.flag_errors import AdminFlagError\n"
        "raise AdminFlagError('--admin-init x is not valid')\n")
    proc = run("user_script", [], cwd=tmp_path, check=False)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "fairseq_admin_pos.errors.AdminFlagError: --admin-init x is not valid")


# -- in-process: the pieces fairseq's process handling relies on ------------------------


def _trainer_like_error():
    """What fairseq's Trainer.load_checkpoint raises for a settings mismatch: a bare
    Exception raised while handling ours."""
    try:
        try:
            raise AdminFlagError("--admin-omega: checkpoint 'buffer', flags 'parameter'")
        except Exception:
            raise Exception("Cannot load model parameters from checkpoint x.pt; please ensure "
                            "that the architectures match.")
    except Exception as e:
        return e, traceback.format_exc()


def test_flag_error_is_a_value_error_and_found_behind_fairseqs_wrapping():
    assert issubclass(AdminFlagError, ValueError)
    wrapped, _ = _trainer_like_error()
    found = flag_errors.find_flag_error(wrapped)
    assert isinstance(found, AdminFlagError)
    assert str(found) == "--admin-omega: checkpoint 'buffer', flags 'parameter'"
    assert flag_errors.find_flag_error(RuntimeError("other")) is None


def test_spawned_worker_error_is_raised_again_from_its_traceback_text():
    """torch.multiprocessing.spawn (fairseq's one process per GPU) gives the parent only the
    worker's traceback text; call_main raises the flag error from it, and lets any other
    worker error through unchanged."""
    from torch.multiprocessing.spawn import ProcessRaisedException

    _, text = _trainer_like_error()
    # what torch's spawn raises in the parent for a failed worker (spawn.py, join)
    worker = ProcessRaisedException(
        "\n\n-- Process 0 terminated with the following error:\n" + text, 0, 12345)

    def failing_call_main(cfg, main, **kwargs):
        raise worker

    cfg = type("Cfg", (), {"model": None})()
    with pytest.raises(AdminFlagError) as info:
        flag_errors._wrap_call_main(failing_call_main)(cfg, None)
    assert str(info.value) == "--admin-omega: checkpoint 'buffer', flags 'parameter'"

    other = ProcessRaisedException("\n\nTraceback ...\nRuntimeError: CUDA error\n", 0, 1)

    def other_failure(cfg, main, **kwargs):
        raise other

    with pytest.raises(ProcessRaisedException) as info:
        flag_errors._wrap_call_main(other_failure)(cfg, None)
    assert info.value is other


def test_preflight_checks_a_copy(tiny_data):
    """The early check runs build_model's checks on a copy: the namespace fairseq goes on
    with is untouched, and a bad one raises the same error build_model would."""
    import copy

    import model_utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = model_utils.parse(tiny_data, "admin_transformer", ["--decoder-learned-pos"])
    cfg = convert_namespace_to_omegaconf(args)
    before = copy.deepcopy(vars(cfg.model))
    flag_errors.preflight(cfg)
    assert vars(cfg.model) == before
    bad = convert_namespace_to_omegaconf(model_utils.parse(
        tiny_data, "admin_transformer", ["--decoder-learned-pos", "--decoder-pos-emb", "none"]))
    with pytest.raises(AdminFlagError, match="--decoder-learned-pos contradicts"):
        flag_errors.preflight(bad)
    stock = convert_namespace_to_omegaconf(model_utils.parse(
        tiny_data, "transformer", ["--encoder-layers", "-1"]))
    flag_errors.preflight(stock)  # other models: not the plugin's business
