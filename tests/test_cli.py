"""End-to-end through fairseq's tools with ``--user-dir fairseq_admin_pos``: registration,
--help, parity with stock ``transformer``, checkpoint save/resume/generate under torch's
weights_only loading, interactive/validate/hub, settings mismatch, over-long inputs."""
import re
import subprocess
import sys

import pytest
import torch

from fairseq_cli_utils import (
    REPO,
    TINY_MODEL,
    USER_DIR,
    env,
    generate,
    hypotheses,
    load_model_state,
    run,
    train,
    train_losses,
)

class Foreign:
    """A class no fairseq checkpoint contains."""


PLUGIN_FLAGS = [
    "--admin-init", "--admin-output-change-scale", "--admin-omega",
    "--encoder-pos-emb", "--decoder-pos-emb",
]


def test_import_registers_everything():
    code = (
        "import fairseq_admin_pos, torch;"
        "from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY;"
        "assert 'admin_transformer' in MODEL_REGISTRY;"
        "names = [a for a in ARCH_MODEL_REGISTRY if a.startswith('admin_transformer')];"
        "print(sorted(names));"
        "print(fairseq_admin_pos.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True,
                         cwd="/", check=True).stdout
    for arch in ["admin_transformer", "admin_transformer_iwslt_de_en", "admin_transformer_wmt_en_de",
                 "admin_transformer_vaswani_wmt_en_de_big", "admin_transformer_wmt_en_de_60l_12l",
                 "admin_transformer_wmt_en_de_100l_100l", "admin_transformer_wmt_en_de_18l_18l"]:
        assert f"'{arch}'" in out
    # installed editable: the importable package is this checkout's folder (same as --user-dir)
    assert out.strip().splitlines()[-1] == str(REPO / "fairseq_admin_pos" / "__init__.py")


def test_help_lists_every_plugin_flag_with_text(tiny_data):
    out = run("fairseq_cli.train", [tiny_data, "--user-dir", "fairseq_admin_pos", "--arch",
                                    "admin_transformer", "--help"]).stdout
    for flag in PLUGIN_FLAGS:
        m = re.search(re.escape(flag) + r"\s+\{[^}]*\}\s*\n?\s+(\S[^\n]*)", out)
        assert m, f"{flag} missing from --help"
        assert len(m.group(1)) > 20, f"{flag} has no help text"


@pytest.mark.parametrize("cwd_kind", ["repo-relative", "elsewhere-absolute"])
def test_user_dir_paths(tiny_data, tmp_path, cwd_kind):
    user_dir, cwd = ("fairseq_admin_pos", REPO) if cwd_kind == "repo-relative" else (USER_DIR, tmp_path)
    run("fairseq_cli.train", [
        tiny_data, "--user-dir", user_dir, "--arch", "admin_transformer_tiny", "--cpu",
        "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "400", "--max-update", "1",
        "--save-dir", tmp_path / "ck", "--no-save", "--disable-validation", "--num-workers", "0",
    ], cwd=cwd, fresh=True)  # the import through --user-dir itself: a new interpreter


