"""fairseq glue of the export: checkpoints, configuration, the self-check and CTranslate2.

:func:`export` reads an ``admin_transformer`` checkpoint with fairseq (the plugin
registered), folds its state dict into fairseq's ``transformer``
(:func:`fairseq_admin_pos.export.fold.fold_state_dict`) and writes a checkpoint that stock
fairseq and CTranslate2's converter read as they are:

* ``cfg`` holds plain containers only (dict, list, str, numbers, None), so ``torch.load``'s
  default ``weights_only=True`` (torch >= 2.6) loads it without an allow-list and without
  ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``. ``cfg["model"]``, which fairseq-train fills with an
  ``argparse.Namespace`` (not an allowed global), is a ``collections.OrderedDict`` whose
  entries are also its attributes: fairseq turns it into a ``DictConfig`` like any mapping,
  and CTranslate2 4.8.5's ``FairseqConverter`` reads it by attribute (``args =
  checkpoint["args"] or checkpoint["cfg"]["model"]``, then ``args.data = ...``,
  ``args.arch``). ``OrderedDict`` is the one container whose instance attributes torch's
  weights-only unpickler restores (it is how state dicts keep ``_metadata``).
* the model section names ``transformer`` (``_name``, ``arch``), loses the plugin's flags
  and says how positions and embeddings are now stored; the task section (data path,
  languages, dictionaries) is unchanged; ``common.user_dir`` is cleared.
* kept for fairseq's loader (``load_checkpoint_to_cpu`` / ``_upgrade_state_dict`` need
  ``optimizer_history`` and ``extra_state``): the last ``optimizer_history`` entry without
  optimizer state, ``extra_state`` with only ``train_iterator``; dropped:
  ``last_optimizer_state``, the training meters (numpy arrays, tensors) and the plugin's
  ``_extra_state`` / ``admin_profiled`` entries. ``admin_export`` records where the file
  came from and what was folded.

The file is written to a temporary file next to ``out`` and renamed at the end; the
CTranslate2 model likewise goes to a temporary folder next to its target. Nothing is left
behind when any step fails.
"""
from __future__ import annotations

import argparse
import enum
import numbers
import os
import pickle
import shutil
import tempfile
import warnings
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

import fairseq_admin_pos
from fairseq_admin_pos.export.fold import (
    LAYER_NORM_EPS,
    ModelLayout,
    NotExportable,
    StackLayout,
    fold_state_dict,
)

__all__ = ["ExportError", "ExportReport", "export", "attribute_dict", "plain", "stock_args",
           "model_layout", "check_batch", "log_probs", "CT2_QUANTIZATIONS"]

#: CTranslate2's weight types (``ctranslate2.specs.model_spec.ACCEPTED_MODEL_TYPES``, 4.8.5),
#: spelled out so that ``--help`` works without the ``deploy`` extra
CT2_QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16",
                     "float16", "bfloat16", "float32")

#: the self-check refuses an export whose log-probabilities differ more than this from the
#: original's (the eps term of fold.py section 2 is orders of magnitude below; a wrong fold
#: is orders of magnitude above)
SELF_CHECK_TOLERANCE = 1e-3


class ExportError(Exception):
    """A checkpoint, flag or output that cannot be exported; the message says which."""


@dataclass
class ExportReport:
    """What :func:`export` did: the files, the folds, the self-check's figures."""

    out: Path
    ctranslate2: Optional[Path]
    scheme: str
    folds: List[str]
    eps_scales: Dict[str, float]
    max_abs_logprob_diff: float
    positions: Dict[str, str]
    unshared: bool


# -- plain containers -----------------------------------------------------------------
def attribute_dict(values: Dict[str, Any]) -> "OrderedDict[str, Any]":
    """An ``OrderedDict`` whose entries are also its attributes (module docstring: what
    fairseq and CTranslate2's converter both read, and torch loads with weights_only)."""
    d = OrderedDict(values)
    d.__dict__.update(values)
    return d


