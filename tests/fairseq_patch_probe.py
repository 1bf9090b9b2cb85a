"""Run in a new interpreter by tests/test_fairseq_patches.py: checks tables of replaced
fairseq functions (``fairseq_admin_pos/fairseq_fixes/patches.py``, or a copy the test
changed) against the installed fairseq, before and after the plugin is imported the way
``--user-dir`` imports it. Prints one JSON report per table given:
{"missing": [...], "not_replaced": [...], "unlisted": [...]}, each entry one line naming
the module and attribute.

    python tests/fairseq_patch_probe.py USER_DIR TABLE.py [TABLE.py ...]
"""
import argparse
import functools
import importlib.util
import inspect
import json
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_table(path: str, index: int):
    """The table module alone, without importing the package (whose import would register
    the plugin)."""
    spec = importlib.util.spec_from_file_location(f"_admin_patch_table{index}", path)
    table = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = table  # dataclasses look their module up there
    spec.loader.exec_module(table)
    return table


WATCHED = ("sys", "fairseq", "fairseq_cli", "hydra")


def watched_modules():
    """The loaded modules of fairseq, its tools, hydra and ``sys``, by their own name (fairseq
    also lists ``fairseq.distributed.utils`` as ``fairseq.distributed_utils``)."""
    found = {}
    for m in list(sys.modules.values()):
        name = getattr(m, "__name__", None)
        if isinstance(m, types.ModuleType) and isinstance(name, str) \
                and any(name == w or name.startswith(w + ".") for w in WATCHED):
            found[name] = m
    return found


def snapshot():
    """(module, attribute) -> the object, for every attribute of the watched modules and of
    the classes they define (``Class.attr``)."""
    seen = {}
    for name, module in watched_modules().items():
        for attr, value in list(vars(module).items()):
            seen[name, attr] = value
            if inspect.isclass(value) and value.__module__ == name:
                for cattr, cvalue in list(vars(value).items()):
                    seen[name, f"{value.__qualname__}.{cattr}"] = cvalue
    return seen


def defined_in(obj):
    """The source file of the code behind ``obj`` (a function, a partial, a bound method, a
    property's getter or any other object's class)."""
    while isinstance(obj, functools.partial):
        obj = obj.func
    obj = getattr(obj, "__func__", obj)
    code = getattr(obj, "__code__", None)
    if code is not None:
        return str(Path(code.co_filename).resolve())
    return str(Path(inspect.getfile(type(obj))).resolve())


def wraps_original(current, original, depth=4):
    """``current`` calls ``original``: reached through ``__wrapped__`` (functools.wraps) or a
    partial's first argument (the previous ``sys.excepthook``)."""
    for _ in range(depth):
        if current is original:
            return True
        if isinstance(current, functools.partial) and current.args:
            current = current.args[0]
        else:
            current = getattr(current, "__wrapped__", None)
    return current is original


def module_file(dotted_function):
    module = dotted_function.rsplit(".", 1)[0]
    path = REPO / Path(*module.split("."))
    return str((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).resolve())


def fairseqs_own(key, value) -> bool:
    """fairseq's ``import_user_module`` itself adds ``fairseq.models.<model>_parser`` (an
    argparse parser, "for sphinx") for each model of a plugin's ``models`` folder."""
    return key[0] == "fairseq.models" and key[1].endswith("_parser") \
        and isinstance(value, argparse.ArgumentParser)


def find_targets(table, report):
    """target -> (owner, name, fairseq's object), before the plugin is imported."""
    originals = {}
    for patch in table.PATCHES:
        try:
            owner, name = table.resolve(patch)
        except table.PatchTargetMissing as e:
            report["missing"].append(str(e))
            continue
        originals[patch.target] = (owner, name, getattr(owner, name))
    return originals


def check_replaced(table, originals, report):
    for patch in table.PATCHES:
        if patch.when != "register" or patch.target not in originals:
            continue
        owner, name, original = originals[patch.target]
        current = getattr(owner, name)
        if current is original or defined_in(current) != module_file(patch.patched_by) \
                or not wraps_original(current, original):
            report["not_replaced"].append(
                f"{patch.target}: after importing the plugin it is not the replacement made "
                f"in {patch.patched_by} wrapping fairseq's own (found {current!r})")


def check_listed(table, before, after, report):
    listed = {(p.module, p.attribute) for p in table.PATCHES}
    for key, value in after.items():
        if key in listed or inspect.ismodule(value) or fairseqs_own(key, value):
            continue
        if key not in before or before[key] is not value:
            report["unlisted"].append(
                f"{key[0]}.{key[1]}: replaced when the plugin was imported, but not listed "
                "in fairseq_admin_pos/fairseq_fixes/patches.py")


def main(user_dir, table_paths):
    # what fairseq's tools import before they import the plugin through --user-dir
    import fairseq  # noqa: F401
    import fairseq_cli.generate  # noqa: F401
    import fairseq_cli.hydra_train  # noqa: F401
    import fairseq_cli.train  # noqa: F401

    tables = [load_table(path, i) for i, path in enumerate(table_paths)]
    reports = [{"missing": [], "not_replaced": [], "unlisted": []} for _ in tables]
    originals = [find_targets(t, r) for t, r in zip(tables, reports)]
    before = snapshot()

    from fairseq.utils import import_user_module

    import_user_module(argparse.Namespace(user_dir=user_dir))
    after = snapshot()
    for table, found, report in zip(tables, originals, reports):
        check_replaced(table, found, report)
        check_listed(table, before, after, report)
    print(json.dumps(reports))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
