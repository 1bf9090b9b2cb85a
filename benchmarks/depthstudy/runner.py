"""Running the study: one fairseq-train + fairseq-generate per run, ``--jobs`` at a time,
one CSV row per finished run."""
from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import shutil
import tempfile
import sys
import time
from pathlib import Path

from .common import (REPO, USER_DIR, capture, cpu_name, fairseq_env, file_lock, log,
                     parse_depth, run_checked)
from .data import TGT
from .logs import classify, gnorm_summary, parse_curve
from .omegas import init_omegas, write_variant_file
from .plan import OMEGA_VARIANTS, POSITIONS, SCHEMES, run_key, study_name
from . import segments
from .report import csv_lock, distinct_translations, read_rows, write_rows


def train_command(args, bin_dir: Path, save_dir: Path, scheme: str, enc: int, dec: int,
                  seed: int, positions: str = "sinusoidal"):
    d, f, h = args.embed_dim, args.ffn_dim, args.heads
    valid_every = args.validate_every or max(10, args.max_update // 4)
    scheme_flags = SCHEMES[scheme]
    # a scheme may bring its own optimizer (admin-paper: RAdam, as Transformer-Clinic)
    optimizer = [] if "--optimizer" in scheme_flags else ["--optimizer", "adam"]
    cmd = [
        sys.executable, "-m", "fairseq_cli.train", bin_dir,
        "--user-dir", USER_DIR, "--arch", "admin_transformer", *scheme_flags,
        *POSITIONS[positions],
        "--encoder-layers", enc, "--decoder-layers", dec,
        "--encoder-embed-dim", d, "--decoder-embed-dim", d,
        "--encoder-ffn-embed-dim", f, "--decoder-ffn-embed-dim", f,
        "--encoder-attention-heads", h, "--decoder-attention-heads", h,
        "--share-all-embeddings", "--dropout", args.dropout,
        *optimizer, "--adam-betas", "(0.9, 0.98)", "--clip-norm", args.clip_norm,
        "--lr", args.lr, "--lr-scheduler", "inverse_sqrt", "--warmup-updates", args.warmup,
        "--warmup-init-lr", "1e-07",
        "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--max-tokens", args.max_tokens, "--max-update", args.max_update, "--seed", seed,
        "--validate-interval-updates", valid_every, "--save-interval-updates", valid_every,
        "--keep-interval-updates", 1, "--no-epoch-checkpoints",
        "--save-dir", save_dir, "--log-format", "json", "--log-interval", args.log_interval,
        "--cpu", "--num-workers", 0,
    ]
    return [str(c) for c in cmd]


def unsupported_flags(scheme: str, positions: str, env, helps: dict | None = None) -> list:
    """Flags (or ``--optimizer`` values) of this variant that this checkout's fairseq-train
    does not know: such runs are left for a later call instead of failing.

    ``helps`` caches fairseq-train's help text per chosen optimizer across the variants of
    one grid: each ``--help`` is a fresh fairseq import, seconds per call."""
    flags = SCHEMES[scheme] + POSITIONS[positions]
    # fairseq lists an optimizer's own flags only when that optimizer is chosen
    at = flags.index("--optimizer") if "--optimizer" in flags else len(flags)
    chosen = tuple(flags[at:at + 2])
    out = helps.get(chosen) if helps is not None else None
    if out is None:
        cmd = [sys.executable, "-m", "fairseq_cli.train", "--user-dir", str(USER_DIR),
               "--arch", "admin_transformer", *chosen, "--help"]
        out = capture(cmd, env).stdout
        if helps is not None:
            helps[chosen] = out
    missing = [f for f in flags if f.startswith("--") and f not in out]
    for i, f in enumerate(flags[:-1]):
        if f in ("--optimizer", "--encoder-pos-emb", "--pos-emb-scaled-table") and \
                not re.search(r"[{,]" + re.escape(flags[i + 1]) + r"[,}]", out):
            missing.append(f"{f} {flags[i + 1]}")
    return missing


def final_shortcuts(ckpt: Path) -> dict:
    """The trained shortcut weights and position scales in a checkpoint: per stack, mean /
    min / max of the omega vectors (or ReZero scalars), and each side's position scale."""
    import torch

    sys.path.insert(0, str(REPO))
    from fairseq_admin_pos.fairseq_fixes.checkpoint_compat import allow_fairseq_checkpoints

    allow_fairseq_checkpoints()
    state = torch.load(ckpt, map_location="cpu")["model"]
    out = {}
    for side in ("encoder", "decoder"):
        omegas = [v.float().flatten() for k, v in state.items()
                  if k.startswith(side + ".") and k.endswith(".omega")]
        if omegas:
            cat = torch.cat(omegas)
            out[f"{side}_omega"] = [round(cat.mean().item(), 4), round(cat.min().item(), 4),
                                    round(cat.max().item(), 4)]
        scale = state.get(f"{side}.embed_positions.embed.scaling")
        if scale is not None:
            out[f"{side}_pos_scale"] = round(scale.float().item(), 4)
    return out


def generate(args, root: Path, save_dir: Path, run_dir: Path, env):
    """Beam-4 translations of test_2016_flickr, spm-decoded; detokenized sacreBLEU."""
    import sacrebleu

    ckpt = save_dir / "checkpoint_best.pt"
    cmd = [
        sys.executable, "-m", "fairseq_cli.generate", root / "bin",
        "--user-dir", USER_DIR, "--path", ckpt, "--gen-subset", "test",
        "--beam", 4, "--lenpen", 0.6, "--batch-size", 128,
        # bounded output length: an untrained model otherwise repeats a token 200 times
        "--max-len-a", 1.2, "--max-len-b", 10,
        "--remove-bpe", "sentencepiece", "--cpu", "--num-workers", 0,
    ]
    cmd = [str(c) for c in cmd]
    t0 = time.time()
    rc, text, cmd_text = run_checked(cmd, env, run_dir / "generate.log")
    wall = time.time() - t0
    if rc != 0:
        raise RuntimeError(f"fairseq-generate failed (rc {rc}); see {run_dir/'generate.log'}")
    hyps = {}
    for line in text.splitlines():
        if line.startswith("D-"):
            head, _score, *hyp = line.split("\t")
            hyps[int(head[2:])] = hyp[0] if hyp else ""
    refs = (root / "raw" / f"test.{TGT}").read_text().splitlines()
    if len(hyps) != len(refs):
        raise RuntimeError(f"fairseq-generate produced {len(hyps)} of {len(refs)} translations")
    hyp_list = [hyps[i] for i in range(len(refs))]
    (run_dir / f"test.hyp.{TGT}").write_text("\n".join(hyp_list) + "\n")
    bleu = sacrebleu.metrics.BLEU()
    score = bleu.corpus_score(hyp_list, [refs])
    sig = str(bleu.get_signature())
    log(f"sacreBLEU {score.score:.2f}  {score}  signature: {sig}")
    return score.score, sig, wall, cmd_text


def finished_training(run_dir: Path, save_dir: Path, cmd):
    """``(command text, the last segment's log text)`` of a run in ``run_dir`` that trained to
    the end with exactly ``cmd`` (recorded in ``command.txt``) and still has its checkpoints,
    else None."""
    seg = segments.read(run_dir)[-1]
    log_file, recorded = run_dir / seg["log"], run_dir / "command.txt"
    if not (log_file.is_file() and (save_dir / "checkpoint_best.pt").is_file()
            and (save_dir / "checkpoint_last.pt").is_file()):
        return None
    text = log_file.read_text()
    cmd_text = " ".join(shlex.quote(str(c)) for c in cmd)
    # runs started before command.txt existed: fairseq's logged config names the save dir
    same = (recorded.read_text() == cmd_text if recorded.is_file()
            else f"'save_dir': '{save_dir}'" in text)
    if segments.DONE_RE.search(text) is None or not same:
        return None
    return cmd_text, text


def resumable(run_dir: Path, save_dir: Path, cmd) -> int | None:
    """The update to resume an unfinished run of exactly ``cmd`` from (its checkpoint_last.pt
    of an earlier, stopped process), else None."""
    recorded = run_dir / "command.txt"
    cmd_text = " ".join(shlex.quote(str(c)) for c in cmd)
    if not ((save_dir / "checkpoint_last.pt").is_file() and recorded.is_file()
            and recorded.read_text() == cmd_text):
        return None
    return segments.saved_update("".join(t for _, t in segments.texts(run_dir)))


def shorter_run(args, scheme, depth, seed, positions):
    """``(run folder, key)`` of the longest finished run of the same configuration with fewer
    updates whose checkpoints were kept (the run to continue), else None."""
    found = []
    for n in range(1, args.max_update):
        key = run_key(scheme, depth, seed, argparse.Namespace(**{**vars(args),
                                                                 "max_update": n}), positions)
        run_dir = args.out / "runs" / run_folder(key)
        if run_dir.is_dir():
            found.append((n, run_dir, key))
    for n, run_dir, key in sorted(found, reverse=True):
        save_dir = run_dir / "ckpt"
        cmd_file = run_dir / "command.txt"
        if cmd_file.is_file() and finished_training(
                run_dir, save_dir, shlex.split(cmd_file.read_text())) is not None:
            return run_dir, key
    return None


def run_folder(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key)


def measure_profile(args, root, scheme, depth, seed, positions) -> Path:
    """The Clinic profile of ``scheme`` at this depth and seed, as the package's profile file
    (cached in ``OUT/profiles``): ``fairseq-train`` with ``--admin-profile-path``, stopped after
    one update, nothing saved. The profiling pass is the first training forward with the seed's
    first batch and dropout masks, so these are the omegas the full run starts from."""
    enc, dec = parse_depth(depth)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", run_key(scheme, depth, seed, args, positions))
    folder = args.out / "profiles"
    path = folder / f"{name}.json"
    # two variants of one depth and seed (two jobs, two processes) need the same profile:
    # one measures it, the other waits and reads it
    with file_lock(folder / f"{name}.lock"):
        if path.is_file():
            return path
        work = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=folder))
        cmd = train_command(args, root / "bin", work / "ckpt", scheme, enc, dec, seed, positions)
        cmd[cmd.index("--max-update") + 1] = "1"
        cmd += ["--admin-profile-path", str(path), "--no-save", "--disable-validation"]
        rc, text, _ = run_checked(cmd, fairseq_env(args.threads), work / "train.log")
        if rc != 0 and path.is_file() and "done training in" in text:
            # the interpreter can abort at exit after fairseq finished ("terminate called
            # without an active exception"): the profile was written before it, so it is used
            log(f"fairseq-train exited with rc {rc} after it finished and wrote {path.name}; "
                f"using the profile")
            rc = 0
        if rc != 0 or not path.is_file():
            raise RuntimeError(f"measuring the profile for {name} failed (rc {rc}); see "
                               f"{work / 'train.log'}\n" + "\n".join(text.splitlines()[-10:]))
        shutil.rmtree(work, ignore_errors=True)
        return path