def plain(value: Any, where: str = "cfg") -> Any:
    """``value`` as plain containers: ``argparse.Namespace`` and mappings become dicts,
    tuples stay tuples, numpy scalars become Python numbers, enums their value; anything
    else that torch's weights-only loader would refuse raises :class:`ExportError` naming
    where it is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, enum.Enum):
        return plain(value.value, where)
    if hasattr(value, "keys") and hasattr(value, "items"):
        return {str(k): plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, numbers.Number) and hasattr(value, "item"):  # numpy scalars
        return value.item()
    raise ExportError(f"{where} holds a {type(value).__module__}.{type(value).__name__}, which "
                      "a weights-only torch.load refuses and the export cannot turn into "
                      "a plain value")


# -- the plugin's configuration -------------------------------------------------------
def _plugin_model_keys() -> set:
    from fairseq.models.transformer import TransformerModel

    from fairseq_admin_pos.models.admin_transformer import AdminTransformerModel
    from fairseq_admin_pos.models.config import flag_actions

    ours = {a.dest for a in flag_actions(AdminTransformerModel.add_args)}
    stock = {a.dest for a in flag_actions(TransformerModel.add_args)}
    return ours - stock


def model_layout(model, model_args) -> ModelLayout:
    """The fold's view of a built ``admin_transformer`` (its settings and stacks)."""
    settings = model.admin_settings

    def stack(side: str, module) -> StackLayout:
        layers = module.layers
        return StackLayout(
            side=side,
            layers=len(layers),
            embed_dim=module.embed_tokens.embedding_dim,
            padding_idx=module.padding_idx,
            # the built module's value: a fairseq-hydra-train config has no such key when
            # the run left it at fairseq's default
            max_positions=getattr(module, f"max_{'source' if side == 'encoder' else 'target'}"
                                          "_positions"),
            positions=settings[f"{side}_pos_emb"],
            normalize_before=bool(getattr(model_args, f"{side}_normalize_before", False)),
            cross_attention=side == "decoder" and len(layers) > 0
            and getattr(layers[0], "encoder_attn", None) is not None,
            layernorm_embedding=getattr(module, "layernorm_embedding", None) is not None,
        )

    return ModelLayout(
        scheme=settings["admin_residual"],
        encoder=stack("encoder", model.encoder),
        decoder=stack("decoder", model.decoder),
        share_all_embeddings=bool(getattr(model_args, "share_all_embeddings", False)),
        share_decoder_input_output_embed=bool(
            getattr(model_args, "share_decoder_input_output_embed", False)),
        # checkpoints from before --admin-norm are LayerNorm models
        norm=settings.get("admin_norm") or "layernorm",
    )


def _check_supported(model_args, layout: ModelLayout, state: Dict[str, torch.Tensor],
                     scalar_fold: str) -> None:
    """Model options that a fold would get wrong are refused by name (none of them is
    set by the package's recipes)."""
    def on(name):
        return bool(getattr(model_args, name, None))

    for name in ("encoder_layers_to_keep", "decoder_layers_to_keep"):
        if on(name):
            raise NotExportable(f"--{name.replace('_', '-')} (LayerDrop pruning at load time) "
                                "is not supported by the export; prune the checkpoint first")
    omegas = [v for k, v in state.items() if k.endswith(".omega")]
    scalar_not_one = any(v.numel() == 1 and float(v) != 1.0 for v in omegas)
    vector = any(v.numel() > 1 for v in omegas) or (scalar_fold == "input" and scalar_not_one)
    scalar_folds = layout.scheme == "rezero-post-ln" or (
        scalar_fold == "output" and scalar_not_one)
    if vector and on("cross_self_attention"):
        raise NotExportable("--cross-self-attention with --admin-omega parameter: the decoder "
                            "self-attention's k/v also read the encoder output, so 1/omega "
                            "cannot be folded into them")
    if vector and on("adaptive_softmax_cutoff"):
        raise NotExportable("--adaptive-softmax-cutoff with --admin-omega parameter is not "
                            "supported by the export (the folded decoder table would need its "
                            "own adaptive softmax weights)")
    if vector and getattr(model_args, "decoder_input_dim", None) not in (
            None, getattr(model_args, "decoder_embed_dim", None)):
        raise NotExportable("--decoder-input-dim different from --decoder-embed-dim with "
                            "--admin-omega parameter is not supported by the export")
    if scalar_folds and on("scale_attn"):
        raise NotExportable("--scale-attn (NormFormer's LayerNorm after the self-attention) "
                            "with a shortcut or ReZero weight != 1: the weight cannot be "
                            "folded into out_proj through that LayerNorm")


