"""``admin_transformer`` under ``fairseq-hydra-train``: its config dataclass and the hand-over.

``admin_transformer`` is registered the argparse way, like fairseq's own ``transformer``:
``add_args`` declares the flags without defaults and each ``--arch`` function fills in what
was not given with ``getattr(args, name, default)``. ``fairseq-hydra-train`` gives the model
the config file's ``model:`` section as a ``DictConfig``. fairseq runs the ``_name``
architecture function on it (with omegaconf >= 2.1 ``getattr`` defaults work on a
``DictConfig``; the pinned omegaconf 2.0 of fairseq#4675 on GitHub returned ``None``), but then
``TransformerConfig.from_namespace`` copies only stock Transformer fields out of a
``DictConfig``: every plugin setting is lost and building the model stops with
``AttributeError: invalid argument admin_init.``

What this module does:

* :func:`config_dataclass` generates ``AdminTransformerConfig`` from the model's own
  ``add_args`` (fairseq's Transformer flags, flat as ``fairseq-train`` names them, plus the
  plugin's ``--admin-*`` and ``--*-pos-emb`` flags): one field per flag, same name, type,
  choices and help, default ``None`` = "not given: the architecture decides". A flag added
  to ``add_args`` (or ``add_profile_args``) is a hydra setting with no second edit.
* :func:`namespace_from_config` turns the model section into the namespace ``fairseq-train``
  would have built: the run's other sections flattened (``seed``, ``max_tokens``, ``data``,
  ...), the model's keys on top (each key, type and choice checked against the dataclass,
  errors naming ``model.<key>`` and its flag), then the ``_name`` architecture's defaults.
  ``AdminTransformerModel.build_model`` continues from there with the code ``fairseq-train``
  runs, so both entry points build the same model from the same settings.

The dataclass is not put in fairseq's ``MODEL_DATACLASS_REGISTRY`` (nor attached with
``register_model(..., dataclass=...)``), because fairseq cannot mix the two kinds for one
model: ``fairseq-train`` keeps an argparse model's settings as an ``argparse.Namespace``, and
its ``add_defaults`` then tries to merge that namespace into the registered dataclass and
stops with ``ValueError: Invalid input. Supports one of [dict,list,DictConfig,...]``;
attaching it instead makes ``fairseq-train`` convert its namespace into the dataclass, which
keeps only model fields (``--admin-init profile`` reads the batch size, seed and data from
that namespace) and changes what checkpoints hold. Under hydra a registered dataclass would
also be merged with every field present, ``None`` where not given, so the architecture
functions' ``getattr`` defaults would no longer fire.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
from typing import Any, Callable, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fairseq.dataclass import FairseqDataclass

from fairseq_admin_pos.errors import AdminFlagError

#: config groups whose ``_name`` is a flag of its own in fairseq-train's namespace
_REGISTRY_GROUPS = ("task", "criterion", "optimizer", "lr_scheduler", "bpe", "tokenizer",
                    "scoring")


def flag_actions(add_args: Callable) -> List[argparse.Action]:
    """The argparse actions ``add_args`` declares (one per flag), in declaration order."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_args(parser)
    return [a for a in parser._actions if a.dest != argparse.SUPPRESS and a.option_strings]


def _field_type(action: argparse.Action):
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return Optional[bool]
    if action.type in (int, float, str):
        return Optional[action.type]
    # no type (argparse keeps the string; fairseq leaves it out for fields whose default is
    # an interpolation, e.g. decoder_output_dim) or fairseq's comma-separated lists: the
    # value is passed on as the config file gives it
    return Any


def config_dataclass(name: str, add_args: Callable) -> type:
    """A flat FairseqDataclass with one ``Optional`` field per flag of ``add_args``."""
    fields = []
    for action in flag_actions(add_args):
        metadata = {"help": action.help, "flag": action.option_strings[0]}
        if action.choices is not None:
            metadata["choices"] = list(action.choices)
        fields.append((action.dest, _field_type(action),
                       dataclasses.field(default=None, metadata=metadata)))
    dc = dataclasses.make_dataclass(name, fields, bases=(FairseqDataclass,))
    dc.__module__ = __name__
    dc.__doc__ = (f"Generated from the model's add_args: {len(fields)} settings, each the "
                  "flag of the same name; None = not given (the architecture decides).")
    return dc