def test_forked_run_is_a_new_interpreters_run(tiny_data, tmp_path):
    """The suite forks fairseq commands from a process with torch and fairseq imported
    (tests/cli_zygote.py); a run that way prints the same log lines and losses, exits with the
    same status and writes the same weights as ``python -m fairseq_cli.train`` itself."""
    argv = [tiny_data, "--user-dir", USER_DIR, "--arch", "admin_transformer", *TINY_MODEL,
            "--admin-omega", "parameter", "--cpu", "--seed", "3", "--optimizer", "adam",
            "--lr", "1e-3", "--max-tokens", "400", "--max-update", "3", "--log-interval", "1",
            "--no-progress-bar", "--num-workers", "0", "--disable-validation"]
    procs = {kind: run("fairseq_cli.train", argv + ["--save-dir", tmp_path / kind],
                       fresh=kind == "fresh") for kind in ("fresh", "forked")}
    logs = {k: p.stdout + p.stderr for k, p in procs.items()}
    assert len(train_losses(logs["fresh"])) == 3
    assert train_losses(logs["forked"]) == train_losses(logs["fresh"])
    # fairseq_cli.train's own log format, on the same stream
    assert procs["forked"].stdout.count("| INFO | fairseq_cli.train |") == \
        procs["fresh"].stdout.count("| INFO | fairseq_cli.train |") > 0
    a = load_model_state(tmp_path / "fresh" / "checkpoint_last.pt")
    b = load_model_state(tmp_path / "forked" / "checkpoint_last.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if k != "_extra_state")
    # a failing command: the same exit status and error message either way
    bad = {kind: run("fairseq_cli.train", argv + ["--admin-init", "nope"], check=False,
                     fresh=kind == "fresh") for kind in ("fresh", "forked")}
    assert bad["forked"].returncode == bad["fresh"].returncode == 2
    assert "--admin-init" in bad["forked"].stderr
    assert bad["forked"].stderr.splitlines()[-1] == bad["fresh"].stderr.splitlines()[-1]


def test_parity_with_stock_transformer_through_cli(tiny_data, tmp_path):
    """--admin-init none --admin-omega buffer: same losses, same weights, same translations."""
    extra = TINY_MODEL + ["--dropout", "0.1"]
    p_stock = train(tiny_data, tmp_path / "stock", "transformer", extra, max_update=4)
    p_admin = train(tiny_data, tmp_path / "admin", "admin_transformer",
                    extra + ["--admin-init", "none", "--admin-omega", "buffer"], max_update=4)
    losses_s = train_losses(p_stock.stdout + p_stock.stderr)
    losses_a = train_losses(p_admin.stdout + p_admin.stderr)
    assert len(losses_s) == 4 and losses_s == losses_a

    s = load_model_state(tmp_path / "stock" / "checkpoint_last.pt")
    a = load_model_state(tmp_path / "admin" / "checkpoint_last.pt")
    for k, v in s.items():
        assert torch.equal(v, a[k]), k
    assert all(k.endswith(".omega") or k == "_extra_state" for k in set(a) - set(s))

    g_s = hypotheses(generate(tiny_data, tmp_path / "stock" / "checkpoint_last.pt").stdout)
    g_a = hypotheses(generate(tiny_data, tmp_path / "admin" / "checkpoint_last.pt").stdout)
    assert len(g_s) == 24 and g_s == g_a


@pytest.mark.parametrize("arch,extra", [
    # the checkpoint fix alone: stock fairseq model, plugin loaded
    ("transformer", TINY_MODEL),
    ("admin_transformer", TINY_MODEL + ["--admin-omega", "parameter", "--encoder-pos-emb",
                                        "scaled-sinusoidal", "--decoder-pos-emb", "learned"]),
])
def test_train_resume_generate(tiny_data, tmp_path, arch, extra):
    save = tmp_path / "ck"
    train(tiny_data, save, arch, extra, max_update=2)
    first = load_model_state(save / "checkpoint_last.pt")
    resumed = train(tiny_data, save, arch, extra, max_update=4)
    log = resumed.stdout + resumed.stderr
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ 2 updates\)", log), log[-2000:]
    assert "num_updates 4" in log
    state = torch.load(save / "checkpoint_last.pt", map_location="cpu")
    assert state["optimizer_history"][-1]["num_updates"] == 4
    changed = [k for k, v in state["model"].items()
               if torch.is_tensor(v) and v.is_floating_point() and not torch.equal(v, first[k])]
    assert changed  # the resumed run trained further
    out = generate(tiny_data, save / "checkpoint_last.pt").stdout
    assert len(hypotheses(out)) == 24 and "BLEU4" in out


