"""Training you can watch: per-stack omegas, ReZero scalars, position scales, ResiDual's
dual-stream norms and gradient norms in fairseq's logs (``fairseq_admin_pos/models/monitoring.py``).

Through ``fairseq-train`` as a user runs it: the values appear in the ``train_inner`` lines,
the epoch summary, ``--log-format json`` and the ``--tensorboard-logdir`` event files (read
back here from the TFRecord framing with tensorboardX's protobuf), the last logged weights
are the checkpoint's, a resumed run loads the saved meters, and the per-stack gradient norms
equal norms computed by hand from the same batch and initial weights (float32, and fp16
with loss scaling). In-process: stock ``transformer`` models log nothing extra, and the
monitor performs no host-device synchronisation.
"""
import json
import math
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dispatch_utils import NoValueReads
from fairseq_cli_utils import (TINY_MODEL, USER_DIR, cos_by_matrix, load_model_state, preprocess,
                              run, train, write_reversal_corpus)
from model_utils import build, build_trainer

GNORM_KEYS = ("enc_gnorm", "dec_gnorm", "emb_gnorm")
STAT_KEYS = tuple(f"{s}_omega_{k}" for s in ("enc", "dec") for k in ("mean", "min", "max"))
POS_KEYS = ("enc_pos_scale", "dec_pos_scale")
WATCHED = TINY_MODEL + ["--admin-omega", "parameter", "--encoder-pos-emb", "scaled-sinusoidal",
                        "--decoder-pos-emb", "scaled-sinusoidal", "--share-all-embeddings"]


def json_lines(log: str, tag: str):
    """The ``--log-format json`` records of one tag, values as floats."""
    out = []
    for line in log.splitlines():
        m = re.search(rf"\| {tag} \| (\{{.*\}})$", line)
        if m:
            out.append({k: float(v) for k, v in json.loads(m.group(1)).items()})
    return out


def read_scalars(event_dir: Path):
    """``{tag: {step: value}}`` from the tensorboard event file(s) in ``event_dir``.

    TFRecord framing: uint64 length, uint32 masked crc of the length, ``length`` bytes of an
    ``Event`` protobuf, uint32 masked crc of the data."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    files = sorted(event_dir.glob("events.out.tfevents.*"))
    assert files, f"no event file in {event_dir}"
    for path in files:
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if value.WhichOneof("value") == "simple_value":
                    scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def checkpoint_stats(state):
    """The logged statistics recomputed from a checkpoint's state dict."""
    out = {}
    for stack, prefix in (("encoder", "enc"), ("decoder", "dec")):
        omegas = torch.cat([v.double().reshape(-1) for k, v in state.items()
                            if k.startswith(f"{stack}.layers.") and k.endswith("_residual.omega")])
        out[f"{prefix}_omega_mean"] = omegas.mean().item()
        out[f"{prefix}_omega_min"] = omegas.min().item()
        out[f"{prefix}_omega_max"] = omegas.max().item()
        out[f"{prefix}_pos_scale"] = state[f"{stack}.embed_positions.embed.scaling"].item()
    return out


@pytest.fixture(scope="module")
def watched(tiny_data, tmp_path_factory):
    """4 updates, json log every 2 updates, TensorBoard, trainable omegas, scaled sinusoids."""
    root = tmp_path_factory.mktemp("watched")
    proc = train(tiny_data, root / "ck", "admin_transformer", WATCHED + [
        "--log-format", "json", "--log-interval", "2", "--tensorboard-logdir", root / "tb"],
        max_update=4)
    return root, proc.stderr + proc.stdout