def stock_args(model_args, fold_positions: Dict[str, str], unshared: bool,
               data: str) -> Dict[str, Any]:
    """The flat model settings of the exported ``transformer`` (plain values)."""
    args = plain(model_args, "cfg.model")
    for key in _plugin_model_keys():
        args.pop(key, None)
    args["arch"] = args["_name"] = "transformer"
    args["user_dir"] = None
    args["data"] = data
    both_none = set(fold_positions.values()) == {"none"}
    args["no_token_positional_embeddings"] = both_none
    for side in ("encoder", "decoder"):
        args[f"{side}_learned_pos"] = fold_positions[side] == "learned"
    if unshared:
        args["share_all_embeddings"] = False
        args["share_decoder_input_output_embed"] = False
    return args


# -- loading --------------------------------------------------------------------------
def _original_data(state) -> str:
    if state.get("args") is not None:
        return state["args"].data
    cfg = state["cfg"]
    data = cfg.get("task", {}).get("data")
    if data is None:
        data = getattr(cfg.get("model"), "data", None)
    if data is None:
        raise ExportError("the checkpoint's configuration names no data folder (task.data)")
    return data


def _load_original(path: Path, data: Optional[str]):
    """``(raw state, model, cfg, task)``: the checkpoint as stored, and the model built by
    fairseq from it as fairseq-generate builds it (dictionaries from ``data`` when given)."""
    from fairseq import checkpoint_utils

    fairseq_admin_pos.register()
    if not zipfile.is_zipfile(path):
        raise ExportError(f"CHECKPOINT {path} is not a checkpoint (torch.save writes a zip "
                          "archive)")
    try:
        raw = torch.load(path, map_location="cpu")
    except (RuntimeError, EOFError, pickle.UnpicklingError, OSError) as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        # torch's weights-only message: the line naming the refused global
        reason = next((ln for ln in lines if "Unsupported global" in ln),
                      lines[0] if lines else type(e).__name__)
        raise ExportError(f"cannot read CHECKPOINT {path}: {reason}") from None
    if not isinstance(raw, dict) or "model" not in raw:
        raise ExportError(f"{path} is not a fairseq checkpoint (no 'model' entry)")
    cfg_model = raw["args"] if raw.get("args") is not None else raw.get("cfg", {}).get("model")
    arch = getattr(cfg_model, "_name", None) or getattr(cfg_model, "arch", None)
    if arch is None and isinstance(cfg_model, dict):
        arch = cfg_model.get("_name") or cfg_model.get("arch")
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    if ARCH_MODEL_NAME_REGISTRY.get(arch) != "admin_transformer":
        raise ExportError(f"{path} holds a {arch!r} model; fairseq-admin-export exports "
                          "admin_transformer checkpoints (a stock transformer needs no export)")
    overrides = {"data": data} if data else None
    try:
        models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
            [str(path)], arg_overrides=overrides)
    except FileNotFoundError as e:
        raise ExportError(f"cannot build the model of {path}: {e}; pass --data with the "
                          "folder holding its dictionaries") from None
    except ValueError as e:  # the model's own checks of its settings
        raise ExportError(f"cannot build the model of {path}: {e}") from None
    model = models[0].eval()
    return raw, model, cfg, task


