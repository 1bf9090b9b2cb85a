"""``--optimizer radam`` (fairseq_admin_pos/optim/radam.py).

* The update of the fairseq optimizer built from its command-line config equals
  ``torch.optim.RAdam(decoupled_weight_decay=True)`` bit for bit (``--radam-early-steps
  momentum``), and both modes equal a float64 transcription of the formulas written here
  (RAdam paper, Algorithm 2, with decoupled weight decay; ``skip`` = Transformer-Clinic's
  ``radam_fairseq``), through the rho_t <= 5 steps (t = 1..5) and after.
* Memory-efficient fp16/bf16: a half parameter gets exactly the float32 step rounded once,
  with float32 moments.
* Through ``fairseq-train --user-dir fairseq_admin_pos``: interrupted + resumed equals
  uninterrupted (losses, weights, optimizer state); ``--fp16`` (FP16Optimizer; on the CPU
  with ``--fp16-no-flatten-grads``) and ``--memory-efficient-fp16`` train with float32
  optimizer state; a bad ``--adam-betas`` stops before training with a message naming it.
"""
import io
import math
import re

import pytest
import torch

from fairseq_cli_utils import TINY_MODEL, USER_DIR, load_checkpoint, run, train_losses

BETAS = (0.9, 0.98)
STEPS = 9  # t = 1..5 have rho_t <= 5 for beta2 = 0.98, t = 6..9 are rectified