def test_json_lines_have_the_stack_metrics(watched):
    _, log = watched
    inner = json_lines(log, "train_inner")
    assert [r["num_updates"] for r in inner] == [2, 4]
    summary = json_lines(log, "train")
    assert len(summary) == 1
    summary = {k[len("train_"):] if k.startswith("train_") else k: v
               for k, v in summary[0].items()}
    for rec in inner + [summary]:
        for key in GNORM_KEYS + STAT_KEYS + POS_KEYS + ("enc_tok_cos",):
            assert key in rec, (key, sorted(rec))
        assert -1 < rec["enc_tok_cos"] < 1
        # the groups partition the parameters: their squares sum to fairseq's gnorm
        # (each value rounded to 3 decimals)
        assert math.sqrt(sum(rec[k] ** 2 for k in GNORM_KEYS)) == pytest.approx(rec["gnorm"],
                                                                                 abs=2e-3)
        for s in ("enc", "dec"):
            assert rec[f"{s}_omega_min"] < rec[f"{s}_omega_mean"] < rec[f"{s}_omega_max"]
        assert not any(k.endswith("rezero_mean") for k in rec)
    # the epoch summary shows the weights after the epoch's last update (here update 4)
    assert all(summary[k] == inner[-1][k] for k in STAT_KEYS + POS_KEYS)


def test_last_logged_weights_are_the_checkpoints(watched):
    root, log = watched
    state = load_model_state(root / "ck" / "checkpoint_last.pt")
    want = checkpoint_stats(state)
    last = json_lines(log, "train_inner")[-1]
    for key, value in want.items():
        digits = 5 if key.endswith("pos_scale") else 4
        assert last[key] == pytest.approx(value, abs=0.51 * 10 ** -digits), key
    # training moved them: the omegas are vectors that no longer share one value
    assert want["enc_omega_min"] < want["enc_omega_max"]
    assert want["enc_pos_scale"] != pytest.approx(1 / math.sqrt(32), abs=1e-5)


def test_tensorboard_event_file_has_the_omega_scalars(watched):
    root, log = watched
    inner = {int(r["num_updates"]): r for r in json_lines(log, "train_inner")}
    scalars = read_scalars(root / "tb" / "train_inner")
    for key in GNORM_KEYS + STAT_KEYS + POS_KEYS:
        assert set(scalars[key]) == {2, 4}, key
        for step, value in scalars[key].items():
            assert value == pytest.approx(inner[step][key], rel=1e-6, abs=1e-7), (key, step)
    state = load_model_state(root / "ck" / "checkpoint_last.pt")
    assert scalars["enc_omega_mean"][4] == pytest.approx(checkpoint_stats(state)["enc_omega_mean"],
                                                         abs=6e-5)
    epoch = read_scalars(root / "tb" / "train")
    assert epoch["dec_omega_max"] == {4: pytest.approx(inner[4]["dec_omega_max"], rel=1e-6)}


def test_resumed_run_loads_the_meters_and_keeps_logging(watched, tiny_data, tmp_path):
    root, _ = watched
    shutil.copytree(root / "ck", tmp_path / "ck")
    saved = torch.load(tmp_path / "ck" / "checkpoint_last.pt", map_location="cpu")
    meters = {key: cls for _, key, cls, _ in saved["extra_state"]["metrics"]["train"]}
    # fairseq stores meters by class name and looks them up in fairseq.logging.meters
    assert meters["enc_gnorm"] == meters["enc_omega_mean"] == "AverageMeter"
    proc = train(tiny_data, tmp_path / "ck", "admin_transformer", WATCHED + [
        "--log-format", "json", "--log-interval", "1"], max_update=6)
    log = proc.stderr + proc.stdout
    assert "Loaded checkpoint" in log
    inner = json_lines(log, "train_inner")
    assert [r["num_updates"] for r in inner] == [5, 6]
    assert all(k in inner[-1] for k in GNORM_KEYS + STAT_KEYS)
    want = checkpoint_stats(load_model_state(tmp_path / "ck" / "checkpoint_last.pt"))
    assert inner[-1]["dec_omega_mean"] == pytest.approx(want["dec_omega_mean"], abs=6e-5)