def probe_run(root: Path, save_dir: Path, env) -> dict:
    """``depthstudy.probe`` on the run's checkpoints ({} without them, or when it fails)."""
    best, last = save_dir / "checkpoint_best.pt", save_dir / "checkpoint_last.pt"
    if not (best.is_file() and last.is_file()):
        return {}
    cmd = [sys.executable, "-m", "depthstudy.probe", "--data", root / "bin", "--best", best,
           "--last", last]
    env = dict(env, PYTHONPATH=str(Path(__file__).resolve().parents[1]) + ":" +
               env.get("PYTHONPATH", ""))
    proc = capture(cmd, env)
    try:
        if proc.returncode != 0:
            raise ValueError(f"rc {proc.returncode}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as err:  # a run's row is kept without the probe
        log(f"probe of {save_dir} failed ({err}):\n{proc.stderr[-2000:]}")
        return {}


def _num(probed, k) -> str:
    return f"{probed[k]:.4f}" if k in probed else ""


def diagnostics(scheme_flags, log_text, enc, dec, omega_file, curve, warmup, probed) -> dict:
    """The diagnostic columns of a row: omegas at initialisation and at the end per sub-layer,
    per-stack gradient norms (warmup / after), the probe's source and encoder measures."""
    def dump(v):
        return json.dumps(v, sort_keys=True) if v else ""

    return {
        "init_omegas": dump(init_omegas(scheme_flags, log_text, enc, dec, omega_file)),
        "final_omegas": dump(probed.get("final_omegas")),
        "gnorms": dump(gnorm_summary(curve, warmup)),
        "probe_valid_nll": _num(probed, "valid_nll"),
        "valid_nll_other_source": _num(probed, "valid_nll_other_source"),
        "source_gain": _num(probed, "source_gain"),
        **collapse_columns(probed),
    }


def collapse_columns(probed) -> dict:
    """The probe's encoder-collapse columns of a row ('' where it has none)."""
    layers = probed.get("encoder_cos_layers")
    return {"encoder_cos": _num(probed, "encoder_cos"),
            "encoder_cos_init": _num(probed, "encoder_cos_init"),
            "encoder_cos_layers": json.dumps(layers) if layers else ""}


def train_segment(args, root, run_dir, save_dir, cmd, key, omega_file, cell):
    """Train the run ``key`` to its end: resumed from its own checkpoint where an earlier
    process stopped, else continued from the same configuration's shorter run where one was
    kept, else from scratch. Returns ``(rc, this segment's log text, command text)``."""
    scheme, depth, seed, positions = cell
    start = resumable(run_dir, save_dir, cmd)
    source = None
    if start is not None:
        log(f"run {key}: resuming from its checkpoint at update {start}")
    else:
        if run_dir.exists():  # an interrupted attempt without a checkpoint: start again
            shutil.rmtree(run_dir)
        shorter = shorter_run(args, scheme, depth, seed, positions)
        if shorter is not None:
            run_dir.mkdir(parents=True)
            start, source = segments.continue_from(shorter[0], run_dir), shorter[1]
            log(f"run {key}: continuing {source} from update {start}")
        else:
            save_dir.mkdir(parents=True)
            start = 0
            if omega_file is not None:
                measured = measure_profile(args, root, "admin-paper", depth, seed,
                                           positions)
                write_variant_file(scheme, measured, omega_file)
        (run_dir / "command.txt").write_text(" ".join(shlex.quote(str(c)) for c in cmd))
    log_file = segments.next_log(run_dir, start, source)
    log(f"run {key}")
    return run_checked(cmd, fairseq_env(args.threads), log_file, echo=args.verbose)


def _evaluate(args, root, save_dir: Path, run_dir: Path, env) -> dict:
    """BLEU of the best checkpoint, the last checkpoint's shortcut weights and the probe's
    diagnostics; then the checkpoints go unless ``--keep-checkpoints``."""
    bleu, sig, gen_wall, gen_cmd = float("nan"), "", 0.0, ""
    if (save_dir / "checkpoint_best.pt").is_file():
        try:
            bleu, sig, gen_wall, gen_cmd = generate(args, root, save_dir, run_dir, env)
        except RuntimeError as err:
            log(str(err))
    shortcuts = {}
    if (save_dir / "checkpoint_last.pt").is_file():
        shortcuts = final_shortcuts(save_dir / "checkpoint_last.pt")
    probed = probe_run(root, save_dir, env)
    if not args.keep_checkpoints:
        shutil.rmtree(save_dir, ignore_errors=True)
    return {"bleu": bleu, "sig": sig, "gen_wall": gen_wall, "gen_cmd": gen_cmd,
            "shortcuts": shortcuts, "probed": probed}


def _fmt(v, nd=3) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def _curve_columns(curve) -> dict:
    """Losses of the run's curve: the last and lowest training nll, the best validation."""
    train, valid = curve["train"], curve["valid"]
    best = min(valid, key=lambda p: p["loss"]) if valid else None
    return {
        "updates": train[-1]["update"] if train else 0,
        "final_train_loss": _fmt(train[-1]["loss"]) if train else "",
        "final_train_nll": _fmt(train[-1]["nll"]) if train else "",
        "min_train_nll": _fmt(min(p["nll"] for p in train)) if train else "",
        "best_valid_loss": _fmt(best["loss"]) if best else "",
        "best_valid_nll": _fmt(best["nll"]) if best else "",
        "best_valid_ppl": _fmt(best["ppl"], 1) if best else "",
    }


def one_run(args, root, scheme, depth, seed, unigram_bits, study_cmd, positions="sinusoidal"):
    """Train one run (or reuse, resume or continue its training), score and probe it, and
    return its CSV row; None when fairseq-train failed other than by a NaN (a rerun retries
    it)."""
    enc, dec = parse_depth(depth)
    key = run_key(scheme, depth, seed, args, positions)
    run_dir = args.out / "runs" / run_folder(key)
    save_dir = run_dir / "ckpt"
    env = fairseq_env(args.threads)
    cmd = train_command(args, root / "bin", save_dir, scheme, enc, dec, seed, positions)
    omega_file = None
    if scheme in OMEGA_VARIANTS:
        omega_file = run_dir / "omegas.json"
        cmd += ["--admin-profile-path", str(omega_file)]
    finished = finished_training(run_dir, save_dir, cmd)
    if finished is not None:
        # trained to the end by an earlier call that stopped before recording the row:
        # evaluate that run instead of training it again
        rc, (cmd_text, text) = 0, finished
        log(f"run {key}: reusing the finished training in {run_dir}")
    else:
        rc, text, cmd_text = train_segment(args, root, run_dir, save_dir, cmd, key, omega_file,
                                           (scheme, depth, seed, positions))
    curve = segments.curve(run_dir)
    wall = segments.wall_seconds(run_dir)
    (run_dir / "curve.json").write_text(json.dumps(curve))
    crashed_nan = rc != 0 and ("FloatingPointError" in text or "Nan/Inf" in text)
    if rc != 0 and not crashed_nan:
        tail = "\n".join(text.splitlines()[-15:])
        log(f"fairseq-train failed (rc {rc}) for {key}; not recorded, rerun retries it.\n{tail}")
        return None
    status, reason = classify(curve, crashed_nan, unigram_bits, args.stuck_bits,
                              args.diverge_bits)
    ev = _evaluate(args, root, save_dir, run_dir, env)
    losses = _curve_columns(curve)
    updates = losses["updates"]
    row = {
        "key": key, "study": study_name(args), "scheme": scheme, "positions": positions,
        "depth": depth, "encoder_layers": enc,
        "decoder_layers": dec, "seed": seed, "max_update": args.max_update,
        "embed_dim": args.embed_dim, "ffn_dim": args.ffn_dim, "heads": args.heads,
        "lr": f"{args.lr:g}", "warmup": args.warmup, "max_tokens": args.max_tokens,
        "dropout": args.dropout, "clip_norm": f"{args.clip_norm:g}", "status": status,
        "reason": reason, **losses,
        "unigram_entropy_bits": _fmt(unigram_bits),
        "bleu": _fmt(ev["bleu"], 2), "bleu_signature": ev["sig"],
        "distinct_hyps": distinct_translations(run_dir / f"test.hyp.{TGT}") if ev["sig"] else "",
        "train_wall_s": _fmt(wall, 1), "updates_per_s": _fmt(updates / wall if wall else 0.0),
        "generate_wall_s": _fmt(ev["gen_wall"], 1), "threads": args.threads, "cpu": cpu_name(),
        "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "study_command": study_cmd, "train_command": cmd_text, "generate_command": ev["gen_cmd"],
        "curve_file": str((run_dir / "curve.json").relative_to(args.out)),
        "final_shortcuts": json.dumps(ev["shortcuts"], sort_keys=True) if ev["shortcuts"] else "",
        "validate_every": getattr(args, "validate_every", 0) or "",
        "resumed_at": segments.resumed_at(run_dir),
        **diagnostics(SCHEMES[scheme], "".join(t for _, t in segments.texts(run_dir)), enc,
                      dec, omega_file, curve, args.warmup, ev["probed"]),
    }
    log(f"{key}: {status} ({reason}); BLEU {row['bleu']}; {row['updates_per_s']} updates/s")
    return row


def backfill(args, root: Path, csv_path: Path) -> None:
    """Fill the probe's columns of rows recorded without them whose run folder is still in
    ``OUT/runs``. Rows without the diagnostic columns: omegas at initialisation and gradient
    norms from its train.log, the probe from its checkpoints where they were kept
    (``--keep-checkpoints``); rows with them but without the encoder-collapse columns:
    those, from the kept checkpoints. A row is filled once; the probes run outside the CSV
    lock, and the rows are merged by key under it."""
    filled = {}
    for r in read_rows(csv_path):
        if not r["curve_file"] or r["scheme"] not in SCHEMES:
            continue
        run_dir = args.out / Path(r["curve_file"]).parent
        log_file = run_dir / "train.log"
        if r["init_omegas"] or r["gnorms"] or r["source_gain"]:
            if r["encoder_cos"] or not (run_dir / "ckpt" / "checkpoint_best.pt").is_file():
                continue
            probed = probe_run(root, run_dir / "ckpt", fairseq_env(args.threads))
            if "encoder_cos" in probed:
                filled[r["key"]] = collapse_columns(probed)
                log(f"{r['key']}: encoder-collapse columns filled (encoder cos "
                    f"{filled[r['key']]['encoder_cos']})")
            continue
        if not log_file.is_file():
            continue
        probed = probe_run(root, run_dir / "ckpt", fairseq_env(args.threads))
        omega_file = run_dir / "omegas.json" if r["scheme"] in OMEGA_VARIANTS else None
        text = log_file.read_text()
        filled[r["key"]] = diagnostics(SCHEMES[r["scheme"]], text, int(r["encoder_layers"]),
                                       int(r["decoder_layers"]), omega_file, parse_curve(text),
                                       int(r["warmup"]), probed)
        log(f"{r['key']}: diagnostic columns filled (source gain "
            f"{filled[r['key']]['source_gain'] or '-'})")
    if filled:
        with csv_lock(csv_path):
            rows = read_rows(csv_path)
            for r in rows:
                r.update(filled.get(r["key"], {}))
            write_rows(csv_path, rows)
