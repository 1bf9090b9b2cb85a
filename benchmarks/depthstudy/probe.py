"""What a trained run does with its omegas and its source: measured on its checkpoints.

Run as ``python -m depthstudy.probe --data BIN --best CKPT --last CKPT`` (from
``benchmarks/``; the runner does it after each run, before the checkpoints are deleted); prints
one JSON object:

* ``final_omegas``: per stack, the mean of each sub-layer's omega vector in
  ``checkpoint_last.pt``, in execution order (encoder: self-attention, FFN per layer; decoder:
  self-attention, encoder-attention, FFN per layer);
* ``valid_nll``: the validation nll (bits per target token, ``</s>`` included, no label
  smoothing: the number fairseq logs as ``valid_nll_loss``) of ``checkpoint_best.pt`` in eval
  mode, computed here from the model's log-probabilities, not by fairseq's criterion;
* ``valid_nll_other_source``: the same targets, each with the source of the *next*
  validation sentence (sentence ``i`` gets the source of ``i + 1``, the last the first's);
* ``source_gain``: ``valid_nll_other_source - valid_nll``. A decoder that reads the source
  loses bits when it is given another sentence's; one that ignores the source (a German
  language model) loses nothing, so "ignores the source" is a number (about 0), not a guess;
* ``encoder_cos``: why it may ignore it: the mean cosine between the encoder outputs of two
  different source tokens of the first ``COLLAPSE_SENTENCES`` validation sentences (all
  their tokens pooled), in ``checkpoint_best.pt``; 1 is a collapsed encoder that gives the
  decoder one vector whatever the source
  (``fairseq_admin_pos.cli.analysis.measure.encoder_token_cosines``);
  ``encoder_cos_init`` the same for the model training started from (the checkpoint's flags
  and seed, as ``fairseq-admin-analyze --checkpoint`` builds it; a profiled Admin profiled on
  these sentences), and ``encoder_cos_layers`` the checkpoint's after the embedding and after
  each encoder layer.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: validation sentences of the encoder-collapse measure (about 3,100 tokens of the study's Multi30k)
COLLAPSE_SENTENCES = 200
#: residual modules of each layer, in execution order (as fairseq_admin_pos.models.admin_profile)
SUBLAYERS = {
    "encoder": ("self_attn_residual", "final_residual"),
    "decoder": ("self_attn_residual", "encoder_attn_residual", "final_residual"),
}


def omegas_per_sublayer(state) -> dict:
    """``{stack: [mean omega of each sub-layer]}`` of a model state dict (trainable omega
    vectors or scalar buffers); stacks without omegas are left out."""
    out = {}
    for stack, names in SUBLAYERS.items():
        values = []
        layer = 0
        while any(k.startswith(f"{stack}.layers.{layer}.") for k in state):
            for name in names:
                v = state.get(f"{stack}.layers.{layer}.{name}.omega")
                if v is not None:
                    values.append(round(v.double().mean().item(), 4))
            layer += 1
        if values:
            out[stack] = values
    return out


def _load(ckpt: Path, data: Path):
    from fairseq import checkpoint_utils, utils

    utils.import_user_module(argparse.Namespace(user_dir=str(REPO / "fairseq_admin_pos")))
    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(ckpt)], arg_overrides={"data": str(data)})
    model = models[0].float().eval()
    return model, task


def valid_nll(model, task, other_source: bool, batch_sentences: int = 64) -> float:
    """Bits per target token of the validation set (see the module docstring)."""
    import torch

    task.load_dataset("valid")
    ds = task.dataset("valid")
    pad = task.target_dictionary.pad()
    n = len(ds)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, n, batch_sentences):
            samples = []
            for i in range(start, min(n, start + batch_sentences)):
                s = dict(ds[i])
                if other_source:
                    s["source"] = ds[(i + 1) % n]["source"]
                samples.append(s)
            batch = ds.collater(samples)
            out = model(**batch["net_input"])
            lprobs = model.get_normalized_probs(out, log_probs=True).double()
            target = batch["target"]
            picked = lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            mask = target.ne(pad)
            total += -picked[mask].sum().item()
            tokens += int(mask.sum().item())
    return total / tokens / math.log(2)


def encoder_collapse(best: Path, data: Path, sentences: int = COLLAPSE_SENTENCES) -> dict:
    """``encoder_cos``, ``encoder_cos_init`` and ``encoder_cos_layers`` (module docstring)."""
    from fairseq_admin_pos.cli.analysis.checkpoint import load_checkpoint
    from fairseq_admin_pos.cli.analysis.measure import encoder_token_cosines
    from fairseq_admin_pos.cli.analysis.variants import profile_admin

    init_model, model, task, cfg, _ = load_checkpoint(str(best), str(data))
    task.load_dataset("valid")
    ds = task.dataset("valid")
    batch = ds.collater([ds[i] for i in range(min(sentences, len(ds)))])["net_input"]
    if init_model.admin_settings["admin_init"] == "profile":
        profile_admin(init_model, batch, seed=cfg.common.seed)
    trained = encoder_token_cosines(model, batch)
    return dict(encoder_cos=round(trained[-1], 4),
                encoder_cos_init=round(encoder_token_cosines(init_model, batch)[-1], 4),
                encoder_cos_layers=[round(c, 3) for c in trained[:-1]])


def probe(data: Path, best: Path, last: Path) -> dict:
    import torch

    sys.path.insert(0, str(REPO))
    from fairseq_admin_pos.fairseq_fixes.checkpoint_compat import allow_fairseq_checkpoints

    allow_fairseq_checkpoints()
    torch.manual_seed(0)
    result = {"final_omegas": omegas_per_sublayer(
        torch.load(last, map_location="cpu")["model"])}
    model, task = _load(best, data)
    same = valid_nll(model, task, other_source=False)
    other = valid_nll(model, task, other_source=True)
    result.update(valid_nll=round(same, 4), valid_nll_other_source=round(other, 4),
                  source_gain=round(other - same, 4))
    result.update(encoder_collapse(best, data))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="the fairseq binary data folder")
    p.add_argument("--best", type=Path, required=True, help="checkpoint_best.pt of the run")
    p.add_argument("--last", type=Path, required=True, help="checkpoint_last.pt of the run")
    args = p.parse_args(argv)
    for name in ("data", "best", "last"):
        if not getattr(args, name).exists():
            p.error(f"--{name} {getattr(args, name)}: does not exist")
    print(json.dumps(probe(args.data, args.best, args.last), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