def test_rezero_scalars_are_logged(tiny_data, tmp_path):
    proc = train(tiny_data, tmp_path / "ck", "admin_transformer", TINY_MODEL + [
        "--admin-residual", "rezero", "--log-format", "json"], max_update=2)
    last = json_lines(proc.stderr + proc.stdout, "train_inner")[-1]
    state = load_model_state(tmp_path / "ck" / "checkpoint_last.pt")
    for stack, prefix in (("encoder", "enc"), ("decoder", "dec")):
        a = torch.cat([v.double().reshape(-1) for k, v in state.items()
                       if k.startswith(f"{stack}.layers.") and k.endswith("_residual.alpha")])
        assert a.numel() == (4 if stack == "encoder" else 6)
        for stat, value in (("mean", a.mean()), ("min", a.min()), ("max", a.max())):
            assert last[f"{prefix}_rezero_{stat}"] == pytest.approx(value.item(), abs=6e-5)
    assert last["dec_rezero_max"] > 0  # trained away from ReZero's 0
    # fixed omegas do not exist in ReZero, and nothing is logged for them
    assert not any("omega" in k or "pos_scale" in k for k in last)


# --------------------------------------------------------------------------------------- #
# per-stack gradient norms against a hand computation
# --------------------------------------------------------------------------------------- #
ONE_BATCH = ["--max-tokens", "4000", "--batch-size", "512", "--dropout", "0",
             "--criterion", "cross_entropy", "--optimizer", "adam", "--lr", "1e-3",
             "--seed", "3", "--cpu", "--no-progress-bar", "--log-format", "json",
             "--log-interval", "1", "--num-workers", "0", "--disable-validation",
             "--max-update", "1", "--no-save"]


def hand_group_norms(data, model_args, seed=3):
    """Gradient of the summed token cross-entropy over the whole training set / ntokens,
    at the initial weights fairseq-train builds for ``seed``; L2 norms by parameter name."""
    model, task, _ = build(data, "admin_transformer", model_args, seed=seed)
    model.train()
    task.load_dataset("train")
    ds = task.dataset("train")
    sample = ds.collater([ds[i] for i in range(len(ds))])
    logits = model(**sample["net_input"])[0].float()
    pad = task.target_dictionary.pad()
    target = sample["target"]
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                           ignore_index=pad, reduction="sum")
    (loss / target.ne(pad).sum()).backward()
    sq = {"enc": 0.0, "dec": 0.0, "emb": 0.0}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        stack, module = name.split(".")[:2]
        group = "emb" if module in ("embed_tokens", "output_projection") else stack[:3]
        sq[group] += p.grad.double().pow(2).sum().item()
    return {f"{k}_gnorm": math.sqrt(v) for k, v in sq.items()}, len(ds)


@pytest.mark.parametrize("case,extra,rel", [
    # trainable omegas, one matrix for both embeddings and the output projection
    ("fp32-shared", ["--admin-omega", "parameter", "--share-all-embeddings"], 2e-3),
    # fp16 with loss scale 128: the raw gradients carry the scale, the logged norms must not
    ("fp16-separate", ["--admin-init", "none", "--fp16", "--fp16-no-flatten-grads"], 1e-2),
])
def test_stack_gradient_norms_match_a_hand_computation(tiny_data, tmp_path, case, extra, rel):
    model_args = TINY_MODEL + ["--dropout", "0"] + [a for a in extra if not a.startswith("--fp16")]
    proc = run("fairseq_cli.train", [tiny_data, "--user-dir", USER_DIR, "--arch",
                                     "admin_transformer", *ONE_BATCH, *TINY_MODEL, *extra])
    log = proc.stderr + proc.stdout
    (rec,) = json_lines(log, "train_inner")
    want, n_sentences = hand_group_norms(tiny_data, model_args)
    assert rec["bsz"] == n_sentences  # one update = the whole training set, one batch
    if "--fp16" in extra:
        assert rec["loss_scale"] == 128
    for key, value in want.items():
        assert value > 0.01
        assert rec[key] == pytest.approx(value, rel=rel, abs=1e-3), (key, rec[key], value)
    assert rec["gnorm"] == pytest.approx(math.sqrt(sum(v * v for v in want.values())),
                                         rel=rel, abs=1e-3)
    # buffer omegas are fixed: nothing logged for them
    assert any(k.startswith("enc_omega") for k in rec) == ("parameter" in extra)


