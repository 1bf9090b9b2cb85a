"""Peak memory of one training step of a 60L-12L ``admin_transformer`` with and without
fairseq's ``--checkpoint-activations`` (and ``--offload-activations``), side by side.

    python benchmarks/memory_checkpoint_activations.py                       # Admin, d=128
    python benchmarks/memory_checkpoint_activations.py --schemes admin deepnorm rezero \\
        --embed-dim 64 --batch 32 --tokens 64

Every (scheme, setting) runs in a fresh child process that builds the model (the
``admin_transformer_wmt_en_de_60l_12l`` depth at width ``--embed-dim``, FFN 4x, heads
d/32), takes one forward + backward step (label-smoothed cross entropy, dropout 0.1) on a
random batch of ``--batch`` sentences of ``--tokens`` tokens on each side, and reports:

* on a GPU (when CUDA is available): ``torch.cuda.max_memory_allocated`` during the step
  minus the memory allocated before it: tensor bytes, what activation checkpointing and
  offloading are for;
* on the CPU: the process's peak resident memory during the step (``ru_maxrss``) minus its
  resident memory before the step. glibc is told to serve every block above 64 KiB with its
  own ``mmap`` (``MALLOC_MMAP_THRESHOLD_``), so a freed tensor leaves the process at once and
  the peak RSS follows the peak of live tensors instead of the allocator's retained heap.

A warm-up step on a 1 x 4 batch comes first: it allocates the parameter gradients and pages
in the libraries' backward code, so the figures are the activations and temporaries of the
measured step (what checkpointing trades for recomputation). The per-token loss is printed
to show that the settings compute the same step.

``--offload-activations`` moves the saved layer inputs to host memory: on a CPU-only
machine they are already there, so that row measures the same as checkpointing and only
shows that the path runs; its saving is visible on a GPU only.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
USER_DIR = str(REPO / "fairseq_admin_pos")
SETTINGS = {
    "plain": [],
    "checkpoint": ["--checkpoint-activations"],
    "offload": ["--offload-activations"],  # fairseq: implies --checkpoint-activations
}
SCHEMES = ("admin", "deepnorm", "rezero", "rezero-post-ln", "b2t", "resi-dual")


def _rss_now_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _build(a):
    """The model and criterion of ``a``'s scheme and setting, with a dictionary of
    ``a.vocab`` words (all the translation task needs here)."""
    import torch
    from fairseq import options, tasks

    with tempfile.TemporaryDirectory() as data:
        for lang in ("src", "tgt"):
            Path(data, f"dict.{lang}.txt").write_text(
                "".join(f"w{i} 1\n" for i in range(a.vocab)))
        d = a.embed_dim
        argv = [
            data, "--user-dir", USER_DIR, "--arch", "admin_transformer_wmt_en_de_60l_12l",
            "--source-lang", "src", "--target-lang", "tgt",
            "--encoder-layers", str(a.encoder_layers), "--decoder-layers", str(a.decoder_layers),
            "--encoder-embed-dim", str(d), "--decoder-embed-dim", str(d),
            "--encoder-ffn-embed-dim", str(4 * d), "--decoder-ffn-embed-dim", str(4 * d),
            "--encoder-attention-heads", str(max(1, d // 32)),
            "--decoder-attention-heads", str(max(1, d // 32)),
            "--dropout", "0.1", "--admin-residual", a.scheme,
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            *SETTINGS[a.setting],
        ]
        if not torch.cuda.is_available():
            argv.append("--cpu")
        args = options.parse_args_and_arch(options.get_training_parser(), argv)
        task = tasks.setup_task(args)
        return task, task.build_model(args), task.build_criterion(args)


def _random_batch(dictionary, bsz: int, length: int, seed: int, device) -> dict:
    """A ``bsz`` x ``length`` batch of random words, each sentence ending in EOS."""
    import torch

    lo, hi, eos = dictionary.nspecial, len(dictionary), dictionary.eos()
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(lo, hi, (bsz, length), generator=g)
    tgt = torch.randint(lo, hi, (bsz, length), generator=g)
    src[:, -1] = tgt[:, -1] = eos
    prev = torch.cat([tgt[:, -1:], tgt[:, :-1]], dim=1)
    return {
        "net_input": {"src_tokens": src.to(device),
                      "src_lengths": torch.full((bsz,), length).to(device),
                      "prev_output_tokens": prev.to(device)},
        "target": tgt.to(device), "ntokens": tgt.numel(), "nsentences": bsz,
    }


def _peak_of_step(model, criterion, sample, device):
    """``(loss, peak bytes, what was measured)`` of one forward and backward on ``sample``."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _rss_now_kib() * 1024
        if resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 > before + 2 ** 20:
            # the high-water mark must come from the measured step, not from earlier
            before_hw = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        else:
            before_hw = before
    loss = criterion(model, sample)[0]
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        return loss, torch.cuda.max_memory_allocated() - before, \
            "cuda max_memory_allocated above the pre-step allocation"
    high = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if high <= before_hw:
        raise RuntimeError("the measured step did not raise the RSS high-water mark; "
                           "use a larger --batch/--tokens")
    return loss, high - before, "cpu peak RSS (ru_maxrss) above the pre-step RSS"