def build_fairseq_radam(params, *flags):
    """The optimizer fairseq-train builds: flags parsed by fairseq's training parser,
    converted to its config, then ``fairseq.optim.build_optimizer``."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.optim import build_optimizer

    import fairseq_admin_pos

    fairseq_admin_pos.register()
    argv = ["unused-data-dir", "--user-dir", USER_DIR, "--arch", "transformer",
            "--optimizer", "radam", *map(str, flags)]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    cfg = convert_namespace_to_omegaconf(args)
    return build_optimizer(cfg.optimizer, params)


def toy_parameters(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 5, generator=g)),
            torch.nn.Parameter(torch.randn(5, generator=g)),
            torch.nn.Parameter(torch.randn(3, generator=g))]


def toy_gradients(params, steps, seed=1):
    """Per step, per parameter a gradient of varying scale; the last parameter gets none
    at step 3 (its step count then lags the others', as in fairseq with unused weights)."""
    g = torch.Generator().manual_seed(seed)
    grads = []
    for t in range(steps):
        row = [torch.randn(p.shape, generator=g) * (0.1 + t) for p in params]
        if t == 2:
            row[-1] = None
        grads.append(row)
    return grads


LRS = [1e-2 * (1 + 0.3 * t) for t in range(STEPS)]  # set each step, as a scheduler does


def reference_radam(p0, grads, lrs, betas, eps, wd, early_steps):
    """Float64 statement of RAdam with decoupled weight decay (module docstring formulas)."""
    b1, b2 = betas
    rho_inf = 2 / (1 - b2) - 1
    p = p0.double().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    t = 0
    for g, lr in zip(grads, lrs):
        if g is None:
            continue
        t += 1
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p * (1 - lr * wd)
        rho = rho_inf - 2 * t * b2**t / (1 - b2**t)
        m_hat = m / (1 - b1**t)
        if rho > 5:
            r = math.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
            p = p - lr * r * m_hat * math.sqrt(1 - b2**t) / (v.sqrt() + eps)
        elif early_steps == "momentum":
            p = p - lr * m_hat
    return p


def run_steps(optimizer, params, grads, lrs, set_lr):
    for row, lr in zip(grads, lrs):
        set_lr(lr)
        for p, g in zip(params, row):
            p.grad = None if g is None else g.clone()
        optimizer.step()


def flags(wd, mode, eps=1e-6):
    return ["--adam-betas", str(BETAS), "--adam-eps", eps, "--weight-decay", wd, "--lr", LRS[0],
            "--radam-early-steps", mode]


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_momentum_mode_equals_torch_radam(wd):
    ours = toy_parameters()
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = build_fairseq_radam(ours, *flags(wd, "momentum"))
    ref = torch.optim.RAdam(theirs, lr=LRS[0], betas=BETAS, eps=1e-6, weight_decay=wd,
                            decoupled_weight_decay=True)
    grads = toy_gradients(ours, STEPS)

    def set_ref_lr(lr):
        for group in ref.param_groups:
            group["lr"] = lr

    run_steps(opt, ours, grads, LRS, opt.set_lr)
    run_steps(ref, theirs, grads, LRS, set_ref_lr)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        sa, sb = opt.optimizer.state[a], ref.state[b]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"])
        assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert float(sa["step"]) == float(sb["step"])
    assert float(opt.optimizer.state[ours[0]]["step"]) == STEPS
    assert float(opt.optimizer.state[ours[-1]]["step"]) == STEPS - 1


@pytest.mark.parametrize("mode", ["momentum", "skip"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_updates_equal_float64_formulas(mode, wd):
    params = toy_parameters()
    p0 = [p.detach().clone() for p in params]
    opt = build_fairseq_radam(params, *flags(wd, mode))
    grads = toy_gradients(params, STEPS)
    run_steps(opt, params, grads, LRS, opt.set_lr)
    for i, (p, start) in enumerate(zip(params, p0)):
        expected = reference_radam(start, [row[i] for row in grads], LRS, BETAS, 1e-6, wd, mode)
        assert not torch.allclose(p.double(), start.double())
        torch.testing.assert_close(p.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_skip_mode_applies_only_weight_decay_while_rho_le_5(wd):
    """Clinic's behaviour, stated directly: for t = 1..5 the weights only decay (p * prod(1 -
    lr wd)), the moments advance as torch's, and step 6 is the first gradient step."""
    params = toy_parameters()[:2]  # both get a gradient every step
    p0 = [p.detach().clone() for p in params]
    opt = build_fairseq_radam(params, *flags(wd, "skip"))
    shadow = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = torch.optim.RAdam(shadow, lr=LRS[0], betas=BETAS, eps=1e-6, weight_decay=wd,
                            decoupled_weight_decay=True)
    grads = [row[:2] for row in toy_gradients(toy_parameters(), STEPS)]
    decay = torch.ones((), dtype=torch.float64)
    for t in range(6):
        run_steps(opt, params, grads[t:t + 1], LRS[t:t + 1], opt.set_lr)
        for group in ref.param_groups:
            group["lr"] = LRS[t]
        for p, g in zip(shadow, grads[t]):
            p.grad = g.clone()
        ref.step()
        for p, s in zip(params, shadow):
            st, rt = opt.optimizer.state[p], ref.state[s]
            assert torch.equal(st["exp_avg"], rt["exp_avg"])
            assert torch.equal(st["exp_avg_sq"], rt["exp_avg_sq"])
        if t < 5:
            decay = decay * (1 - LRS[t] * wd)
            for p, start in zip(params, p0):
                torch.testing.assert_close(p.double(), start.double() * decay, rtol=1e-6, atol=0)
        else:
            for p, start in zip(params, p0):
                assert (p.double() - start.double() * decay).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["momentum", "skip"])
def test_half_parameters_get_the_float32_step_rounded_once(dtype, mode):
    """--memory-efficient-fp16/bf16: no float32 master copy, so each step starts from the
    half weights: p = round(step_float32(p.float(), g.float())), moments in float32."""
    from fairseq_admin_pos.optim.radam import RAdam

    params = [torch.nn.Parameter(p.detach().to(dtype)) for p in toy_parameters()[:2]]
    master = [torch.nn.Parameter(p.detach().float()) for p in params]
    kwargs = dict(lr=1e-2, betas=BETAS, eps=1e-6, weight_decay=0.1, decoupled_weight_decay=True)
    opt = RAdam(params, early_steps=mode, **kwargs)
    ref = RAdam(master, early_steps=mode, **kwargs)  # float32 weights: the plain torch path
    grads = [row[:2] for row in toy_gradients(toy_parameters(), STEPS)]
    for row in grads:
        for p, m, g in zip(params, master, row):
            p.grad = g.to(dtype)
            m.grad = g.to(dtype).float()
        opt.step()
        ref.step()
        with torch.no_grad():
            for p, m in zip(params, master):
                m.copy_(m.to(dtype).float())  # the one rounding per step
                assert p.dtype == dtype and p.grad.dtype == dtype
                assert torch.equal(p.float(), m)
    for p, m in zip(params, master):
        assert opt.state[p]["exp_avg"].dtype == torch.float32
        assert torch.equal(opt.state[p]["exp_avg"], ref.state[m]["exp_avg"])
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[m]["exp_avg_sq"])


def test_half_parameters_resume_with_float32_moments():
    """A state saved from half parameters loads back with its float32 moments (torch would
    cast them to float16), and the next step is the one the uninterrupted optimizer takes."""
    from fairseq_admin_pos.optim.radam import RAdam

    grads = [torch.randn(6, generator=torch.Generator().manual_seed(t)) for t in range(8)]
    params = [torch.nn.Parameter(torch.linspace(-1, 1, 6).half())]
    whole = RAdam(params, lr=1e-2, betas=BETAS, early_steps="skip")
    for g in grads[:7]:
        params[0].grad = g.half()
        whole.step()
    buffer = io.BytesIO()  # through a file, as a checkpoint
    torch.save(whole.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    copy = [torch.nn.Parameter(params[0].detach().clone())]
    resumed = RAdam(copy, lr=1e-2, betas=BETAS, early_steps="skip")
    resumed.load_state_dict(saved)
    for key in ("exp_avg", "exp_avg_sq"):
        assert resumed.state[copy[0]][key].dtype == torch.float32
        assert torch.equal(resumed.state[copy[0]][key], whole.state[params[0]][key])
    params[0].grad = grads[7].half()
    copy[0].grad = grads[7].half()
    whole.step()
    resumed.step()
    assert torch.equal(copy[0], params[0])


@pytest.mark.parametrize("value,betas", [
    ("(0.9, 0.98)", (0.9, 0.98)), ("[0.9,0.999]", (0.9, 0.999)), ("(0, 0.5)", (0.0, 0.5))])
def test_parse_betas_reads_tuples(value, betas):
    from fairseq_admin_pos.optim.radam import parse_betas

    assert parse_betas(value) == betas


@pytest.mark.parametrize("value", ["(0.9, 1.0)", "(0.9,)", "0.9 0.98", "(0.9, 0.98", "(-0.1, 0.9)",
                                   "__import__('os').getcwd()", "('a', 'b')"])
def test_parse_betas_rejects_bad_values(value):
    from fairseq_admin_pos.optim.radam import parse_betas

    with pytest.raises(ValueError, match=r"--adam-betas must be two numbers in \[0, 1\)"):
        parse_betas(value)


def test_bad_early_steps_choice_lists_the_choices(capsys):
    with pytest.raises(SystemExit):
        build_fairseq_radam(toy_parameters(), "--radam-early-steps", "sgd")
    assert "--radam-early-steps: invalid choice: 'sgd' (choose from 'momentum', 'skip')" in \
        capsys.readouterr().err


# --------------------------------------------------------------------------------------- #
# through fairseq-train
# --------------------------------------------------------------------------------------- #
# Transformer-Clinic's optimizer settings on the tiny model; admin_transformer with a
# trainable omega vector (the paper's form). lr is fixed (no warmup) so every step moves.
RADAM_TRAIN = [
    "--user-dir", USER_DIR, "--arch", "admin_transformer", *TINY_MODEL,
    "--admin-omega", "parameter", "--optimizer", "radam", "--adam-betas", "(0.9, 0.98)",
    "--radam-early-steps", "skip", "--weight-decay", "0.01", "--lr", "3e-3",
    "--clip-norm", "0.0", "--cpu", "--seed", "3", "--max-tokens", "400", "--no-progress-bar",
    "--log-format", "simple", "--log-interval", "1", "--num-workers", "0",
    "--disable-validation", "--criterion", "label_smoothed_cross_entropy",
    "--label-smoothing", "0.1", "--no-epoch-checkpoints",
]


def fairseq_train(data, save_dir, max_update, *extra, check=True):
    return run("fairseq_cli.train", [data, *RADAM_TRAIN, "--max-update", max_update,
                                     "--save-dir", save_dir, *extra], check=check)


def test_resume_equals_uninterrupted_run(tiny_data, tmp_path):
    """Resuming from the checkpoint written after update 3 and training to 9 gives what 9
    updates at once give: the same logged losses, weights and RAdam state. The checkpoint is
    inside epoch 1 (5 batches) because fairseq 0.12 draws the batches of an iterator created
    at epoch e with seed + e, so a resume at an epoch start gets other batches than the
    uninterrupted run, whatever the optimizer. The resumed steps 4, 5 (rho_t <= 5) and 6..9
    (rectified) all depend on the restored step count and moments."""
    whole = fairseq_train(tiny_data, tmp_path / "whole", 9, "--save-interval-updates", "3")
    resumed = fairseq_train(tiny_data, tmp_path / "resumed", 9, "--restore-file",
                            tmp_path / "whole" / "checkpoint_1_3.pt")
    log = resumed.stdout + resumed.stderr
    loaded = r"Loaded checkpoint .*checkpoint_1_3\.pt \(epoch 1 @ 3 updates\)"
    assert re.search(loaded, log), log[-2000:]
    expected = train_losses(whole.stdout + whole.stderr)
    assert len(expected) == 9 and train_losses(log) == expected[3:]
    a = load_checkpoint(tmp_path / "whole" / "checkpoint_last.pt")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoint_last.pt")
    for key, value in a["model"].items():
        if torch.is_tensor(value):
            assert torch.equal(value, b["model"][key]), key
    sa, sb = a["last_optimizer_state"]["state"], b["last_optimizer_state"]["state"]
    assert sa.keys() == sb.keys() and len(sa) > 0
    for i in sa:
        assert float(sa[i]["step"]) == float(sb[i]["step"]) == 9
        assert torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"])
        assert torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"])
    assert b["last_optimizer_state"]["param_groups"][0]["early_steps"] == "skip"


@pytest.mark.parametrize("precision,wrapper,resume_at", [
    (["--fp16", "--fp16-no-flatten-grads"], "FP16Optimizer", None),
    # the optimizer state of half weights has to come back float32 from the checkpoint
    (["--memory-efficient-fp16"], "MemoryEfficientFP16Optimizer", 4),
])
def test_fp16_training_keeps_float32_optimizer_state(tiny_data, tmp_path, precision, wrapper,
                                                     resume_at):
    """7 updates (memory-efficient: 4, then a resume to 7): finite losses, loss scaling,
    RAdam's moments float32 (FP16Optimizer: of the float32 master weights; memory-efficient:
    of the half weights themselves) and its step count."""
    fp16 = [*precision, "--fp16-scale-window", "256", "--threshold-loss-scale", "0.03125"]
    runs = [fairseq_train(tiny_data, tmp_path / "ck", n, *fp16) for n in (resume_at, 7) if n]
    log = "".join(r.stdout + r.stderr for r in runs)
    if resume_at:
        assert "Loaded checkpoint" in log and f"@ {resume_at} updates" in log
    losses = [float(v) for v in train_losses(log)]
    assert len(losses) == 7 and all(math.isfinite(v) for v in losses), losses
    assert "loss_scale=" in log
    state = load_checkpoint(tmp_path / "ck" / "checkpoint_last.pt")
    history = state["optimizer_history"][-1]
    assert history["optimizer_name"] == wrapper and history["num_updates"] == 7
    opt_state = state["last_optimizer_state"]
    assert "loss_scale" in opt_state
    # fairseq counts an update only when the optimizer stepped (an fp16 overflow skips both),
    # so RAdam's step count is the update count, across the resume too
    assert {float(s["step"]) for s in opt_state["state"].values()} == {7.0}
    for s in opt_state["state"].values():
        assert s["exp_avg"].dtype == torch.float32 and s["exp_avg_sq"].dtype == torch.float32
        assert s["exp_avg_sq"].abs().sum() > 0


def test_bad_adam_betas_is_a_command_line_error(tiny_data, tmp_path):
    """Refused while fairseq-train parses its arguments: nothing is loaded or written."""
    proc = fairseq_train(tiny_data, tmp_path / "ck", 2, "--adam-betas", "(0.9, 1.5)", check=False)
    assert proc.returncode == 2
    assert ("error: argument --adam-betas: must be two numbers in [0, 1), written as a tuple "
            "such as '(0.9, 0.98)'; got '(0.9, 1.5)'") in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "ck").exists()