# --------------------------------------------------------------------------------------- #
# in-process: fairseq's Trainer
# --------------------------------------------------------------------------------------- #
def _trainer(data, arch, extra=()):
    # plain cross entropy: the hand-computed gradients below use it
    return build_trainer(data, [*TINY_MODEL, "--lr", "1e-3", *extra], arch=arch,
                         criterion=("--criterion", "cross_entropy"))


def _one_update(trainer):
    from fairseq.logging import metrics

    sample = next(iter(trainer.get_train_iterator(epoch=1).next_epoch_itr(shuffle=False)))
    with metrics.aggregate(new_root=True) as agg:
        trainer.train_step([sample])
    return agg


@pytest.mark.parametrize("arch", ["transformer", "admin_transformer"])
def test_only_admin_transformer_models_are_monitored(tiny_data, arch):
    agg = _one_update(_trainer(tiny_data, arch))
    assert "gnorm" in agg
    assert ("enc_gnorm" in agg) == (arch == "admin_transformer")


def test_monitor_does_no_host_device_sync(tiny_data):
    from fairseq.logging import metrics

    from fairseq_admin_pos.models import monitoring

    trainer = _trainer(tiny_data, "admin_transformer", [
        "--admin-omega", "parameter", "--encoder-pos-emb", "scaled-sinusoidal"])
    _one_update(trainer)  # gradients in place, as clip_grad_norm finds them
    model = trainer.get_model()
    with metrics.aggregate(new_root=True) as agg, NoValueReads():
        raw, total = monitoring.raw_group_norms(model, trainer.get_criterion().parameters())
        monitoring.log_group_norms(monitoring.scaled_group_norms(raw, total, total * 2))
        monitoring.log_shortcut_stats(model)
    # the check itself works: .item() is caught
    with pytest.raises(AssertionError, match="synchronisation"), NoValueReads():
        total.item()
    values = agg.get_smoothed_values()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    enc = math.sqrt(sum(g.double().pow(2).sum().item() for n, g in grads.items()
                        if n.startswith("encoder.") and ".embed_tokens." not in n))
    assert values["enc_gnorm"] == pytest.approx(2 * enc, abs=1e-3)
    assert values["enc_pos_scale"] == pytest.approx(
        model.encoder.embed_positions.embed.scaling.item(), abs=1e-5)


# --------------------------------------------------------------------------------------- #
# ResiDual's dual stream
# --------------------------------------------------------------------------------------- #
def test_resi_dual_dual_norms_match_a_hand_computation(tiny_data):
    """enc_dual_norm / dec_dual_norm: the mean over real tokens of ||d_K||_2, the dual stream
    the last layer of each stack returns in the update's forward, recomputed here from that
    tensor (boolean indexing, float64); logging them reads nothing back to the host."""
    from fairseq.logging import metrics

    from fairseq_admin_pos.models import monitoring

    trainer = _trainer(tiny_data, "admin_transformer", ["--admin-residual", "resi-dual",
                                                        "--dropout", "0"])
    model = trainer.get_model()
    duals = {}
    model.encoder.layers[-1].register_forward_hook(
        lambda m, a, out: duals.__setitem__("enc", out[1].detach().clone()))
    model.decoder.layers[-1].register_forward_hook(
        lambda m, a, out: duals.__setitem__("dec", out[3].detach().clone()))
    sample = next(iter(trainer.get_train_iterator(epoch=1).next_epoch_itr(shuffle=False)))
    with metrics.aggregate(new_root=True) as agg:
        trainer.train_step([sample])
    values = agg.get_smoothed_values()
    net = sample["net_input"]
    pad = model.encoder.padding_idx
    for key, tokens in (("enc", net["src_tokens"]), ("dec", net["prev_output_tokens"])):
        real = tokens.ne(pad).t()  # (T, B), the dual stream is time-major
        assert not real.all()  # the batch has padding to leave out
        want = duals[key].double().norm(dim=-1)[real].mean().item()
        assert want > 1
        assert values[f"{key}_dual_norm"] == pytest.approx(want, abs=6e-4)
    with metrics.aggregate(new_root=True), NoValueReads():
        monitoring.log_dual_norms(model)


