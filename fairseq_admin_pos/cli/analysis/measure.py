"""The measurement of ``fairseq-admin-analyze``: ``admin_transformer`` models built through
fairseq's own model-building path (float32, eval mode), their input batches (random tokens,
or the first batch of a binarized subset), the shortcut weights of their residual sub-layers,
and the output change ``|F(x,W) - F(x,W+delta)|^2 / |F(x,W)|^2`` under a random perturbation
of the weights that ``--perturb`` selects."""
from __future__ import annotations

import os
from typing import List, Sequence, Tuple

import torch

import fairseq_admin_pos  # noqa: F401  (registers admin_transformer)
from fairseq import options, tasks, utils
from fairseq.data import data_utils

from fairseq_admin_pos.collapse import mean_pairwise_cosine

PERTURB_CHOICES = ("branches", "all")


def write_dicts(folder: str, vocab: int) -> None:
    """``dict.src.txt`` and ``dict.tgt.txt`` of ``vocab`` words, for the random-token mode."""
    for lang in ("src", "tgt"):
        with open(os.path.join(folder, f"dict.{lang}.txt"), "w", encoding="utf-8") as f:
            for i in range(vocab):
                f.write(f"w{i} 1\n")


def build_model(data: str, langs: Sequence[str], model_args: Sequence[str], seed: int):
    """``(model, task)`` through fairseq's option parser and ``task.build_model``, float32, eval."""
    argv = [data, "--arch", "admin_transformer", "--cpu", "--seed", str(seed)]
    if langs:
        argv += ["--source-lang", langs[0], "--target-lang", langs[1]]
    parser = options.get_training_parser(default_task="translation")
    args = options.parse_args_and_arch(parser, argv + list(model_args))
    task = tasks.setup_task(args)
    utils.set_torch_seed(seed)
    model = task.build_model(args)
    return model.float().eval(), task


def random_batch(task, batch_size: int, max_len: int, seed: int) -> dict:
    """Random token sentences of length max_len/2..max_len (+ eos), collated like fairseq's
    LanguagePairDataset (left-padded source, right-padded shifted target), so there is
    padding to exclude."""
    g = torch.Generator().manual_seed(seed)
    src_dict, tgt_dict = task.source_dictionary, task.target_dictionary
    src, tgt = [], []
    for _ in range(batch_size):
        for d, out in ((src_dict, src), (tgt_dict, tgt)):
            n = int(torch.randint(max(1, max_len // 2), max_len + 1, (1,), generator=g))
            toks = torch.randint(d.nspecial, len(d), (n,), generator=g)
            out.append(torch.cat([toks, torch.tensor([d.eos()])]))
    return {
        "src_tokens": data_utils.collate_tokens(src, src_dict.pad(), src_dict.eos(), left_pad=True),
        "src_lengths": torch.tensor([len(s) for s in src]),
        "prev_output_tokens": data_utils.collate_tokens(
            tgt, tgt_dict.pad(), tgt_dict.eos(), left_pad=False, move_eos_to_beginning=True
        ),
    }


def data_batch(task, subset: str, max_tokens: int, seed: int) -> dict:
    """The first batch (seeded shuffle) of a binarized subset."""
    task.load_dataset(subset)
    itr = task.get_batch_iterator(
        task.dataset(subset), max_tokens=max_tokens, seed=seed, ignore_invalid_inputs=True,
        disable_iterator_cache=True,
    ).next_epoch_itr(shuffle=True)
    sample = next(iter(itr))
    n = sample["net_input"]
    return {k: n[k] for k in ("src_tokens", "src_lengths", "prev_output_tokens")}


def shortcut_weights(modules) -> List[float]:
    """The shortcut weight of each residual sub-layer: Admin's omega or DeepNorm's alpha; 1
    for ReZero's plain shortcut x."""
    return [float(m.omega.detach().reshape(-1)[0].float()) if hasattr(m, "omega") else 1.0
            for m in modules]


def _outputs(model, n) -> Tuple[torch.Tensor, torch.Tensor]:
    """Encoder output and decoder features, both (B, T, C)."""
    with torch.no_grad():
        enc = model.encoder(n["src_tokens"], src_lengths=n["src_lengths"])
        dec, _ = model.decoder(n["prev_output_tokens"], encoder_out=enc, features_only=True)
    return enc["encoder_out"][0].transpose(0, 1), dec


def perturbed_parameters(model, which: str) -> List[torch.Tensor]:
    """The tensors ``--perturb`` selects: ``branches`` = every parameter inside the encoder and
    decoder layers except LayerNorms and omegas; ``all`` = every parameter except omegas."""
    if which not in PERTURB_CHOICES:
        raise ValueError(f"--perturb {which!r} is not valid; valid choices: {', '.join(PERTURB_CHOICES)}")
    out = []
    for name, p in model.named_parameters():
        if name.endswith(".omega"):
            continue  # the shortcut weight is Admin's knob, not a branch weight
        if which == "branches" and (".layers." not in name or "layer_norm" in name):
            continue
        out.append(p)
    return out


def output_change(model, n, eps: float, trials: int, which: str, seed: int) -> Tuple[float, float]:
    """Mean over ``trials`` of ``|F(x,W) - F(x,W+delta)|^2 / |F(x,W)|^2`` for the encoder and
    the decoder output (real-token positions only); the weights are restored afterwards."""
    pad_src = n["src_tokens"].ne(model.encoder.padding_idx)
    pad_tgt = n["prev_output_tokens"].ne(model.decoder.padding_idx)
    e0, d0 = _outputs(model, n)
    params = perturbed_parameters(model, which)
    saved = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(seed)
    enc, dec = [], []
    try:
        for _ in range(trials):
            with torch.no_grad():
                for p in params:
                    rms = p.detach().double().pow(2).mean().sqrt().item()
                    p.add_(eps * rms * torch.randn(p.shape, generator=g, dtype=p.dtype))
            e1, d1 = _outputs(model, n)
            enc.append(((e1 - e0)[pad_src].double().pow(2).sum() / e0[pad_src].double().pow(2).sum()).item())
            dec.append(((d1 - d0)[pad_tgt].double().pow(2).sum() / d0[pad_tgt].double().pow(2).sum()).item())
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
    return sum(enc) / trials, sum(dec) / trials


def encoder_token_cosines(model, n) -> List[float]:
    """How alike the encoder makes different source tokens:
    :func:`fairseq_admin_pos.collapse.mean_pairwise_cosine` over
    every non-pad token of the batch ``n`` (tokens of all sentences pooled), after the
    embedding, after each encoder layer, and of the encoder output (after the final
    LayerNorm of Pre-LN stacks: what the decoder's cross-attention reads). A last value near
    1 is a collapsed encoder: every token of every sentence gives the decoder one vector, so
    its output cannot depend on the source (Dong et al. 2021, "Attention is not all you
    need: pure attention loses rank doubly exponentially with depth")."""
    with torch.no_grad():
        enc = model.encoder(n["src_tokens"], src_lengths=n["src_lengths"],
                            return_all_hiddens=True)
    keep = ~enc["encoder_padding_mask"][0].transpose(0, 1)  # (T, B)
    stages = list(enc["encoder_states"]) + [enc["encoder_out"][0]]
    return [mean_pairwise_cosine(x[keep]) for x in stages]