# -- the self-check --------------------------------------------------------------------
def check_batch(dictionary, seed: int = 0, bsz: int = 4, src_len: int = 11, tgt_len: int = 9):
    """A deterministic batch with padding: ``(src (B, S) left-padded, src_lengths (B,),
    prev_output_tokens (B, T) right-padded)``, random non-special tokens."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = dictionary.nspecial, len(dictionary)
    src = torch.randint(lo, hi, (bsz, src_len), generator=g)
    lengths = torch.tensor([src_len, src_len - 4, 3, src_len - 1][:bsz])
    for b, n in enumerate(lengths.tolist()):
        src[b, : src_len - n] = dictionary.pad()
        src[b, -1] = dictionary.eos()
    prev = torch.randint(lo, hi, (bsz, tgt_len), generator=g)
    prev[:, 0] = dictionary.eos()
    for b, n in enumerate([tgt_len, tgt_len - 3, 2, tgt_len - 1][:bsz]):
        prev[b, n:] = dictionary.pad()
    return src, lengths, prev


def log_probs(model, src, lengths, prev) -> torch.Tensor:
    """Float32 ``log p(y_t | y_<t, x)`` ``(B, T, V)`` of a full decoder forward."""
    with torch.no_grad():
        logits, _ = model(src, lengths, prev)
    return torch.log_softmax(logits.float(), dim=-1)


def _self_check(original, stock, task) -> float:
    src, lengths, prev = check_batch(task.source_dictionary)
    keep = prev.ne(task.target_dictionary.pad())
    with warnings.catch_warnings():
        # torch's note about fairseq passing a bool padding mask with a float causal mask
        warnings.filterwarnings("ignore", message=".*mismatched key_padding_mask.*")
        diff = (log_probs(original, src, lengths, prev)
                - log_probs(stock, src, lengths, prev)).abs()
    return float(diff[keep].max())


# -- writing --------------------------------------------------------------------------
def _export_state(raw, model, cfg, layout, source: Path, none_as_zero_table: bool,
                  scalar_fold: str):
    from omegaconf import OmegaConf

    model_state = model.state_dict()
    fold = fold_state_dict(model_state, layout, none_as_zero_table=none_as_zero_table,
                           scalar_fold=scalar_fold)
    data = _original_data(raw)
    model_args = cfg.model
    if OmegaConf.is_config(model_args):
        model_args = OmegaConf.to_container(model_args, resolve=True)
    args = stock_args(model_args, fold.positions, fold.unshared, data)
    # stated, not left to the reader's default: the folded position tables have these sizes
    args["max_source_positions"] = layout.encoder.max_positions
    args["max_target_positions"] = layout.decoder.max_positions
    full = {}
    for key in cfg.keys():
        if key == "model":
            continue
        section = cfg[key]
        full[key] = plain(OmegaConf.to_container(section, resolve=True, enum_to_str=True)
                          if OmegaConf.is_config(section) else section, f"cfg.{key}")
    if "task" not in args and isinstance(full.get("task"), dict):
        # a hydra-trained model's section lacks the task settings CTranslate2 reads
        args.update({k: v for k, v in full["task"].items() if k != "_name"})
        args["task"] = full["task"].get("_name")
    full["model"] = attribute_dict(args)
    if isinstance(full.get("common"), dict):
        full["common"]["user_dir"] = None
    if isinstance(full.get("task"), dict) and "data" in full["task"]:
        full["task"]["data"] = data

    history = raw.get("optimizer_history") or [{}]
    last = {k: history[-1][k] for k in ("criterion_name", "optimizer_name",
                                        "lr_scheduler_state", "num_updates")
            if k in history[-1]}
    train_iterator = (raw.get("extra_state") or {}).get("train_iterator")
    state = {
        "args": None,
        "cfg": full,
        "model": fold.state_dict,
        "criterion": None,
        "optimizer_history": [plain(last, "optimizer_history")],
        "task_state": plain(raw.get("task_state") or {}, "task_state"),
        "extra_state": {"train_iterator": plain(train_iterator, "extra_state.train_iterator")},
        "admin_export": {
            "source": str(source),
            "scheme": layout.scheme,
            "package_version": fairseq_admin_pos.__version__,
            "folds": list(fold.folds),
            "eps_scales": dict(fold.eps_scales),
            "layer_norm_eps": LAYER_NORM_EPS,
        },
    }
    return state, fold


def _save_checked(state, path: Path) -> None:
    torch.save(state, path)
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    if unsafe:
        raise ExportError(f"the exported file would need {', '.join(unsafe)} to load with "
                          "weights_only=True (a bug in the export: please report it)")


def _load_stock(path: Path, data: Optional[str]):
    from fairseq import checkpoint_utils

    models, _, _ = checkpoint_utils.load_model_ensemble_and_task(
        [str(path)], arg_overrides={"data": data} if data else None)
    return models[0].eval()


def _convert_ctranslate2(path: Path, data: str, target: Path, quantization: Optional[str]):
    try:
        from ctranslate2.converters import FairseqConverter
    except ImportError:
        raise ExportError("--ctranslate2 needs CTranslate2: pip install "
                          "'fairseq-admin-pos[deploy]' (ctranslate2==4.8.5)") from None
    try:
        FairseqConverter(str(path), data).convert(str(target), quantization=quantization)
    except (ValueError, NotImplementedError, RuntimeError) as e:
        first = str(e).strip().splitlines()
        raise ExportError("CTranslate2's FairseqConverter refused the exported model: "
                          + " ".join(line.strip() for line in first)) from None


def _tmp_file(near: Path) -> Path:
    fd, name = tempfile.mkstemp(dir=near.parent, prefix=f".{near.name}.", suffix=".tmp")
    os.close(fd)
    # mkstemp makes it private (0600); the export gets the mode a new file gets here
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(name, 0o666 & ~umask)
    return Path(name)


def _check_paths(checkpoint: str, out: str, ctranslate2: Optional[str],
                 quantization: Optional[str]) -> Tuple[Path, Path, Optional[Path]]:
    """Refuse, before anything is loaded, paths an export cannot be written to; returns
    the checkpoint's, the export's and the CTranslate2 folder's paths."""
    source, out_path = Path(checkpoint), Path(out)
    ct2_path = Path(ctranslate2) if ctranslate2 else None
    if not source.is_file():
        raise ExportError(f"CHECKPOINT {checkpoint}: no such file")
    if not out_path.parent.is_dir():
        raise ExportError(f"--out {out}: folder {out_path.parent} does not exist")
    if out_path.exists() and out_path.is_dir():
        raise ExportError(f"--out {out} is a folder; give the file name of the export")
    if out_path.resolve() == source.resolve():
        raise ExportError("--out is CHECKPOINT itself; write the export to another file")
    if quantization is not None and ct2_path is None:
        raise ExportError("--quantization applies to the CTranslate2 model: add --ctranslate2 DIR")
    if ct2_path is not None:
        if ct2_path.exists() and (not ct2_path.is_dir() or any(ct2_path.iterdir())):
            raise ExportError(f"--ctranslate2 {ctranslate2} exists and is not an empty folder; "
                              "remove it or choose another")
        if not ct2_path.parent.is_dir():
            raise ExportError(f"--ctranslate2 {ctranslate2}: folder {ct2_path.parent} does "
                              "not exist")
    return source, out_path, ct2_path