def _flag(dc: type, key: str) -> str:
    return dc.__dataclass_fields__[key].metadata["flag"]


def _run_settings(model_cfg: DictConfig) -> Dict[str, Any]:
    """The run's other config sections, flattened like fairseq-train's namespace (the first
    section holding a key wins, as the first parser group defining a flag does there)."""
    parent = model_cfg._get_parent()
    if not isinstance(parent, DictConfig):
        return {}
    from fairseq.dataclass.configs import FairseqConfig

    flat: Dict[str, Any] = {}
    for group in FairseqConfig.__dataclass_fields__:
        node = parent.get(group) if group != "model" else None
        if not isinstance(node, DictConfig):
            continue
        values = OmegaConf.to_container(node, resolve=True)
        if group in _REGISTRY_GROUPS and values.get("_name") is not None:
            flat.setdefault(group, values["_name"])
        for key, value in values.items():
            if key != "_name":
                flat.setdefault(key, value)
    return flat


def _model_settings(model_cfg: DictConfig, dc: type, arch_fn: Callable) -> Dict[str, Any]:
    """The model section's given keys, checked: known key, right type, valid choice."""
    given = {k: v for k, v in OmegaConf.to_container(model_cfg, resolve=True).items()
             if k not in ("_name", "arch") and v is not None}
    fields = dc.__dataclass_fields__
    # keys an architecture function sets that are no flag (e.g. decoder_input_dim): they
    # come back from checkpoints written by hydra runs
    arch_keys = set(vars(_apply(arch_fn, argparse.Namespace())))
    for key in given:
        if key not in fields and key not in arch_keys:
            close = difflib.get_close_matches(key, list(fields), n=3)
            hint = f"; did you mean {' or '.join('model.' + c for c in close)}?" if close else "."
            raise AdminFlagError(
                f"model.{key} is not a setting of admin_transformer{hint} Its settings are "
                "the flags of `fairseq-train --arch admin_transformer --help` with '-' "
                "written '_' (e.g. --admin-init -> model.admin_init)."
            )
    typed = {k: v for k, v in given.items() if k in fields}
    for key, value in typed.items():
        choices = fields[key].metadata.get("choices")
        if choices is not None and value not in choices:
            raise AdminFlagError(
                f"model.{key}={value!r} ({_flag(dc, key)}) is not valid; valid choices: "
                f"{', '.join(map(str, choices))}"
            )
    try:
        merged = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(dc), typed))
    except OmegaConfBaseException as e:
        key = str(getattr(e, "key", None) or getattr(e, "full_key", "?"))
        msg = str(e).splitlines()[0]
        flag = f" ({_flag(dc, key)})" if key in fields else ""
        raise AdminFlagError(f"model.{key}={typed.get(key)!r}{flag}: {msg}") from None
    return {k: (merged[k] if k in fields else v) for k, v in given.items()}


def _apply(arch_fn: Callable, ns: argparse.Namespace) -> argparse.Namespace:
    arch_fn(ns)
    return ns


def namespace_from_config(model_cfg: DictConfig, dc: type) -> argparse.Namespace:
    """The argparse namespace ``fairseq-train`` would give the model, from hydra's
    ``model`` section (and the rest of the run's config it belongs to)."""
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_INV_REGISTRY

    arch = model_cfg.get("_name") or model_cfg.get("arch")
    if arch not in ARCH_CONFIG_REGISTRY:
        valid = ", ".join(ARCH_MODEL_INV_REGISTRY.get("admin_transformer", []))
        raise AdminFlagError(f"model._name={arch!r} is not an admin_transformer architecture; "
                         f"valid choices: {valid}")
    arch_fn = ARCH_CONFIG_REGISTRY[arch]
    settings = _run_settings(model_cfg)
    settings.update(_model_settings(model_cfg, dc, arch_fn))
    settings["arch"] = settings["_name"] = arch
    return _apply(arch_fn, argparse.Namespace(**settings))
