"""Build admin_transformer / transformer models in-process the way fairseq-train does."""
from __future__ import annotations

from typing import Sequence

import torch
from fairseq import options, tasks

from fairseq_cli_utils import USER_DIR

# a width-16 model: fast enough to build many variants in one test
SMALL = [
    "--encoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2",
    "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "2",
]
POS_CHOICES = ["sinusoidal", "scaled-sinusoidal", "learned", "none"]


def residuals(stack):
    """The residual modules of one stack, in execution order."""
    out = []
    for layer in stack.layers:
        for name in ("self_attn_residual", "encoder_attn_residual", "final_residual"):
            mod = getattr(layer, name, None)
            if mod is not None:
                out.append(mod)
    return out


def parse(data, arch: str, extra: Sequence[str] = ()):
    parser = options.get_training_parser()
    return options.parse_args_and_arch(
        parser, [str(data), "--user-dir", USER_DIR, "--arch", arch, "--cpu", *map(str, extra)]
    )


def build(data, arch: str, extra: Sequence[str] = (), seed: int = 1):
    args = parse(data, arch, extra)
    task = tasks.setup_task(args)
    torch.manual_seed(seed)
    model = task.build_model(args)
    return model, task, args


def sample_batch(task, bsz=3, src_len=7, tgt_len=5, seed=0, left_pad_lengths=None):
    """Random ``(src (B, S), src_lengths (B,), prev_output_tokens (B, T))``; sources left-padded
    to ``left_pad_lengths`` when given (fairseq's default source padding)."""
    g = torch.Generator().manual_seed(seed)
    d = task.source_dictionary
    lo, hi = d.nspecial, len(d)
    src = torch.randint(lo, hi, (bsz, src_len), generator=g)
    src[:, -1] = d.eos()
    lengths = torch.full((bsz,), src_len)
    if left_pad_lengths is not None:
        for b, n in enumerate(left_pad_lengths):
            src[b, : src_len - n] = d.pad()
            lengths[b] = n
    prev = torch.randint(lo, hi, (bsz, tgt_len), generator=g)
    prev[:, 0] = d.eos()
    return src, lengths, prev


def assert_incremental_matches_full(model, task, tgt_len=6, atol=1e-5):
    """Step-by-step decoding with ``incremental_state`` == one full decoder forward."""
    model.eval()
    src, lengths, prev = sample_batch(task, tgt_len=tgt_len, left_pad_lengths=[7, 4, 6])
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=lengths)
        full, _ = model.decoder(prev, encoder_out=enc)
        state = {}
        steps = [model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)[0]
                 for t in range(prev.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=atol, rtol=atol)


TRAINER_PRECISION = {
    None: [],
    "fp16": ["--fp16", "--fp16-no-flatten-grads"],  # one float32 master tensor per parameter
    "fp16-flat": ["--fp16"],  # fairseq's default flattened master copy
    "bf16": ["--bf16"],
}


LABEL_SMOOTHED = ("--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1")


def build_trainer(data, extra: Sequence[str] = (), precision=None, seed: int = 3,
                  arch: str = "admin_transformer", criterion: Sequence[str] = LABEL_SMOOTHED):
    """fairseq's own ``Trainer`` for ``arch``, built as ``fairseq-train`` builds it (seeded
    model, task, criterion; Adam lr 3e-3, 400 tokens; ``extra`` flags win). ``precision``: a
    key of :data:`TRAINER_PRECISION`; fairseq ties ``--bf16`` to TPUs, so ``tpu`` is reset
    to run its bf16 path on the CPU."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    argv = [str(data), "--user-dir", USER_DIR, "--arch", arch, "--cpu",
            "--optimizer", "adam", "--lr", "3e-3", "--max-tokens", "400", *criterion,
            "--seed", str(seed), "--num-workers", "0", *map(str, extra),
            *TRAINER_PRECISION[precision]]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    args.tpu = False
    cfg = convert_namespace_to_omegaconf(args)
    torch.manual_seed(seed)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    return Trainer(cfg, task, model, criterion)