# --------------------------------------------------------------------------------------- #
# the encoder token cosine (collapse)
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("extra", [[], ["--admin-residual", "resi-dual"],
                                   ["--admin-init", "none", "--encoder-normalize-before",
                                    "--decoder-normalize-before"]],
                         ids=["admin", "resi-dual", "pre-ln"])
def test_encoder_token_cosine_matches_the_full_matrix_of_the_updates_encoder_output(
        tiny_data, extra):
    """enc_tok_cos: the mean cosine between two different real source tokens' encoder
    outputs (after the final LayerNorm where there is one) in the update's forward, recomputed
    here from the full N x N matrix of that output (pads dropped by indexing, float64)."""
    from fairseq.logging import metrics

    from fairseq_admin_pos.models import monitoring

    trainer = _trainer(tiny_data, "admin_transformer", [*extra, "--dropout", "0"])
    model = trainer.get_model()
    seen = {}
    model.encoder.register_forward_hook(lambda m, a, out: seen.__setitem__(
        "out", (out["encoder_out"][0].detach().clone(), out["encoder_padding_mask"][0])))
    sample = next(iter(trainer.get_train_iterator(epoch=1).next_epoch_itr(shuffle=False)))
    with metrics.aggregate(new_root=True) as agg:
        trainer.train_step([sample])
    out, pad = seen["out"]
    assert pad.any()  # the batch has padding to leave out
    want = cos_by_matrix(out[~pad.t()])
    assert agg.get_smoothed_values()["enc_tok_cos"] == pytest.approx(want, abs=1e-4)
    # validation forwards leave the training value alone
    model.eval()
    model.encoder(sample["net_input"]["src_tokens"][:1], src_lengths=None)
    assert model.encoder.last_token_cos.item() == pytest.approx(want, abs=1e-4)
    with metrics.aggregate(new_root=True), NoValueReads():
        monitoring.log_token_cosine(model)


@pytest.mark.parametrize("scheme", ["admin", "b2t", "peri-ln", "mix-ln"])
def test_dual_norms_are_logged_for_resi_dual_only(tiny_data, scheme):
    agg = _one_update(_trainer(tiny_data, "admin_transformer", ["--admin-residual", scheme]
                               if scheme != "admin" else []))
    assert "enc_gnorm" in agg
    assert not any(k.endswith("_dual_norm") for k in agg.get_smoothed_values())


# --------------------------------------------------------------------------------------- #
# DyT's alphas (--admin-norm dyt)
# --------------------------------------------------------------------------------------- #
@pytest.mark.parametrize("scheme,per_layer", [
    # (encoder, decoder) DyTs per layer: Peri-LN has an input and an output one per sub-layer
    (["--admin-residual", "peri-ln"], (4, 6)),
    (["--admin-init", "none"], (2, 3)),  # Post-LN: one per sub-layer, no final one
])
def test_dyt_alphas_are_logged(tiny_data, scheme, per_layer):
    """enc_dyt_alpha_* / dec_dyt_alpha_*: mean, min and max over every DyT alpha of the stack
    (its final one included) after the update, recomputed from the model; logged without a
    host read; nothing logged for the LayerNorm models."""
    from fairseq.logging import metrics

    from fairseq_admin_pos.models import monitoring
    from fairseq_admin_pos.norms import DynamicTanh

    trainer = _trainer(tiny_data, "admin_transformer", [*scheme, "--admin-norm", "dyt",
                                                        "--dyt-alpha-init", "0.7"])
    values = _one_update(trainer).get_smoothed_values()
    model = trainer.get_model()
    final = "peri-ln" in scheme
    for stack, prefix, n in (("encoder", "enc", per_layer[0]), ("decoder", "dec", per_layer[1])):
        alphas = torch.cat([m.alpha.detach().double() for m in getattr(model, stack).modules()
                            if isinstance(m, DynamicTanh)])
        assert alphas.numel() == 2 * n + final  # 2 layers (+ the stack's final DyT)
        assert (alphas != 0.7).all()  # one Adam step moved every alpha
        for stat, value in (("mean", alphas.mean()), ("min", alphas.min()),
                            ("max", alphas.max())):
            assert values[f"{prefix}_dyt_alpha_{stat}"] == pytest.approx(value.item(), abs=6e-5)
    with metrics.aggregate(new_root=True), NoValueReads():
        monitoring.log_shortcut_stats(model)
    layernorm = _one_update(_trainer(tiny_data, "admin_transformer", scheme))
    assert not any("dyt" in k for k in layernorm.get_smoothed_values())