def _write_ctranslate2(raw, model, cfg, layout, source: Path, fold, tmp: Path, out_path: Path,
                       ct2_path: Path, tmp_dir: Path, data_dir: str, quantization: Optional[str],
                       scalar_fold: str, tmp_files: List[Path], log) -> None:
    """Convert the checked stock checkpoint ``tmp`` into ``ct2_path`` through the caller's
    temporary folder ``tmp_dir`` beside it (renamed at the end; the caller removes the
    rest). Extra temporary files are appended to ``tmp_files`` for the caller to remove."""
    ct2_source = tmp
    if set(fold.positions.values()) == {"none"}:
        # CTranslate2's converter refuses --no-token-positional-embeddings: it
        # converts the same model with all-zero learned position tables
        zstate, _ = _export_state(raw, model, cfg, layout, source,
                                  none_as_zero_table=True, scalar_fold=scalar_fold)
        ct2_source = _tmp_file(out_path)
        tmp_files.append(ct2_source)
        _save_checked(zstate, ct2_source)
        log("no positions on either side: CTranslate2 gets all-zero learned position "
            "tables (its converter refuses --no-token-positional-embeddings)")
    _convert_ctranslate2(ct2_source, data_dir, tmp_dir / "model", quantization)
    if ct2_path.exists():
        ct2_path.rmdir()  # empty (checked before the export began)
    os.rename(tmp_dir / "model", ct2_path)