def test_weights_only_safety_is_not_disabled(tmp_path):
    """Only fairseq's own types are allow-listed: a foreign class still refuses to load."""
    import fairseq_admin_pos

    fairseq_admin_pos.register()

    path = tmp_path / "foreign.pt"
    torch.save({"x": Foreign()}, path)
    with pytest.raises(Exception, match="Unsupported global|weights_only"):
        torch.load(path)


@pytest.fixture(scope="module")
def admin_checkpoint(tiny_data, tmp_path_factory):
    save = tmp_path_factory.mktemp("admin_ck")
    train(tiny_data, save, "admin_transformer",
          TINY_MODEL + ["--admin-omega", "parameter", "--encoder-pos-emb", "scaled-sinusoidal"],
          max_update=3)
    return save / "checkpoint_last.pt"


def test_validate_and_interactive(tiny_data, admin_checkpoint):
    out = run("fairseq_cli.validate", [tiny_data, "--task", "translation", "--user-dir", USER_DIR,
                                       "--path", admin_checkpoint,
                                       "--cpu", "--valid-subset", "valid", "--num-workers", "0",
                                       "--max-tokens", "400"])
    assert re.search(r"valid on 'valid' subset \| loss [0-9.]+", out.stdout + out.stderr)
    proc = run("fairseq_cli.interactive", [
        tiny_data, "--user-dir", USER_DIR, "--path", admin_checkpoint, "--cpu", "--beam", "2",
        "--source-lang", "src", "--target-lang", "tgt"], input="w1 w2 w3\nw4 w5\n", timeout=300)
    assert len([ln for ln in proc.stdout.splitlines() if ln.startswith("H-")]) == 2


def test_hub_interface(tiny_data, admin_checkpoint):
    import fairseq_admin_pos  # noqa: F401
    from fairseq.models.transformer import TransformerModel

    hub = TransformerModel.from_pretrained(
        str(admin_checkpoint.parent), checkpoint_file=admin_checkpoint.name,
        data_name_or_path=str(tiny_data), user_dir=USER_DIR,
    )
    assert type(hub.models[0]).__name__ == "AdminTransformerModel"
    out = hub.translate(["w1 w2 w3", "w7 w8"], beam=2)
    assert len(out) == 2 and all(isinstance(s, str) for s in out)


def test_resume_with_other_settings_fails_clearly(tiny_data, tmp_path, admin_checkpoint):
    import shutil

    save = tmp_path / "ck"
    save.mkdir()
    shutil.copy(admin_checkpoint, save / "checkpoint_last.pt")
    proc = train(tiny_data, save, "admin_transformer",
                 TINY_MODEL + ["--admin-omega", "parameter", "--encoder-pos-emb", "learned"],
                 max_update=5, check=False)
    assert proc.returncode != 0
    assert "--encoder-pos-emb: checkpoint 'scaled-sinusoidal', flags 'learned'" in proc.stderr


@pytest.mark.parametrize("pos", ["learned", "scaled-sinusoidal"])
def test_over_long_inputs_handled_like_fairseq(tiny_data, tmp_path, pos):
    save = tmp_path / "ck"
    model = TINY_MODEL + ["--encoder-pos-emb", pos, "--decoder-pos-emb", pos,
                          "--max-source-positions", "8", "--max-target-positions", "8",
                          "--skip-invalid-size-inputs-valid-test"]
    train(tiny_data, save, "admin_transformer", model, max_update=1)
    ck = save / "checkpoint_last.pt"
    # test sentences have up to 10 tokens with EOS: fairseq refuses them with a clear message...
    bad = generate(tiny_data, ck, check=False)
    assert bad.returncode != 0
    assert "max_positions" in bad.stderr or "invalid" in bad.stderr.lower()
    assert "IndexError" not in bad.stderr
    # ...or skips them on request
    ok = generate(tiny_data, ck, ["--skip-invalid-size-inputs-valid-test"])
    n = len(hypotheses(ok.stdout))
    assert 0 < n < 24