# --------------------------------------------------------------------------------------- #
# the collapse warning
# --------------------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def one_word_data(tmp_path_factory):
    """Every sentence one word repeated (up to 60 times): with no source positions and no
    dropout the encoder gives nearly every source token the same output, a collapsed encoder
    by construction."""
    root = tmp_path_factory.mktemp("one_word")
    write_reversal_corpus(root / "raw", n_train=120, vocab=1, max_len=60)
    return preprocess(root / "raw", root / "bin")


def collapse_warnings(log: str):
    return re.findall(r"WARNING \| fairseq_admin_pos\.models\.monitoring \| (enc_tok_cos .*)", log)


def expected_warning(inner, interval: int, warmup: int):
    """The first logged interval wholly after the warmup whose enc_tok_cos is above 0.9,
    read off the json lines: ``(first update, last update, value)`` or None."""
    for rec in inner:
        last = int(rec["num_updates"])
        if warmup > 0 and last - interval + 1 > warmup and rec["enc_tok_cos"] > 0.9:
            return last - interval + 1, last, rec["enc_tok_cos"]
    return None


@pytest.mark.parametrize("corpus, warmup, warns", [
    ("one_word", 2, True),     # collapsed past the warmup: warned once, at the first interval
    ("one_word", 8, False),    # the same run with every update inside the warmup
    ("one_word", 0, False),    # no warmup (fixed schedule): nothing to tell early from late
    ("reversal", 2, False),    # a run that trains: under the line after its warmup
])
def test_collapse_warning_names_the_logged_interval_once(request, tmp_path, corpus, warmup,
                                                         warns):
    data = request.getfixturevalue("one_word_data" if corpus == "one_word" else "tiny_data")
    schedule = (["--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(warmup)] if warmup
                else ["--lr-scheduler", "fixed"])
    proc = train(data, tmp_path / "ck", "admin_transformer", TINY_MODEL + schedule + [
        "--encoder-pos-emb", "none", "--dropout", "0", "--log-format", "json",
        "--log-interval", "2", "--no-save"], max_update=8)
    log = proc.stderr + proc.stdout
    inner = json_lines(log, "train_inner")
    assert [int(r["num_updates"]) for r in inner] == [2, 4, 6, 8]
    if corpus == "one_word":  # the construction holds: every interval above the line
        assert min(r["enc_tok_cos"] for r in inner) > 0.9
    want = expected_warning(inner, 2, warmup)
    assert (want is not None) == warns
    found = collapse_warnings(log)
    if want is None:
        assert found == []
        return
    first, last, value = want
    assert len(found) == 1  # once per run, though every later interval is above the line too
    m = re.match(r"enc_tok_cos ([0-9.]+) over updates (\d+)-(\d+), after the (\d+)-update "
                 r"warmup: ", found[0])
    assert m, found[0]
    assert (int(m.group(2)), int(m.group(3)), int(m.group(4))) == (first, last, warmup)
    assert float(m.group(1)) == pytest.approx(value, abs=1.5e-4)