def export(checkpoint: str, out: str, data: Optional[str] = None,
           ctranslate2: Optional[str] = None, quantization: Optional[str] = None,
           scalar_fold: str = "output", log=print) -> ExportReport:
    """Export ``checkpoint`` to the stock fairseq checkpoint ``out`` (and, with
    ``ctranslate2``, a CTranslate2 model folder). ``data``: the folder with the
    dictionaries when the checkpoint's own data path is not here (it is used to build the
    models and by CTranslate2's converter; the exported file keeps the original path).
    ``scalar_fold``: :data:`fairseq_admin_pos.export.fold.SCALAR_FOLDS`.

    Raises :class:`ExportError` / :class:`~fairseq_admin_pos.export.fold.NotExportable`
    with one-line messages; on any failure nothing is left at ``out`` or ``ctranslate2``
    (an existing ``out`` stays as it was).
    """
    source, out_path, ct2_path = _check_paths(checkpoint, out, ctranslate2, quantization)

    raw, model, cfg, task = _load_original(source, data)
    layout = model_layout(model, cfg.model)
    model_state = model.state_dict()
    _check_supported(cfg.model, layout, model_state, scalar_fold)
    data_dir = data or _original_data(raw)

    tmp_files: List[Path] = []
    tmp_dir: Optional[Path] = None
    try:
        state, fold = _export_state(raw, model, cfg, layout, source, none_as_zero_table=False,
                                    scalar_fold=scalar_fold)
        tmp = _tmp_file(out_path)
        tmp_files.append(tmp)
        _save_checked(state, tmp)
        stock = _load_stock(tmp, data)
        diff = _self_check(model, stock, task)
        if not diff <= SELF_CHECK_TOLERANCE:
            raise ExportError(f"self-check failed: the exported model's log-probabilities "
                              f"differ from the original's by {diff:.3g} (> "
                              f"{SELF_CHECK_TOLERANCE:g}); nothing written. Please report it")
        if ct2_path is not None:
            tmp_dir = Path(tempfile.mkdtemp(dir=ct2_path.parent, prefix=f".{ct2_path.name}."))
            _write_ctranslate2(raw, model, cfg, layout, source, fold, tmp, out_path, ct2_path,
                               tmp_dir, data_dir, quantization, scalar_fold, tmp_files, log)
        os.replace(tmp, out_path)
        tmp_files.remove(tmp)
    finally:
        for f in tmp_files:
            f.unlink(missing_ok=True)
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)

    return ExportReport(out=out_path, ctranslate2=ct2_path, scheme=layout.scheme,
                        folds=fold.folds, eps_scales=fold.eps_scales,
                        max_abs_logprob_diff=diff, positions=fold.positions,
                        unshared=fold.unshared)