def worker(a) -> dict:
    """Build the model, take one step, return the figures (runs in a child process)."""
    import torch

    torch.manual_seed(0)
    task, model, criterion = _build(a)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    dictionary = task.source_dictionary
    # warm-up on a 1 x 4 batch: allocates the gradients and pages in the backward code of
    # the libraries, so the measured step below counts activations and temporaries only
    criterion(model, _random_batch(dictionary, 1, 4, 0, device))[0].backward()
    for prm in model.parameters():
        if prm.grad is not None:
            prm.grad.zero_()
    sample = _random_batch(dictionary, a.batch, a.tokens, 1, device)
    torch.manual_seed(2)  # same dropout masks in every setting
    t0 = time.perf_counter()
    loss, peak, kind = _peak_of_step(model, criterion, sample, device)
    seconds = time.perf_counter() - t0
    return {"scheme": a.scheme, "setting": a.setting, "peak_bytes": peak,
            "params": n_params, "seconds": seconds,
            "loss_per_token": float(loss.item()) / sample["ntokens"], "measure": kind,
            "device": device.type}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schemes", nargs="+", default=["admin"], choices=SCHEMES,
                   help="residual schemes to measure (--admin-residual). Default: admin")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS),
                   help="memory settings. Default: all three")
    p.add_argument("--embed-dim", type=int, default=128, help="model width d. Default: 128")
    p.add_argument("--encoder-layers", type=int, default=60, help="encoder layers (default 60)")
    p.add_argument("--decoder-layers", type=int, default=12, help="decoder layers (default 12)")
    p.add_argument("--batch", type=int, default=32, help="sentences per batch. Default: 32")
    p.add_argument("--tokens", type=int, default=64, help="tokens per sentence. Default: 64")
    p.add_argument("--vocab", type=int, default=1000, help="size of the random dictionary (default 1000)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--scheme", default="admin", help=argparse.SUPPRESS)
    p.add_argument("--setting", default="plain", help=argparse.SUPPRESS)
    return p


def run_workers(a) -> list:
    """One fresh worker process per (scheme, setting), so each peak is its own process's."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # see the module docstring
    common = ["--embed-dim", str(a.embed_dim), "--encoder-layers", str(a.encoder_layers),
              "--decoder-layers", str(a.decoder_layers), "--batch", str(a.batch),
              "--tokens", str(a.tokens), "--vocab", str(a.vocab)]
    rows = []
    for scheme in a.schemes:
        for setting in a.settings:
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", "--scheme", scheme, "--setting", setting,
                 *common], env=env, cwd=REPO, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-4000:])
                raise SystemExit(f"worker {scheme}/{setting} failed ({proc.returncode})")
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return rows


def print_rows(a, rows) -> None:
    """The rows side by side, each peak as a ratio to its scheme's plain setting."""
    mib = 2 ** 20
    print(f"{a.encoder_layers}L-{a.decoder_layers}L admin_transformer, d={a.embed_dim}, "
          f"FFN {4 * a.embed_dim}, batch {a.batch} x {a.tokens} tokens per side, "
          f"{rows[0]['params'] / 1e6:.1f}M parameters; one forward+backward step after a "
          f"warm-up; measure: {rows[0]['measure']}")
    print(f"{'scheme':16s} {'setting':11s} {'peak MiB':>9s} {'plain/this':>10s} "
          f"{'step s':>7s} {'loss/token':>10s}")
    for r in rows:
        base = next((b for b in rows if b["scheme"] == r["scheme"] and b["setting"] == "plain"), None)
        ratio = f"{base['peak_bytes'] / max(r['peak_bytes'], 1):.2f}x" if base else ""
        print(f"{r['scheme']:16s} {r['setting']:11s} {r['peak_bytes'] / mib:9.1f} {ratio:>10s} "
              f"{r['seconds']:7.2f} {r['loss_per_token']:10.5f}")
    for scheme in a.schemes:
        by = {r["setting"]: r for r in rows if r["scheme"] == scheme}
        if "plain" in by and "checkpoint" in by:
            print(f"{scheme}: peak memory without / with --checkpoint-activations = "
                  f"{by['plain']['peak_bytes'] / max(by['checkpoint']['peak_bytes'], 1):.2f}x, "
                  f"step time {by['checkpoint']['seconds'] / by['plain']['seconds']:.2f}x")


def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.embed_dim < 8 or a.batch < 1 or a.tokens < 2:
        p.error("--embed-dim must be >= 8, --batch >= 1 and --tokens >= 2")
    if a.worker:
        print(json.dumps(worker(a)))
        return 0
    rows = run_workers(a)
    print_rows(a, rows)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
